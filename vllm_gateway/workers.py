"""The one source of truth for the fleet: each `Worker`, its state, and the registry of them.

Background tasks (probes, scrapes, registration) and the dispatcher change worker state only
through `WorkerRegistry` methods. Each transition method answers "did anything change?" and
logs only when it did, so logs show the fleet's history and not its heartbeat.

States: joining (known, not yet seen healthy) -> ready -> draining -> removed, plus
unhealthy (failed probes). Beside the state, each worker has a circuit (closed, open,
half-open) that the passive breaker (breaker.py) moves on request outcomes. `available` is
the one predicate every policy asks: ready, and a circuit that lets a request through
(closed, or half-open with nothing in flight: one trial at a time).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from vllm_gateway.log import get_logger

log = get_logger("vllm_gateway.workers")


class WorkerState(enum.StrEnum):
    JOINING = "joining"
    READY = "ready"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"
    REMOVED = "removed"


class Source(enum.StrEnum):
    """Where a worker came from, and so who may retire it (docs/fleet.md).

    A `StrEnum`: `worker.source == "static"` keeps working, and the value is what
    /list_workers, /admin/workers and the `worker_info` metric show.
    """

    STATIC = "static"  # the config file, --worker, VLLM_GATEWAY_WORKERS: a reload owns them
    REGISTERED = "registered"  # POST /register_worker (FastChat's API, the register agent)
    ADMIN = "admin"  # POST /admin/workers/add: an operator's
    DNS = "dns"  # an address of a [[discovery.dns]] name
    KUBERNETES = "kubernetes"  # a ready endpoint of a [[discovery.kubernetes]] Service


class Circuit(enum.StrEnum):
    """The passive breaker's verdict on a worker (see breaker.py)."""

    CLOSED = "closed"  # requests flow
    OPEN = "open"  # too many failures in a row: no requests until the open time passes
    HALF_OPEN = "half_open"  # one trial request at a time; success closes, failure reopens


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One scrape of a worker's /metrics, summed over its engines."""

    running: float  # vllm:num_requests_running
    waiting: float  # vllm:num_requests_waiting
    kv_cache_usage: float | None  # vllm:kv_cache_usage_perc, 0..1, None when not reported
    at: float  # time.monotonic() of the scrape
    # KV cache size in tokens (vllm:cache_config_info: num_gpu_blocks x block_size, summed
    # over engines); None when not reported.
    cache_tokens: float | None = None
    # vllm:prefix_cache_queries_total and _hits_total (prompt tokens looked up, and found
    # cached; counters since the worker started); None when not reported.
    cache_queries: float | None = None
    cache_hits: float | None = None
    # vllm:prompt_tokens_total and vllm:request_success_total (every finished_reason):
    # prompt tokens processed and requests finished, since it started; None when absent.
    prompt_tokens: float | None = None
    requests_done: float | None = None


# Weight of the newest scrape's miss share (per scrape, 4 per second by default): about a
# second of memory, so the figure follows a worker that starts evicting within a second or
# two, and one scrape that saw a single cold prompt moves it only part of the way.
MISS_WEIGHT = 0.25
# Time constant of a worker's rate of missed prompt tokens (`Worker.miss_rate`), in seconds: about
# the time a conversation takes to come back (an answer and the user's next message), the
# span over which what a cache is sent decides what it still holds for a returning turn.
PRESSURE_SECONDS = 4.0
# Missed tokens per second added to every worker's rate in its `Worker.pressure`: so one
# that missed nothing lately is not infinitely preferred (it stays positive); no more.
PRESSURE_FLOOR = 1.0


def note_cache(worker: Worker, before: EngineStats | None, now: EngineStats) -> None:
    """Fold the prefix-cache counters' increase since the last scrape into `worker.miss`,
    `worker.miss_rate` and `worker.pressure` (those two back to 0, unknown, when the
    counters are gone or went back, a restarted engine's cache being empty; the pressure
    alone when the cache size is gone)."""
    if now.cache_queries is None or now.cache_hits is None:
        forget_rate(worker)
        return
    if before is None or before.cache_queries is None or before.cache_hits is None:
        return
    queried = now.cache_queries - before.cache_queries
    hit = now.cache_hits - before.cache_hits
    if not 0 <= hit <= queried < math.inf:  # restarted, nonsense
        forget_rate(worker)
        return
    dt = now.at - before.at
    if 0 < dt < math.inf:
        # Tokens it prefilled (the prompt it did not hold) per second, averaged over the
        # span seen since the last reset (`miss_seen`: the weight that span has; the first
        # interval alone is the whole average, not a sixteenth of it).
        a = -math.expm1(-dt / PRESSURE_SECONDS)
        worker.miss_seen += a * (1.0 - worker.miss_seen)
        worker.miss_rate += a / worker.miss_seen * ((queried - hit) / dt - worker.miss_rate)
    tokens = now.cache_tokens or 0.0  # (capped at scrape: fleet/scrape.py)
    ok = 0 < tokens < math.inf and worker.miss_seen > 0  # (and a rate measured)
    worker.pressure = (worker.miss_rate + PRESSURE_FLOOR) / tokens if ok else 0.0
    if queried > 0:  # (idle: no share to learn)
        worker.miss += MISS_WEIGHT * (1.0 - hit / queried - worker.miss)


def forget_rate(worker: Worker) -> None:
    """Its missed-token rate and cache pressure unknown again (0), their average restarted."""
    worker.miss_rate = worker.pressure = worker.miss_seen = 0.0


class Worker:
    """One vLLM server behind the gateway, and what the gateway knows of it right now."""

    __slots__ = (
        "backlog",
        "breaker_openings",
        "capacity",
        "circuit",
        "completed",
        "consecutive_failures",
        "failed",
        "finished_since_scrape",
        "inflight",
        "inflight_by_model",
        "kv_binds",
        "kv_free",
        "max_num_seqs",
        "miss",
        "miss_rate",
        "miss_seen",
        "models",
        "others",
        "others_at",
        "pace",
        "pinned_models",
        "prefill_bytes",
        "prefill_seconds",
        "pressure",
        "sent_since_scrape",
        "source",
        "state",
        "state_reason",
        "stats",
        "token_bytes",
        "url",
        "weight",
    )

    def __init__(
        self,
        url: str,
        *,
        models: Iterable[str] = (),
        weight: float = 1.0,
        source: Source = Source.STATIC,
        max_num_seqs: int = 0,
    ) -> None:
        self.url = url
        # Pinned models are the operator's word: probes do not change them.
        self.pinned_models: frozenset[str] = frozenset(models)
        self.models: frozenset[str] = self.pinned_models
        self.weight = weight
        self.source = Source(source)  # who owns its life (a str of a known source is fine)
        self.state = WorkerState.JOINING
        self.state_reason = "added"
        self.inflight = 0  # requests the gateway has sent and not yet seen finish
        # Prefill it owes this process's streamed requests not yet answered with a first
        # byte: the prompt bytes it probably does not cache (dispatch/lease.py).
        self.backlog = 0
        # From its own prefix-cache counters (`note_cache`; 0 while unknown): the share of
        # prompt tokens it missed lately, the tokens it prefilled per second, and that rate
        # over its KV cache in tokens (how fast its cache turns over: policies/pressure.py).
        self.miss = self.miss_rate = self.pressure = self.miss_seen = 0.0
        # In flight by the model each lease asked for (not demand for its others); no zeros.
        self.inflight_by_model: dict[str, int] = {}
        # Requests it runs at once, as the operator declared it (its vLLM --max-num-seqs);
        # 0: not declared, dispatch learns it (dispatch/buckets.py).
        self.max_num_seqs = max_num_seqs
        self.sent_since_scrape = self.finished_since_scrape = 0  # sent, ended since `stats`
        self.stats: EngineStats | None = None  # None: never scraped, or the snapshot is stale
        # Whether its KV cache has been seen to bind (vLLM kept requests waiting while it
        # ran far fewer than it has run), and `kv_free`: the tokens its free KV blocks hold
        # at its last scrape; infinite while not reported, stale, or read full with no
        # queue on a worker not known to bind (dispatch/kv_queue.py).
        self.kv_binds = False
        self.kv_free = math.inf
        self.token_bytes = 0.0  # request bytes per prompt token, measured (kv_queue.py); 0: not yet
        # Requests other senders (other replicas, sibling processes, direct clients) had on
        # it at its last scrape: what it reported running and waiting beyond the most of
        # this process's requests it may have counted. With one gateway process alone, 0,
        # but for requests the worker counts more than once (vLLM runs `n` > 1 or a list of
        # prompts as several) or has not yet seen end (an abort). Counted low while a scrape
        # is out (a request sent then counts as this process's). 0 without a fresh scrape.
        self.others = 0.0
        self.others_at = -math.inf  # `EngineStats.at` of the last scrape with `others` >= 1
        # Learned by dispatch from completed requests: 1 / typical request duration, in
        # requests per second per running request. 0 until the first completion. Then the
        # time to streamed first bytes and the prefill bytes awaited (prefill_rate.py).
        self.pace = 0.0
        self.prefill_seconds = self.prefill_bytes = 0.0
        # Requests it runs at once as dispatch knows it (configured, learned from its
        # queue, or the probing limit; dispatch/buckets.py); 0 while unknown.
        self.capacity = 0.0
        self.completed = self.failed = 0
        self.circuit = Circuit.CLOSED
        self.consecutive_failures = 0  # failed leases since the last success (breaker.py)
        self.breaker_openings = 0  # times the circuit opened (telemetry reads it)

    @property
    def available(self) -> bool:
        """May take a new request: ready (not joining, draining, unhealthy or removed) and
        the circuit lets it through (closed, or half-open with no request in flight)."""
        if self.state is not WorkerState.READY:
            return False
        circuit = self.circuit
        return circuit is Circuit.CLOSED or (circuit is Circuit.HALF_OPEN and self.inflight == 0)

    def inflight_for(self, model: str) -> int:
        """Requests for `model` the gateway has in flight on this worker."""
        if len(self.models) <= 1 and not self.inflight_by_model:
            return self.inflight  # counted without a model (only tests build such workers)
        return self.inflight_by_model.get(model, 0)

    def share_of(self, model: str) -> float:
        """The fraction of this worker's load that is `model`'s: its share of the in-flight
        requests; with none in flight, an even split of what the worker serves (so the
        shares of a worker's models add up to 1 and no load is counted twice)."""
        if len(self.models) <= 1:
            return 1.0 if model in self.models or not self.models else 0.0
        if self.inflight:
            return self.inflight_for(model) / self.inflight
        return 1.0 / len(self.models) if model in self.models else 0.0

    def __repr__(self) -> str:
        return f"Worker({self.url!r}, {self.state}, inflight={self.inflight})"


class WorkerRegistry:
    """All workers by URL, with a cached model -> workers index for the hot path."""

    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}
        self._by_model: dict[str, tuple[Worker, ...]] | None = None
        # Called (without arguments) after any change that may give a waiting request a
        # worker: a worker became ready, gained a model, or was added.
        self.listeners: list[Callable[[], None]] = []
        # Called with the worker after each new (or withdrawn) `EngineStats`.
        self.stats_listeners: list[Callable[[Worker], None]] = []

    # --- reading ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def serving(self, model: str) -> tuple[Worker, ...]:
        """Workers (in any state but removed) that serve `model`."""
        index = self._by_model
        if index is None:
            index = self._by_model = self._index()
        return index.get(model, ())

    def known_models(self) -> list[str]:
        """Every model some worker serves, whatever its state; sorted."""
        index = self._by_model if self._by_model is not None else self._index()
        return sorted(index)

    def ready_models(self) -> list[str]:
        """Models with at least one ready worker; sorted."""
        return sorted({m for w in self._workers.values() if w.available for m in w.models})

    def _index(self) -> dict[str, tuple[Worker, ...]]:
        index: dict[str, list[Worker]] = {}
        for w in self._workers.values():
            for m in w.models:
                index.setdefault(m, []).append(w)
        return {m: tuple(ws) for m, ws in index.items()}

    # --- changing --------------------------------------------------------------------------

    def add(
        self,
        url: str,
        *,
        models: Iterable[str] = (),
        weight: float = 1.0,
        source: Source = Source.STATIC,
        max_num_seqs: int = 0,
    ) -> tuple[Worker, bool]:
        """Add a worker (joining) unless known; return it and whether it was new."""
        worker = self._workers.get(url)
        if worker is not None:
            return worker, False
        worker = Worker(url, models=models, weight=weight, source=source, max_num_seqs=max_num_seqs)
        self._workers[url] = worker
        self._changed()
        log.info("worker added", worker=url, source=str(source), models=sorted(worker.models))
        return worker, True

    def remove(self, url: str, reason: str) -> Worker | None:
        """Forget a worker; requests already relayed to it finish. Return it, or None."""
        worker = self._workers.pop(url, None)
        if worker is None:
            return None
        worker.state = WorkerState.REMOVED
        worker.state_reason = reason
        self._changed()
        log.info("worker removed", worker=url, reason=reason)
        return worker

    def set_state(self, worker: Worker, state: WorkerState, reason: str) -> bool:
        """Move a worker to `state`; log and return True only if that is a change."""
        if worker.state is state or worker.state is WorkerState.REMOVED:
            return False
        old = worker.state
        worker.state = state
        worker.state_reason = reason
        self._changed()
        # By meaning: losing capacity is a WARNING (what an operator alerts on), the rest INFO.
        emit = log.warning if state is WorkerState.UNHEALTHY else log.info
        emit("worker state", worker=worker.url, old=str(old), new=str(state), reason=reason)
        return True

    def set_circuit(self, worker: Worker, circuit: Circuit, reason: str) -> bool:
        """Move a worker's circuit; log and return True only if that is a change."""
        if worker.circuit is circuit or worker.state is WorkerState.REMOVED:
            return False
        old = worker.circuit
        worker.circuit = circuit
        if circuit is Circuit.OPEN:
            worker.breaker_openings += 1
        if circuit is not Circuit.OPEN:
            self._changed()  # it may take requests again
        emit = log.warning if circuit is Circuit.OPEN else log.info  # open: capacity lost
        emit("worker circuit", worker=worker.url, old=str(old), new=str(circuit), reason=reason)
        return True

    def set_weight(self, worker: Worker, weight: float) -> bool:
        """Change a worker's relative share of traffic."""
        if worker.weight == weight:
            return False
        old, worker.weight = worker.weight, weight
        log.info("worker weight", worker=worker.url, old=old, new=weight)
        return True

    def set_models(self, worker: Worker, models: Iterable[str]) -> bool:
        """Record the models a worker reports serving (ignored when pinned by config)."""
        if worker.pinned_models:
            return False
        new = frozenset(models)
        if new == worker.models:
            return False
        worker.models = new
        self._changed()
        log.info("worker models", worker=worker.url, models=sorted(new))
        return True

    def reconfigure(
        self, worker: Worker, *, models: Iterable[str], weight: float, max_num_seqs: int = 0
    ) -> bool:
        """Apply new config-file settings to a worker (pinned models, weight, batch size)."""
        pinned = frozenset(models)
        if (pinned, weight, max_num_seqs) == (
            worker.pinned_models,
            worker.weight,
            worker.max_num_seqs,
        ):
            return False
        worker.pinned_models = pinned
        if pinned:
            worker.models = pinned  # unpinned: the next probe reports what it serves
        worker.weight = weight
        worker.max_num_seqs = max_num_seqs
        self._changed()
        log.info("worker configured", worker=worker.url, models=sorted(pinned), weight=weight)
        return True

    def set_stats(
        self,
        worker: Worker,
        stats: EngineStats | None,
        *,
        sent: int = 0,
        finished: int = 0,
        own: float | None = None,
    ) -> None:
        """Record a scrape, or withdraw a stale one (None).

        `sent` and `finished` are the worker's `*_since_scrape` counts when the scrape was
        taken: those requests are now part of what it reports; later ones are not. `own`:
        the most of this process's requests the page may count (default: its in-flight
        count now); what the page counts beyond that is `Worker.others`.
        """
        worker.kv_free = math.inf
        if stats is not None:
            note_cache(worker, worker.stats, stats)
            mine = worker.inflight if own is None else own
            worker.others = max(0.0, stats.running + stats.waiting - mine)
            if worker.others >= 1.0:
                worker.others_at = stats.at
        else:
            worker.others = 0.0
            forget_rate(worker)  # (stale: not weighed until scraped again)
        worker.stats = stats
        worker.sent_since_scrape = max(0, worker.sent_since_scrape - sent)
        worker.finished_since_scrape = max(0, worker.finished_since_scrape - finished)
        for listener in self.stats_listeners:
            listener(worker)

    def _changed(self) -> None:
        self._by_model = None
        for listener in self.listeners:
            listener()

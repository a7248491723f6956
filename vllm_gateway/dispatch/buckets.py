"""Token buckets: how many more requests each worker may be sent, driven by its own queue.

A token is the right to send one request now; sending takes one. A load-aware policy only
chooses among workers holding a token; when none holds one, the request waits in the
admission queue. Tokens come from three sources (docs/dispatch.md has the figure):

- Each scrape re-fills the bucket from what the worker reports. Once its capacity is
  learned (below), the bucket holds the room it has: capacity minus its reported running
  and waiting, minus what was sent (plus what finished) since the scrape. Before that,
  the bucket is open (no limit, full speed) while the worker reports an empty waiting
  queue, and empty once it reports one. A worker reporting `stop_waiting` requests
  waiting gets nothing new until its queue shrinks (or stays still: next).
- A queue on its page for `FROZEN_AFTER` seconds with none of ours there (frozen, or kept
  up by others; a stopped worker's only if still) earns one token (still_queue.py).
- Each request the worker finishes earns `gain = 1 - waiting / stop_waiting` tokens
  (waiting as last reported): one per finish, a freed batch slot, while its queue is
  empty; fewer as its queue grows, so it drains; none above the threshold. A worker twice
  as fast finishes twice as many requests, so it earns twice the tokens: the refill rate
  is its completion pace times the gain.

In front of the bucket stands the capacity gate: a worker is full, and takes nothing new,
while this process's in-flight requests to it reach its capacity, or they and what
other senders had on it at its last scrape (`Worker.others`: other replicas, sibling
processes of `serve --processes N`, clients that go around the gateway) do; siblings and
replicas told of each other count each other's requests there as they start and end, in
between (process/placement_sharing.py). A sibling process is gated as a replica is: by its
own requests and the others', not by a fixed 1/N of the capacity (measured:
docs/dispatch-rounds.md). So requests wait in the gateway, where the first slot freed
anywhere takes the head of the admission queue, and not inside a full worker's queue,
also before anything was learned. The capacity is, first found first:

1. the worker's `max_num_seqs` from the configuration, when given;
2. learned: when a worker reports a waiting queue, the number it has running is as many
   as it can run now. While it runs that many with an empty queue, and has shown no queue
   for its holdoff (`PROBE_HOLDOFF` seconds at first), the estimate grows by 1, then 2,
   3, ... per scrape, so a worker that can take more (or an estimate caught low) is found
   out. Overshooting puts a request or two in the worker's own queue; when that confirms
   the same capacity again, the holdoff doubles (up to `PROBE_HOLDOFF_MAX`), so a worker
   at its true capacity is probed ever more rarely;
3. before that, a probing limit: `PROBE_START` at first. When the worker runs all of it
   with no queue and more is wanted, the limit admits a few requests past the level (a
   probe: `PROBE_STEP` of the level, at least one). A scrape that shows the worker running
   more than the level doubles the level (slow start), and while requests wait in the
   gateway for it, probes past the new one at once (limits 8, 9, 18, 36, 72, ...: one
   scrape each); one that shows a queue teaches the capacity, unless the queue may be
   the KV cache's (kv_queue.py): then it teaches nothing.

The level doubles only on evidence of room (a scrape that shows the worker running more
than the level), never on the absence of a queue, which may have come and gone between
two scrapes; a probe is an eighth of the level, not a doubling (docs/dispatch.md says
why).

A request the policy would rather send to a worker held back only by its probing limit
(3), and says so (`Policy.stretches`), goes there as the probe (`stretch`), one at a
time up to twice the level, rather than elsewhere to prefill what that worker holds.

Probing (2 and 3) happens only under demand (`note_demand`): a request found no room on
the worker and waited, or, for the probing limit, went elsewhere though the policy would
rather have had this worker (`Policy.preferred`). A worker nothing finds full is never
overshot. Without a fresh scrape there is no probing limit: the gate is open.

Dispatch owns the buckets and calls `on_stats`, `take` and `on_release`; everything here is
plain attributes, read as they are by telemetry.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.kv_queue import KvEvidence
from vllm_gateway.dispatch.load import held
from vllm_gateway.dispatch.still_queue import StillQueue
from vllm_gateway.workers import Worker

# Weight of each new completion in the running mean of log(duration) behind `Worker.pace`:
# about the last 60 completions count. Log, so one very long request moves it little.
PACE_SMOOTHING = 1 / 64
# A learned capacity is not probed upward until this long after the worker last reported
# a queue, in seconds: at steady saturation, one overshoot per this period, not per scrape.
PROBE_HOLDOFF = 5.0
# The holdoff doubles each time a probe only confirms the capacity already known, up to
# this many seconds: a worker at its true capacity is overshot once per ~5 minutes at most.
PROBE_HOLDOFF_MAX = 320.0
# Capacity gate before anything is learned: requests in flight to a worker that reported
# no queue yet; a scrape showing it run past the level doubles the level (9, 18, 36, 72
# within 1 s of steady demand). Modest: vLLM's smallest usual batch
# is 8-16 sequences on small GPUs; its default max_num_seqs (256) is 5 doublings away.
PROBE_START = 8.0
# A probe admits this share of the level past it (at least one request): what a worker
# whose capacity is the level holds in its queue. Above one request, so that a scrape can
# confirm a large level: it must catch more than the level running at once, and each of
# a worker's requests spends part of its life outside the running set (in transit,
# between engine steps, sending its last bytes).
PROBE_STEP = 1 / 8
PROBE_MAX = 4096.0
RATE_WINDOW = 10.0  # time constant of `TokenBucket.completion_rate`, in seconds


class TokenBucket:
    """One worker's tokens and what the gateway learned about the worker's capacity."""

    __slots__ = (
        "base",
        "capacity",
        "completion_rate",
        "demand",
        "gain",
        "holdoff",
        "kv",
        "limit",
        "log_duration",
        "open",
        "peak",
        "probe_limit",
        "probed_from",
        "probes",
        "queued_at",
        "rate_at",
        "still",
        "tokens",
        "waited",
        "waiting",
    )

    def __init__(self) -> None:
        self.open = True  # no limit: capacity not learned and no queue reported
        self.tokens = 0.0  # when not open; below 0: sent beyond the room it had
        self.limit = 0.0  # most tokens it may hold until the next scrape
        self.capacity: float | None = None  # requests it runs at once before queueing
        self.waiting = 0.0  # its waiting queue, as last reported
        self.gain = 1.0  # tokens earned per finished request
        self.probes = 0  # consecutive scrapes that raised the capacity
        self.holdoff = PROBE_HOLDOFF  # seconds without a queue before probing upward
        self.probed_from: float | None = None  # capacity a running probe started from
        self.probe_limit = PROBE_START  # the capacity gate while `capacity` is unknown
        # The level an open slow-start probe started from (None: none open): the probing
        # limit is one more, until a scrape shows the worker running more than it.
        self.base: float | None = None
        # A request found no room on it (and waited, or went to another worker) since the
        # last scrape: only then is a larger capacity worth probing for (an overshoot
        # queues a request in the worker).
        self.demand = False
        self.waited = False  # ... and a request waited in the gateway for it
        self.peak = 0.0  # most in flight when it was found full since the last scrape
        self.queued_at = -math.inf  # EngineStats.at of the last scrape showing a queue
        self.kv = KvEvidence()  # what its scrapes and our sends say of its KV cache (kv_queue.py)
        self.log_duration: float | None = None  # running mean of log(request seconds)
        self.completion_rate = 0.0  # finished requests per second, decayed
        self.rate_at = 0.0  # time.monotonic() of the last completion_rate update
        self.still = StillQueue()  # whether its queue stopped moving (still_queue.py)

    @property
    def refill_rate(self) -> float:
        """Tokens per second it earns right now: completion pace times gain."""
        return self.completion_rate * self.gain


class Buckets:
    """A token bucket per worker (created on first sight, dropped with the worker)."""

    def __init__(self, config: DispatchConfig) -> None:
        self.stop_waiting = config.stop_waiting
        self.by_worker: dict[Worker, TokenBucket] = {}
        self.sent_to_full = 0  # requests sent to a worker that was already full (take)

    def bucket(self, worker: Worker) -> TokenBucket:
        b = self.by_worker.get(worker)
        if b is None:
            b = self.by_worker[worker] = TokenBucket()
        return b

    def capacity_of(self, worker: Worker) -> float | None:
        """Requests `worker` runs at once as best known (configured, learned, probing);
        None: no limit known (never scraped, nothing configured)."""
        if worker.max_num_seqs:
            return float(worker.max_num_seqs)
        b = self.by_worker.get(worker)
        if b is None:
            return None
        if b.capacity is not None:
            return b.capacity
        return b.probe_limit if worker.stats is not None else None

    def is_full(self, worker: Worker) -> bool:
        """The capacity gate: the worker's capacity (`Worker.capacity`, kept equal to
        `capacity_of` by on_stats) is filled by this process's in-flight requests and what
        other senders had on it at its last scrape (`Worker.others`: other replicas, sibling
        processes, direct clients; told, as they start and end). Two replicas gating on
        their own counts alone would fill a worker twice; with one gateway process alone,
        `others` is 0. Either way a process with nothing in flight may send one request: a
        page whose gauges froze after its requests ended (vLLM updates them only when its
        engine steps) would otherwise keep the worker idle, and unchanged, for good."""
        capacity = worker.max_num_seqs or worker.capacity
        inflight = worker.inflight
        return bool(capacity) and inflight > 0 and inflight + worker.others >= capacity

    def has_token(self, worker: Worker) -> bool:
        """May `worker` be sent a request now? Not when full (the capacity gate); else
        always without a fresh scrape, else when its bucket holds a token."""
        capacity = worker.max_num_seqs or worker.capacity  # is_full, inline: hot path
        if capacity:
            inflight = worker.inflight
            if inflight > 0 and inflight + worker.others >= capacity:
                return False
        if worker.stats is None:
            return True
        b = self.by_worker.get(worker)
        return b is None or b.open or b.tokens >= 1.0

    def take(self, worker: Worker, gated: bool = True, size: int = 0) -> bool:
        """A request of `size` bytes is sent to `worker` (not yet in its in-flight count):
        take a token.
        Return whether the worker was already full: its last scrape showed a queue, or
        (for a policy that does not ask the gate, `gated` False) its capacity is reached;
        `sent_to_full` counts those."""
        stats = worker.stats
        full = (stats is not None and stats.waiting > 0) or (not gated and self.is_full(worker))
        if full:
            self.sent_to_full += 1
        b = self.by_worker.get(worker)
        if b is not None:
            b.tokens -= 1.0
            b.kv.note(size)
        return full

    def refund(self, worker: Worker) -> None:
        """A request sent to `worker` never reached it (unreachable): give the token back."""
        b = self.by_worker.get(worker)
        if b is not None:
            b.tokens = min(b.limit, b.tokens + 1.0)

    def can_stretch(self, worker: Worker) -> bool:
        """Whether `worker` is held back only by its probing limit (capacity neither
        configured nor learned, and its last scrape showed no queue) and one more request
        in flight stays within twice the level (the next slow-start level): then a request
        the policy would rather send there, and says so (`Policy.stretches`), may go
        there as the probe (`stretch`) rather than elsewhere to prefill again what the
        worker holds. Twice the level, so that a scrape soon catches the worker running
        past the level (a one-request probe at a level its traffic hovers at is seldom
        caught); if the level was its true capacity, those requests wait in its queue, as
        they would have waited behind their history's prefill elsewhere, and the scrape
        that shows the queue teaches the capacity. Pure."""
        stats = worker.stats
        if worker.max_num_seqs or stats is None or stats.waiting > 0:
            return False
        b = self.by_worker.get(worker)
        if b is None or b.capacity is not None:
            return False
        level = b.probe_limit if b.base is None else b.base
        return held(worker) + 1.0 <= min(PROBE_MAX, 2.0 * level)

    def stretch(self, worker: Worker) -> None:
        """`worker` (`can_stretch`) was chosen past its probing limit: raise the limit to
        let this request through, a probe from the level (a scrape that shows the worker
        running past the level doubles it; one that does not brings the limit back to the
        level's usual probe)."""
        b = self.bucket(worker)
        wanted = held(worker) + 1.0
        if wanted > b.probe_limit:
            if b.base is None:
                b.base = b.probe_limit
            b.probe_limit = wanted
            worker.capacity = wanted

    def on_stats(self, worker: Worker) -> None:
        """Re-fill from a new scrape (see the module docstring)."""
        stats = worker.stats
        if stats is None:  # stale: the bucket is open until a fresh scrape, no probing
            worker.capacity = self.capacity_of(worker) or 0.0
            return
        b = self.bucket(worker)
        if b.kv.fold(worker, stats):  # restarted: the new engine's capacity is learned anew
            fresh = self.by_worker[worker] = TokenBucket()
            fresh.kv, b = b.kv, fresh
        self._on_stats(worker, b, stats.running, stats.waiting, stats.at)
        b.demand, b.peak, b.waited = False, 0.0, False
        worker.capacity = self.capacity_of(worker) or 0.0  # what policies read

    def note_demand(self, workers: Iterable[Worker], waits: bool = True) -> None:
        """A request found no room on `workers`: their capacity binds. When it waits, probe
        any of them; when it goes to another worker, only those whose capacity is not
        learned yet (a learned one is what the worker runs before queueing: a probe past
        it would queue a request inside the worker while another had room)."""
        for worker in workers:
            b = self.bucket(worker)
            if not waits and b.capacity is not None:
                continue
            b.demand = True
            b.waited = b.waited or waits
            # What it was given then (in flight now may be less by the next scrape).
            b.peak = max(b.peak, held(worker))

    def _on_stats(
        self, worker: Worker, b: TokenBucket, running: float, waiting: float, at: float
    ) -> None:
        b.waiting = waiting
        b.gain = max(0.0, 1.0 - waiting / self.stop_waiting)
        due = b.still.due(running, waiting, worker.inflight, at, b.gain <= 0.0)
        if waiting > 0:
            if b.kv.bound(worker.stats):
                self._kv_queued(b, at)
            else:
                self._queued(b, running, at)
        elif b.capacity is None:
            self._slow_start(worker, b, running)
        elif b.demand and running >= b.capacity and at - b.queued_at >= b.holdoff:
            if b.probes == 0:
                b.probed_from = b.capacity
            elif b.probed_from is not None and running > b.probed_from:
                b.holdoff = PROBE_HOLDOFF  # it runs more than it did, no queue: room found
            b.probes += 1  # full, yet no queue for a while: probe 1, 2, 3, ... more
            b.capacity = running + b.probes
        else:
            b.probes, b.probed_from = 0, None
        if b.capacity is None and waiting == 0:
            b.open = True
            return
        if b.open:
            b.open, b.tokens = False, 0.0
        if b.gain <= 0.0:  # stopped
            b.tokens = min(b.tokens, 0.0)
            b.limit = 0.0
        elif b.capacity is not None:
            # The room the worker reported, less what this process sent it and saw
            # finish since.
            b.limit = b.capacity
            own = worker.sent_since_scrape - worker.finished_since_scrape
            b.tokens = b.capacity - running - waiting - own
            if waiting > 0:  # no room now, whatever its batch has free (a KV-bound queue)
                b.tokens = min(b.tokens, -waiting - own)
        else:  # queueing, capacity not known yet: only what finishing requests earn
            b.tokens = min(b.tokens, 0.0)
            b.limit = max(1.0, running)
        if due:  # a queue with none of ours there for a period: our turn (still_queue.py)
            b.tokens = max(b.tokens, 1.0)

    def _slow_start(self, worker: Worker, b: TokenBucket, running: float) -> None:
        """No queue, capacity unknown: grow the probing limit while more is wanted."""
        given = max(running, held(worker), b.peak)
        wanted = b.demand and given >= b.probe_limit
        if running < worker.inflight / 2.0:
            # It reports running fewer than half of what this process has in flight to it:
            # its gauge does not count these requests (not vLLM, or a proxy), so what it
            # runs is no evidence. Go by what it was given, as a doubling: a probe that
            # waits for `running` to pass the level would never end.
            if wanted:
                b.probe_limit, b.base = min(PROBE_MAX, 2.0 * (b.base or b.probe_limit)), None
            return
        if b.base is not None:
            if running > b.base:
                # It runs more than the level probed: double the level (or more, when it
                # runs more still). While requests wait in the gateway for it, probe past
                # the new level at once (one scrape per doubling); when it was only the
                # policy's preference, only once it is found full at the new level.
                level = min(PROBE_MAX, max(2.0 * b.base, running))
                if b.waited:
                    self._probe(b, level)
                else:
                    b.probe_limit, b.base = level, None
            else:  # no evidence: a stretched limit (`stretch`) back to the usual probe
                b.probe_limit = min(b.probe_limit, b.base + _step(b.base))
            return
        # It ran all the gate let through (now, or when a request found it full), with no
        # queue, and requests waited or went elsewhere: probe past the level.
        if wanted:
            self._probe(b, b.probe_limit)

    @staticmethod
    def _probe(b: TokenBucket, level: float) -> None:
        """Let `PROBE_STEP` of `level` (at least one request) through past it."""
        b.base = level
        b.probe_limit = min(PROBE_MAX, level + _step(level))

    @staticmethod
    def _kv_queued(b: TokenBucket, at: float) -> None:
        """A queue its KV cache may cause (kv_queue.py): no room now, but what it runs is
        no batch size. Close any probe, learn no capacity."""
        b.probes, b.probed_from = 0, None
        if b.base is not None:
            b.probe_limit, b.base = b.base, None
        b.queued_at = at

    @staticmethod
    def _queued(b: TokenBucket, running: float, at: float) -> None:
        """The worker reports a queue while running `running`: that is its capacity."""
        if b.probed_from is not None and running <= b.probed_from:
            b.holdoff = min(PROBE_HOLDOFF_MAX, b.holdoff * 2.0)  # the probe found no room
        b.probes, b.probed_from = 0, None
        if b.base is not None:  # back to the level (a queue at 0 running teaches nothing)
            b.probe_limit, b.base = b.base, None
        b.queued_at = at
        if running > 0:
            b.capacity = running

    def on_release(self, worker: Worker, seconds: float, completed: bool) -> None:
        """A request to `worker` ended after `seconds`; `completed`: answered in full."""
        b = self.bucket(worker)
        b.tokens = min(b.limit, b.tokens + b.gain)
        if not completed or seconds <= 0.0:
            return
        now = time.monotonic()
        b.completion_rate = (
            b.completion_rate * math.exp(-(now - b.rate_at) / RATE_WINDOW) + 1.0 / RATE_WINDOW
        )
        b.rate_at = now
        x = math.log(seconds)
        mean = b.log_duration
        b.log_duration = x if mean is None else mean + (x - mean) * PACE_SMOOTHING
        worker.pace = math.exp(-b.log_duration)

    def completion_rate(self, workers: tuple[Worker, ...]) -> float:
        """Requests per second these workers finish together, decayed to now."""
        now = time.monotonic()
        total = 0.0
        for w in workers:
            b = self.by_worker.get(w)
            if b is not None:
                total += b.completion_rate * math.exp(-(now - b.rate_at) / RATE_WINDOW)
        return total

    def describe(self, worker: Worker) -> dict[str, object]:
        """What this process's dispatch learned of `worker` (/list_workers: "dispatch")."""
        b = self.by_worker.get(worker)
        open_ = worker.stats is None or b is None or b.open
        capacity = self.capacity_of(worker)
        return {
            "pace": round(worker.pace, 4),
            "capacity": round(capacity, 1) if capacity is not None else None,
            "tokens": None if open_ or b is None else round(b.tokens, 1),  # None: no limit now
            # The prefill it owes this process's streamed requests (prompt bytes; cache_aware),
            # and the share of prompt tokens its own counters say it missed lately.
            "prefill_backlog": worker.backlog,
            "cache_miss": round(worker.miss, 3),
            # What other senders (replicas, sibling processes, direct clients) had on it at
            # its last scrape: the capacity gate counts them.
            "others": round(worker.others, 1),
        }

    def forget_missing(self, present: set[Worker]) -> None:
        """Drop the buckets of workers no longer in the registry."""
        for w in [w for w in self.by_worker if w not in present]:
            del self.by_worker[w]


def _step(level: float) -> float:
    """A probe past `level`: `PROBE_STEP` of it, at least one request."""
    return max(1.0, math.floor(level * PROBE_STEP))

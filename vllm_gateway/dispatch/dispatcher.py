"""Dispatch: choose a worker for a request and account for it while it runs, as a lease.

    async with dispatcher.lease(info, exclude=tried) as lease:
        ...relay to lease.worker...

Entering picks a worker and counts the request in that worker's in-flight total; leaving
uncounts it and records the outcome. Counting lives here and only here, so no policy and
no error path can forget it. The pick (docs/dispatch.md):

1. the available workers (`Worker.available`) serving the model, not already tried;
2. for a load-aware policy, those of them holding a token (buckets.py);
3. the model's policy chooses one. When step 2 leaves none, or requests for the model are
   already waiting, the request joins the admission queue (admission.py), bound to a
   worker when one has room (a release, a scrape, a registry change); nothing waits, no
   task or timer is made, when a worker has a token. Workers step 2 left out are probed
   when the request waits, or those its policy would rather have had when it does not.

When step 1 leaves none: a model no worker serves is a 404, a known one (its workers all
out) a 503 with `Retry-After`; one in `scales_from_zero` waits while a worker starts.

The retry rule, stated once (docs/reliability.md shows the tests that hold it to this):

- A request is tried again, on another worker, only when
  1. it provably never reached the worker's application: the TCP connection could not be
     opened (refused, unreachable, or the connect timed out): `WorkerUnreachable`; or
  2. the worker answered 503 or 429 (it is full or starting) and no byte of that answer
     has reached the client: `WorkerRefused`.
- Nothing else is retried. A connection that fails after the request was written to it
  (reset, closed, timed out) may have reached the application, even a pooled keep-alive
  connection the worker closed a moment before; inference requests are POSTs, not
  idempotent, so they are not replayed (aiohttp and browsers replay only idempotent
  requests there). A request whose answer started reaching the client is never replayed.
- At most `retry.max_attempts` workers per request, each one not tried before, and only
  while another ready worker serves the model: `Lease.can_retry` says so before the
  attempt, so the relay knows whether a 503/429 is its to swallow. When no attempt is
  left, the worker's own 503/429 answer goes to the client as it is.
- A worker that could not be reached is out at once (the breaker sets it unhealthy; the
  next passing probe brings it back), so the next pick does not try it again. When no
  attempt is left after an unreachable one, the client gets 503 `no_worker_available`
  with `Retry-After` (`lease.unreachable_answer`), never a 502: SDKs retry a 503.
- Between attempts the lease is released; the wait, `retry.backoff` doubling up to
  `retry.backoff_max`, drawn in [half, all]; a WARNING and `Dispatcher.retries` per retry.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from types import TracebackType

from vllm_gateway.config.gateway import DispatchConfig, RetryConfig
from vllm_gateway.dispatch.admission import Admission, ModelQueue, Waiter
from vllm_gateway.dispatch.buckets import Buckets
from vllm_gateway.dispatch.lease import (
    BROKEN,
    CLIENT_GONE,
    CONNECT_TIMEOUT,
    OK,
    REFUSED,
    SHUTDOWN,
    TIMEOUT,
    UNREACHABLE,
    Lease,
    outcome_of,
    unreachable_answer,
)
from vllm_gateway.dispatch.load import count_model
from vllm_gateway.dispatch.no_worker import without_worker
from vllm_gateway.dispatch.patience import patient, room_for
from vllm_gateway.dispatch.policies import (
    Policy,
    forget_missing,
    preferred_of,
    stretches_of,
)
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.errors import (
    GatewayError,
    QueueFull,
    QueueTimeout,
    UpstreamError,
    WorkerUnreachable,
)
from vllm_gateway.log import get_logger
from vllm_gateway.workers import Worker, WorkerRegistry

# The lease and its outcomes live in lease.py; they are read from here too (the relay,
# the breaker, telemetry, the status page).
__all__ = [
    "BROKEN",
    "CLIENT_GONE",
    "CONNECT_TIMEOUT",
    "OK",
    "REFUSED",
    "RETRY_STATUSES",
    "SHUTDOWN",
    "TIMEOUT",
    "UNREACHABLE",
    "Dispatcher",
    "Lease",
    "outcome_of",
    "unreachable_answer",
]

log = get_logger("vllm_gateway.dispatch")

# Worker answers that mean "not now, ask someone else" (see the retry rule above).
RETRY_STATUSES = frozenset({429, 503})


class _LeaseContext:
    """`async with dispatcher.lease(...)`: acquire on enter, release on exit."""

    __slots__ = ("_dispatcher", "_exclude", "_info", "_lease")

    def __init__(
        self, dispatcher: Dispatcher, info: RequestInfo, exclude: Sequence[Worker]
    ) -> None:
        self._dispatcher = dispatcher
        self._info = info
        self._exclude = exclude
        self._lease: Lease | None = None

    async def __aenter__(self) -> Lease:
        d = self._dispatcher
        lease = d._try_acquire(self._info, self._exclude)
        if lease is None:
            lease = await d._wait_in_queue(self._info, self._exclude)
        self._lease = lease
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease = self._lease
        if lease is None:
            return
        if exc is not None and lease.outcome == OK:
            lease.outcome = outcome_of(exc)
        self._dispatcher._release(lease)
        if isinstance(exc, WorkerUnreachable):
            raise unreachable_answer(lease, exc) from exc


class Dispatcher:
    """Picks workers by policy, queues requests that find no room, keeps the accounts."""

    def __init__(
        self,
        registry: WorkerRegistry,
        policy: Policy,
        *,
        policy_for_model: dict[str, Policy] | None = None,
        retry: RetryConfig | None = None,
        config: DispatchConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        config = config or DispatchConfig()
        self.registry = registry
        self.policy = policy
        self.policy_for_model = policy_for_model or {}
        self.retry = retry or RetryConfig()
        self.rng = rng or random.Random()
        # With `serve --processes N`, each process gates as a replica does (buckets.py).
        self.buckets = Buckets(config)
        self.admission = Admission(config.max_queued, config.max_queue_wait)
        # Called with each finished lease (telemetry, access log); kept cheap.
        self.on_release: list[Callable[[Lease], None]] = []
        # Told each placement (`serve --processes N`: process/placement_feed.py) or None;
        # its last argument: whether a lease holds the request (False: `choose` only names).
        self.on_placed: Callable[[Policy, RequestInfo, Worker, bool], None] | None = None
        self.retries = 0  # requests tried again on another worker, since start
        # Models whose requests wait in the admission queue when no worker serves them or
        # none is available (the autoscaler starts one: scale from zero), instead of 404/503.
        self.scales_from_zero: frozenset[str] = frozenset()
        registry.listeners.append(self._on_registry_change)
        registry.stats_listeners.append(self._on_stats)

    def configure(self, config: DispatchConfig) -> None:
        """Follow new dispatch settings (a reload); learned state and waiters stay."""
        self.buckets.stop_waiting = config.stop_waiting
        self.admission.max_queued = config.max_queued
        self.admission.max_wait = config.max_queue_wait

    def lease(self, info: RequestInfo, exclude: Sequence[Worker] = ()) -> _LeaseContext:
        """Hold a worker for `info` for the duration of an `async with` block."""
        return _LeaseContext(self, info, exclude)

    def choose(self, info: RequestInfo) -> Worker | None:
        """The worker a request for `info` would get now, without taking it (FastChat's
        /get_worker_address): one with a token if any has one, else any available."""
        candidates = [w for w in self.registry.serving(info.model) if w.available]
        policy = self.policy_for_model.get(info.model, self.policy)
        if policy.load_aware:
            with_token = [w for w in candidates if self.buckets.has_token(w)]
            candidates = with_token or candidates
        info.stretched = ()  # nothing is let past a limit here (`_pick` says why it may)
        worker = policy.select(candidates, info) if candidates else None
        if worker is not None and self.on_placed is not None:  # (the siblings count it too)
            self.on_placed(policy, info, worker, False)
        return worker

    async def before_retry(self, lease: Lease, error: UpstreamError) -> None:
        """Count and log a retry of `lease`'s request, then wait out the backoff.

        Called after the failed lease was released, so the worker's slot is free meanwhile.
        """
        self.retries += 1
        log.warning(
            "retrying on another worker",
            worker=lease.worker.url,
            attempt=lease.attempt,
            reason=error.code,
            error=error.message,
        )
        delay = min(self.retry.backoff_max, self.retry.backoff * 2 ** (lease.attempt - 1))
        if delay > 0:
            await asyncio.sleep(delay * (0.5 + 0.5 * self.rng.random()))

    def _try_acquire(self, info: RequestInfo, exclude: Sequence[Worker]) -> Lease | None:
        """A lease on a worker with room now; None: wait in the queue. Raises when no
        worker could ever take it (unknown model, none available)."""
        serving = self.registry.serving(info.model)
        available = [w for w in serving if w.available and w not in exclude]
        if not available:
            error = without_worker(info, serving, exclude, self.registry, self.scales_from_zero)
            if error is not None:
                raise error
            return None  # the model scales from zero: wait for a worker to start
        queue = self.admission.queues.get(info.model)
        if queue is not None and queue.head() is not None:
            return None  # others are waiting for this model: first come, first served
        return self._pick(info, exclude, available)  # (none, or only some set aside)

    def _pick(
        self,
        info: RequestInfo,
        exclude: Sequence[Worker],
        available: list[Worker],
        waiter: Waiter | None = None,
    ) -> Lease | None:
        policy = self.policy_for_model.get(info.model, self.policy)
        more: list[Worker] = []  # held back only by a guessed limit, this request may go
        if policy.load_aware:
            has_token = self.buckets.has_token
            candidates = [w for w in available if has_token(w)]
            if len(candidates) < len(available):  # what they run binds: probe them for more
                gated = [w for w in available if not has_token(w)]
                # It waits: probe them all; it goes elsewhere: those the policy would rather
                # have had (base.py), as a probe past a true capacity queues in the worker.
                liked = preferred_of(policy, gated, candidates, info) if candidates else gated
                self.buckets.note_demand(liked, not candidates)
                if not candidates:
                    return None
                admission = self.admission
                may_wait = waiter is not None or admission.has_room(info.model)
                # What the policy would rather have, held back only by a guessed limit: this
                # request is its probe (buckets.py `stretch`), not prefilled again elsewhere.
                can = self.buckets.can_stretch if liked and stretches_of(policy, info) else None
                if may_wait and patient(policy, liked, candidates, waiter, info, can, admission):
                    return None  # it waits for them (patience.py)
                if can is not None:
                    more = [w for w in liked if can(w)]
                    if more:
                        candidates = [w for w in available if w in more or has_token(w)]
        else:
            candidates = available
        info.prefill, info.cold, info.stretched = 0, False, more  # (a retry may meet another)
        worker = policy.select(candidates, info)
        if worker is None:
            return None
        if self.on_placed is not None:  # (the siblings count and record it too)
            self.on_placed(policy, info, worker, True)
        if more and worker in more:
            self.buckets.stretch(worker)
        full = self.buckets.take(worker, policy.load_aware, len(info.body))  # before counting
        worker.inflight += 1
        count_model(worker, info.model, 1)
        worker.sent_since_scrape += 1
        attempt = len(exclude) + 1
        can_retry = attempt < self.retry.max_attempts and len(available) > 1
        lease = Lease(self, worker, info, attempt, can_retry, full)
        # Only a streamed answer's first byte tells when its prefill ended: only those owe
        # the backlog, and teach the rate if they wait for known bytes (cold, none ahead).
        if info.stream and info.prefill:
            lease.pending, lease.learns = info.prefill, info.cold and not worker.backlog
            worker.backlog += info.prefill
        return lease

    # --- the admission queue --------------------------------------------------------------

    async def _wait_in_queue(self, info: RequestInfo, exclude: Sequence[Worker]) -> Lease:
        """Wait for a worker with room (bound by `_serve_queue`), within the queue's bounds."""
        admission = self.admission
        if not admission.has_room(info.model):
            admission.rejected += 1
            raise QueueFull(
                f"Too many requests for `{info.model}` are waiting for a worker "
                f"({admission.max_queued}); try again shortly.",
                retry_after=self._retry_after(info.model),
            )
        waiter = admission.enqueue(info, exclude)
        self._serve_queue(info.model)  # e.g. a retry, or room that came with no event
        try:
            async with asyncio.timeout(admission.max_wait or None):
                return await waiter.future
        except TimeoutError:
            if waiter.bound:
                return waiter.future.result()  # a worker came at the very last moment
            admission.leave(waiter, admitted=False)
            admission.timed_out += 1
            raise QueueTimeout(
                f"No worker serving `{info.model}` had room within {admission.max_wait:g} s.",
                retry_after=self._retry_after(info.model),
            ) from None
        except asyncio.CancelledError:
            if waiter.bound:  # bound, but the client left before it could start
                lease = waiter.future.result()
                lease.outcome = CLIENT_GONE
                self._release(lease)
            else:
                admission.leave(waiter, admitted=False)
                admission.abandoned += 1
            raise

    def _serve_queue(self, model: str) -> None:
        """Bind the waiters of `model`, best first, to workers with room, while there are:
        first those set aside for the workers they want (patience.py), then the rest in
        order; one that would rather wait for a full worker is set aside."""
        queue = self.admission.queues.get(model)
        if queue is None:
            return
        serving = self.registry.serving(model)
        if queue.patient:
            self._serve_patient(queue, serving)
        while (waiter := queue.head()) is not None:
            bound = self._bind(waiter, serving)
            if bound is False:
                if not waiter.wants:
                    return  # no room yet; strict order, so the rest wait too
                queue.set_aside(waiter)

    def _serve_patient(self, queue: ModelQueue, serving: Sequence[Worker]) -> None:
        """Bind the waiters set aside whose patience ended, or whose wanted workers have a
        token or are out, in order, after a better-priority waiter in line; one that now
        wants no worker in particular goes back in line."""
        has_token, now = self.buckets.has_token, time.monotonic()
        head = queue.head()
        for waiter in list(queue.patient):
            if head is not None and head.key[0] < waiter.key[0]:
                continue  # a better priority first (the next event tries again)
            if (
                waiter.gone
                or any(has_token(w) or not w.available for w in waiter.wants)
                or now >= waiter.last
                or (now >= waiter.until and room_for(filter(has_token, serving), waiter))
            ):
                bound = self._bind(waiter, serving)
                if bound is not False or not waiter.wants:
                    queue.patient.remove(waiter)
                    if bound is False:
                        queue.back_in_line(waiter)

    def _bind(self, waiter: Waiter, serving: Sequence[Worker]) -> bool | None:
        """Give `waiter` a lease (True), an error (None: it leaves too), or nothing yet
        (False); a waiter that left already is taken out (None)."""
        if waiter.gone:
            return None
        if waiter.future.done():  # cancelled: its task is leaving the queue right now
            self.admission.leave(waiter, admitted=False)
            return None
        waiter.wants = ()
        available = [w for w in serving if w.available and w not in waiter.exclude]
        error: GatewayError | None = None
        if not available:
            error = without_worker(
                waiter.info, serving, waiter.exclude, self.registry, self.scales_from_zero
            )
        lease = self._pick(waiter.info, waiter.exclude, available, waiter) if available else None
        if lease is None and error is None:
            return False
        self.admission.leave(waiter, admitted=error is None)
        if error is not None:
            waiter.future.set_exception(error)
            return None
        assert lease is not None
        lease.waited = time.monotonic() - waiter.enqueued
        waiter.future.set_result(lease)
        return True

    def _serve_all(self) -> None:
        if self.admission.depth:
            for model in list(self.admission.queues):
                self._serve_queue(model)

    def _on_stats(self, worker: Worker) -> None:
        self.buckets.on_stats(worker)
        self.room_opened(worker)

    def room_opened(self, worker: Worker) -> None:
        """Room may have opened on `worker` (a scrape, a release here, or a request another
        sender had there ended, told: process/placement_sharing.py): serve its waiters."""
        if self.admission.depth:
            for model in worker.models:
                self._serve_queue(model)

    def _on_registry_change(self) -> None:
        present = set(self.registry)
        self.buckets.forget_missing(present)
        forget_missing({self.policy, *self.policy_for_model.values()}, present)
        self._serve_all()

    def _retry_after(self, model: str) -> float:
        """Seconds until the queue for `model` has likely drained: a hint for clients."""
        rate = self.buckets.completion_rate(self.registry.serving(model))
        waiting = self.admission.waiting_for(model) + 1
        return min(60.0, max(1.0, waiting / rate)) if rate > 0 else 1.0

    # --- releasing ------------------------------------------------------------------------

    def _release(self, lease: Lease) -> None:
        worker = lease.worker
        worker.inflight -= 1
        if lease.pending:  # ended without a first byte
            lease.prefilled()
        count_model(worker, lease.info.model, -1)
        worker.finished_since_scrape += 1
        outcome = lease.outcome
        if outcome == OK:
            worker.completed += 1
        elif outcome != CLIENT_GONE:
            worker.failed += 1
        if outcome in (UNREACHABLE, CONNECT_TIMEOUT):
            self.buckets.refund(worker)
        else:
            completed = outcome == OK and 200 <= lease.status < 300
            self.buckets.on_release(worker, time.monotonic() - lease.started, completed)
        for hook in self.on_release:
            hook(lease)
        self.room_opened(worker)

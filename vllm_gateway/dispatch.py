"""Dispatch: choose a worker for a request and account for it while it runs, as a lease.

    async with dispatcher.lease(info, exclude=tried) as lease:
        ...relay to lease.worker...

Entering picks a worker (the model's policy chooses among ready workers serving the model
that were not already tried) and counts the request in that worker's in-flight total;
leaving uncounts it and records the outcome. Counting lives here and only here, so no
policy and no error path can forget it.

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
- Between attempts the lease is released and the request waits `retry.backoff` seconds,
  doubling per attempt up to `retry.backoff_max`, drawn between half and all of it.
- Each retry logs one WARNING line and counts in `Dispatcher.retries`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from types import TracebackType

from vllm_gateway.config import RetryConfig
from vllm_gateway.errors import (
    ModelNotFound,
    NoWorkerAvailable,
    UpstreamError,
    WorkerRefused,
    WorkerUnreachable,
)
from vllm_gateway.log import get_logger
from vllm_gateway.policies import Policy
from vllm_gateway.request_info import RequestInfo
from vllm_gateway.workers import Worker, WorkerRegistry

log = get_logger("vllm_gateway.dispatch")

# Worker answers that mean "not now, ask someone else" (see the retry rule above).
RETRY_STATUSES = frozenset({429, 503})

# Outcomes a lease ends with (also the values of the telemetry label and access log field).
OK = "ok"  # the worker answered and the answer reached the client (any status)
CLIENT_GONE = "client_gone"  # the client left first; the upstream request was cancelled
UNREACHABLE = "unreachable"  # the worker could not be reached
REFUSED = "refused"  # the worker answered 503/429 and the request went to another one
TIMEOUT = "timeout"  # a relay timeout expired
BROKEN = "broken"  # the worker failed mid-answer (reset, malformed framing)
SHUTDOWN = "shutdown"  # the gateway stopped before the answer ended (shutdown grace ran out)


class Lease:
    """One request's hold on one worker, from dispatch to the end of its relay."""

    __slots__ = (
        "_dispatcher",
        "attempt",
        "bytes",
        "can_retry",
        "first_byte",
        "info",
        "outcome",
        "started",
        "status",
        "worker",
    )

    def __init__(
        self,
        dispatcher: Dispatcher,
        worker: Worker,
        info: RequestInfo,
        attempt: int = 1,
        can_retry: bool = False,
    ) -> None:
        self._dispatcher = dispatcher
        self.worker = worker
        self.info = info
        self.started = time.monotonic()
        self.status = 0  # HTTP status the worker answered, 0 until it did
        self.outcome = OK
        self.attempt = attempt  # 1 for the first worker tried, 2 for the next, ...
        # Another attempt is allowed if this one fails retryably (the rule above).
        self.can_retry = can_retry
        # Set by the relay: time.monotonic() when the first body byte went to the client
        # (0.0 until then), and the body bytes relayed (telemetry, access log).
        self.first_byte = 0.0
        self.bytes = 0


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
        self._lease = self._dispatcher._acquire(self._info, self._exclude)
        return self._lease

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


def outcome_of(exc: BaseException) -> str:
    """The outcome a lease ends with when `exc` ended its attempt."""
    if isinstance(exc, asyncio.CancelledError | ConnectionResetError):
        return CLIENT_GONE
    if isinstance(exc, WorkerUnreachable):
        return UNREACHABLE
    if isinstance(exc, WorkerRefused):
        return REFUSED
    if isinstance(exc, TimeoutError):
        return TIMEOUT
    return BROKEN


class Dispatcher:
    """Picks workers by policy and keeps the in-flight accounts."""

    def __init__(
        self,
        registry: WorkerRegistry,
        policy: Policy,
        *,
        policy_for_model: dict[str, Policy] | None = None,
        retry: RetryConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.policy_for_model = policy_for_model or {}
        self.retry = retry or RetryConfig()
        self.rng = rng or random.Random()
        # Called with each finished lease (telemetry, access log); kept cheap.
        self.on_release: list[Callable[[Lease], None]] = []
        self.retries = 0  # requests tried again on another worker, since start

    def lease(self, info: RequestInfo, exclude: Sequence[Worker] = ()) -> _LeaseContext:
        """Hold a worker for `info` for the duration of an `async with` block."""
        return _LeaseContext(self, info, exclude)

    def choose(self, info: RequestInfo) -> Worker | None:
        """The worker a request for `info` would get now, without taking it (FastChat's
        /get_worker_address)."""
        candidates = [w for w in self.registry.serving(info.model) if w.available]
        policy = self.policy_for_model.get(info.model, self.policy)
        return policy.select(candidates, info) if candidates else None

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

    def _acquire(self, info: RequestInfo, exclude: Sequence[Worker]) -> Lease:
        serving = self.registry.serving(info.model)
        if not serving:
            raise ModelNotFound(self._unknown_model_message(info.model), param="model")
        candidates = [w for w in serving if w.available and w not in exclude]
        policy = self.policy_for_model.get(info.model, self.policy)
        worker = policy.select(candidates, info) if candidates else None
        if worker is None:
            raise NoWorkerAvailable(
                f"No worker serving `{info.model}` is available right now "
                f"({len(serving)} known, none ready{' untried' if exclude else ''})."
            )
        worker.inflight += 1
        worker.sent_since_scrape += 1
        attempt = len(exclude) + 1
        can_retry = attempt < self.retry.max_attempts and len(candidates) > 1
        return Lease(self, worker, info, attempt, can_retry)

    def _release(self, lease: Lease) -> None:
        worker = lease.worker
        worker.inflight -= 1
        if lease.outcome == OK:
            worker.completed += 1
        elif lease.outcome != CLIENT_GONE:
            worker.failed += 1
        for hook in self.on_release:
            hook(lease)

    def _unknown_model_message(self, model: str) -> str:
        known = self.registry.known_models()
        listed = ", ".join(known[:20]) + (" …" if len(known) > 20 else "")
        return (
            f"The model `{model}` does not exist on this gateway. "
            f"Available models: {listed or 'none'}."
        )

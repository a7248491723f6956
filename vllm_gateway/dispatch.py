"""Dispatch: choose a worker for a request and account for it while it runs, as a lease.

    async with dispatcher.lease(info, exclude=tried) as lease:
        ...relay to lease.worker...

Entering picks a worker (the model's policy chooses among ready workers serving the model
that were not already tried) and counts the request in that worker's in-flight total;
leaving uncounts it and records the outcome. Counting lives here and only here, so no
policy and no error path can forget it.

The retry rule, stated once: a request is retried on another worker only when it provably
never reached the first one (`WorkerUnreachable`: the connection could not be opened), at
most `max_attempts` workers in all.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from types import TracebackType

from vllm_gateway.errors import ModelNotFound, NoWorkerAvailable, WorkerUnreachable
from vllm_gateway.policies import Policy
from vllm_gateway.request_info import RequestInfo
from vllm_gateway.workers import Worker, WorkerRegistry

# Outcomes a lease ends with (also the values of the telemetry label and access log field).
OK = "ok"  # the worker answered and the answer reached the client (any status)
CLIENT_GONE = "client_gone"  # the client left first; the upstream request was cancelled
UNREACHABLE = "unreachable"  # the worker could not be reached
TIMEOUT = "timeout"  # a relay timeout expired
BROKEN = "broken"  # the worker failed mid-answer (reset, malformed framing)


class Lease:
    """One request's hold on one worker, from dispatch to the end of its relay."""

    __slots__ = ("_dispatcher", "info", "outcome", "started", "status", "worker")

    def __init__(self, dispatcher: Dispatcher, worker: Worker, info: RequestInfo) -> None:
        self._dispatcher = dispatcher
        self.worker = worker
        self.info = info
        self.started = time.monotonic()
        self.status = 0  # HTTP status the worker answered, 0 until it did
        self.outcome = OK


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
            lease.outcome = _outcome_of(exc)
        self._dispatcher._release(lease)


def _outcome_of(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError | ConnectionResetError):
        return CLIENT_GONE
    if isinstance(exc, WorkerUnreachable):
        return UNREACHABLE
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
        max_attempts: int = 3,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.policy_for_model = policy_for_model or {}
        self.max_attempts = max_attempts
        self.rng = rng or random.Random()
        # Called with each finished lease (telemetry, access log); kept cheap.
        self.on_release: list[Callable[[Lease], None]] = []

    def lease(self, info: RequestInfo, exclude: Sequence[Worker] = ()) -> _LeaseContext:
        """Hold a worker for `info` for the duration of an `async with` block."""
        return _LeaseContext(self, info, exclude)

    def may_retry(self, attempts_made: int) -> bool:
        """May a request that failed `attempts_made` times (unreachable each) try again?"""
        return attempts_made < self.max_attempts

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
        return Lease(self, worker, info)

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

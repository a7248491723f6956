"""The passive circuit breaker: judge each worker by the outcomes of the requests it served.

Active probes (health.py) ask a worker every few seconds whether it is alive; the breaker
listens to the traffic itself, so a worker that refuses connections or answers 5xx stops
getting requests after a handful of failures instead of after the next probe rounds.

    closed --(failures in a row)--> open --(open_seconds later)--> half_open
    half_open --(the trial succeeds)--> closed
    half_open --(the trial fails)--> open

A failure is a lease that ended unreachable (connect error), broken (reset mid-answer),
timed out, or with a 5xx status from the worker. A success is any other answer the worker
gave, 4xx included (a client's bad request says nothing against the worker). A client that
went away says nothing either way. Half-open lets one request at a time through
(`Worker.available`), so a worker that is still broken costs one request per open period.

A lease that found its worker unreachable (the TCP connection could not be opened) takes
the worker out at once, whatever the counts: its state becomes unhealthy, and the next
passing probe makes it ready again. A refused connection is not an opinion about a
request: the worker's process is gone or not listening, and every request sent there in
the next probe interval would fail the same way (today: be retried, or answered 503).
A connect that timed out is not a refusal (a SYN lost, an accept queue full for a moment:
the worker may well be alive), so it only counts as a failure: one slow connect per worker
must not empty a healthy fleet until the next probes.

The breaker never opens the circuit of the last available worker of one of its models:
with nowhere else to send those requests, an open circuit would only turn the worker's
errors into 503s and delay its return after a restart (Envoy's outlier detection keeps a
host for the same reason). Active probes still take a dead last worker out. For that rule
only a ready worker with a closed circuit counts as available: a half-open one takes one
trial at a time, and once its trial is out it takes nothing at all.

The breaker is a `Dispatcher.on_release` hook: constant work per finished request, no
allocation, no log line unless the circuit moves (the registry logs that, with the reason).
"""

from __future__ import annotations

import asyncio

from vllm_gateway.config.gateway import BreakerConfig
from vllm_gateway.dispatch import dispatcher as dispatch
from vllm_gateway.dispatch.dispatcher import Lease
from vllm_gateway.workers import Circuit, Worker, WorkerRegistry, WorkerState

# Lease outcomes that count against the worker. client_gone and ok do not (ok with a 5xx
# status does, below).
_FAILED_OUTCOMES = frozenset(
    {dispatch.UNREACHABLE, dispatch.CONNECT_TIMEOUT, dispatch.BROKEN, dispatch.TIMEOUT}
)


class CircuitBreaker:
    """Counts failures per worker and opens, half-opens and closes its circuit."""

    def __init__(self, registry: WorkerRegistry, config: BreakerConfig) -> None:
        self.registry = registry
        self.config = config
        self._timers: dict[str, asyncio.TimerHandle] = {}

    @property
    def enabled(self) -> bool:
        return self.config.failures > 0

    def on_release(self, lease: Lease) -> None:
        """Record one finished lease (a `Dispatcher.on_release` hook)."""
        outcome = lease.outcome
        if outcome == dispatch.CLIENT_GONE:
            return
        worker = lease.worker
        if outcome == dispatch.UNREACHABLE:
            self._take_out(worker)
        if outcome in _FAILED_OUTCOMES or lease.status >= 500:
            worker.consecutive_failures += 1
            if worker.circuit is Circuit.HALF_OPEN:
                self._open(worker, f"trial request failed ({self._describe(lease)})")
            elif (
                worker.circuit is Circuit.CLOSED
                and worker.consecutive_failures >= self.config.failures
                and self.enabled
            ):
                self._open(
                    worker,
                    f"{worker.consecutive_failures} failed requests in a row "
                    f"(last: {self._describe(lease)})",
                )
        else:
            worker.consecutive_failures = 0
            if worker.circuit is not Circuit.CLOSED:
                self._close(worker, "request succeeded")

    def reset(self, worker: Worker, reason: str) -> None:
        """Close a worker's circuit now (an operator's undrain or re-add)."""
        worker.consecutive_failures = 0
        self._close(worker, reason)

    def stop(self) -> None:
        """Cancel pending half-open timers (the app is stopping)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    # --- transitions ---------------------------------------------------------------------

    def _take_out(self, worker: Worker) -> None:
        """A worker that refused a connection (or never let one open) is out now, not
        after `unhealthy_after` probes: until then every request sent to it would fail.
        The next passing probe makes it ready again (health.py)."""
        if worker.state is WorkerState.READY:
            self.registry.set_state(worker, WorkerState.UNHEALTHY, "connection failed")

    def _open(self, worker: Worker, reason: str) -> None:
        if not self._others_can_serve(worker):
            self._close(worker, f"{reason}, but it is the last available worker of its model")
            return
        if not self.registry.set_circuit(worker, Circuit.OPEN, reason):
            return
        self._cancel_timer(worker)
        loop = asyncio.get_running_loop()
        self._timers[worker.url] = loop.call_later(
            self.config.open_seconds, self._half_open, worker
        )

    def _others_can_serve(self, worker: Worker) -> bool:
        """Does every model of `worker` have another worker that takes its traffic (ready,
        circuit closed; a half-open worker takes one trial at most)?"""
        return all(
            any(
                w is not worker and w.state is WorkerState.READY and w.circuit is Circuit.CLOSED
                for w in self.registry.serving(model)
            )
            for model in worker.models
        )

    def _half_open(self, worker: Worker) -> None:
        self._timers.pop(worker.url, None)
        if self.registry.get(worker.url) is not worker:
            return  # removed while open
        self.registry.set_circuit(
            worker, Circuit.HALF_OPEN, f"open for {self.config.open_seconds:g} s, trying again"
        )

    def _close(self, worker: Worker, reason: str) -> None:
        self._cancel_timer(worker)
        self.registry.set_circuit(worker, Circuit.CLOSED, reason)

    def _cancel_timer(self, worker: Worker) -> None:
        timer = self._timers.pop(worker.url, None)
        if timer is not None:
            timer.cancel()

    @staticmethod
    def _describe(lease: Lease) -> str:
        if lease.outcome == dispatch.OK:
            return f"status {lease.status}"
        return lease.outcome

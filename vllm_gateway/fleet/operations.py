"""Fleet operations: what an operator, a registering worker or the autoscaler may do to a worker.

Add (and probe at once, so a healthy worker takes traffic within one probe round trip
instead of the next probe period), drain (no new requests; in-flight ones finish), wait
until idle, undrain (probe again before taking requests), remove. The admin API, the
registration API, DNS discovery and the autoscaler all go through these, and these go
through `WorkerRegistry` transitions, so each change is logged once, with its reason.

Every operation is idempotent: applying it twice (as a multi-process gateway does when it
passes a control request to each of its processes) leaves the same state as once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from vllm_gateway.fleet.breaker import CircuitBreaker
from vllm_gateway.fleet.health import Prober, ProbeResult
from vllm_gateway.workers import Worker, WorkerRegistry, WorkerState

# How often a wait for a draining worker to go idle looks at its in-flight count.
IDLE_POLL_SECONDS = 0.02


class Fleet:
    """Worker lifecycle operations over the registry, the prober and the breaker."""

    def __init__(
        self, registry: WorkerRegistry, prober: Prober, breaker: CircuitBreaker | None = None
    ) -> None:
        self.registry = registry
        self.prober = prober
        self.breaker = breaker

    async def add(
        self,
        url: str,
        *,
        source: str,
        models: Iterable[str] = (),
        weight: float = 1.0,
        probe: bool = True,
    ) -> tuple[Worker, bool]:
        """Add a worker (joining) unless known, then probe it once; return it and "new?"."""
        worker, new = self.registry.add(url, models=models, weight=weight, source=source)
        if new:
            self.prober.forget(url)
        if probe and worker.state in (WorkerState.JOINING, WorkerState.UNHEALTHY):
            await self.probe(worker)
        return worker, new

    async def probe(self, worker: Worker) -> ProbeResult:
        """Probe one worker now and apply the result (thresholds as for periodic probes)."""
        return await self.prober.probe_one(worker)

    def drain(self, worker: Worker, reason: str = "drained by operator") -> bool:
        """Send the worker no new request; those in flight finish. True if it changed."""
        return self.registry.set_state(worker, WorkerState.DRAINING, reason)

    async def undrain(self, worker: Worker, reason: str = "undrained by operator") -> bool:
        """Let a draining worker take requests again once a probe passes. True if it changed.

        It goes back through joining, so a worker restarted while drained (a rollout in
        place) is not sent requests before it answers its probe.
        """
        if worker.state is not WorkerState.DRAINING:
            return False
        self.registry.set_state(worker, WorkerState.JOINING, reason)
        if self.breaker is not None:
            self.breaker.reset(worker, reason)
        await self.probe(worker)
        return True

    async def wait_idle(self, worker: Worker, timeout: float) -> bool:
        """Wait until no request of this process is in flight on `worker`; False on timeout."""
        deadline = time.monotonic() + timeout
        while worker.inflight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(IDLE_POLL_SECONDS)
        return True

    def remove(self, url: str, reason: str) -> Worker | None:
        """Forget a worker; requests already relayed to it finish. None if unknown."""
        return self.registry.remove(url, reason)

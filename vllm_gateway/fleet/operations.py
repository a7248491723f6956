"""Fleet operations: the one owner of a worker's life, from joining to leaving.

Add (and probe at once, so a healthy worker takes traffic within one probe round trip
instead of the next probe period), drain (no new requests; in-flight ones finish), wait
until idle, undrain (probe again before taking requests), retire, remove. Every source of
workers (the config file, registration, the admin API, DNS and Kubernetes discovery) and
the autoscaler go through these, and these go through `WorkerRegistry` transitions, so
each change is logged once, with its reason.

`retire(worker, reason)` is "drain, then remove when its last request ends", written once:
the removal is driven by lease release (`on_release`, a `Dispatcher.on_release` hook), not
by polling, so a worker leaves the registry in the same turn of the loop as its last
request. `wait_idle` is woken the same way.

Every operation is idempotent: applying it twice (as a multi-process gateway does when it
passes a control request to each of its processes) leaves the same state as once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

from vllm_gateway.dispatch.dispatcher import Lease
from vllm_gateway.fleet.breaker import CircuitBreaker
from vllm_gateway.fleet.health import Prober, ProbeResult
from vllm_gateway.workers import Source, Worker, WorkerRegistry, WorkerState


class Fleet:
    """Worker lifecycle operations over the registry, the prober and the breaker."""

    def __init__(
        self, registry: WorkerRegistry, prober: Prober, breaker: CircuitBreaker | None = None
    ) -> None:
        self.registry = registry
        self.prober = prober
        self.breaker = breaker
        # Workers retired with requests in flight: URL -> the reason they leave with.
        self.retiring: dict[str, str] = {}
        # wait_idle callers, woken by the release that leaves the worker idle.
        self._idle_waiters: dict[Worker, list[asyncio.Future[None]]] = {}

    async def add(
        self,
        url: str,
        *,
        source: Source,
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
        place) is not sent requests before it answers its probe. A retirement under way
        is called off: the operator's word wins.
        """
        if not self.rejoin(worker, reason):
            return False
        await self.probe(worker)
        return True

    def retire(self, worker: Worker, reason: str) -> bool:
        """Drain `worker`, and remove it when its last request ends. True if removed now.

        Idempotent: retiring a retiring worker changes nothing. Requests in flight finish
        untouched; the removal happens in `on_release`, at the end of the last one.
        """
        if self.registry.get(worker.url) is not worker:
            return True  # already gone
        if worker.inflight == 0:
            self.remove(worker.url, reason)
            return True
        self.drain(worker, reason)
        self.retiring.setdefault(worker.url, reason)
        return False

    def retiring_worker(self, worker: Worker) -> bool:
        """Is this very worker (not a later one with its URL) in the registry, retiring?"""
        return worker.url in self.retiring and self.registry.get(worker.url) is worker

    def unretire(self, worker: Worker, reason: str) -> bool:
        """Call off a retirement under way: back through joining, circuit reset. True if
        the worker was retiring; the caller probes it (or leaves that to the next round)."""
        if worker.url not in self.retiring:
            return False
        return self.rejoin(worker, reason)

    def rejoin(self, worker: Worker, reason: str) -> bool:
        """A draining worker back through joining (circuit reset, any retirement called
        off). True if it was draining; the caller probes it."""
        self.retiring.pop(worker.url, None)
        if worker.state is not WorkerState.DRAINING:
            return False
        self.registry.set_state(worker, WorkerState.JOINING, reason)
        if self.breaker is not None:
            self.breaker.reset(worker, reason)
        return True

    def on_release(self, lease: Lease) -> None:
        """`Dispatcher.on_release` hook: the end of a worker's last request removes it if
        it is retiring, and wakes whoever waits for it to be idle. Constant work."""
        worker = lease.worker
        if worker.inflight:
            return
        waiters = self._idle_waiters.pop(worker, None)
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)
        if worker.url not in self.retiring or self.registry.get(worker.url) is not worker:
            return
        reason = self.retiring.pop(worker.url)
        if worker.state is WorkerState.DRAINING:  # else an operator took it back: theirs now
            self.remove(worker.url, reason)

    async def wait_idle(self, worker: Worker, timeout: float) -> bool:
        """Wait until no request of this process is in flight on `worker`; False on timeout."""
        if worker.inflight == 0:
            return True
        waiter = asyncio.get_running_loop().create_future()
        waiters = self._idle_waiters.setdefault(worker, [])
        waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            pass
        finally:
            with contextlib.suppress(ValueError):
                waiters.remove(waiter)
            if not waiters and self._idle_waiters.get(worker) is waiters:
                del self._idle_waiters[worker]
        return worker.inflight == 0

    def remove(self, url: str, reason: str) -> Worker | None:
        """Forget a worker now; requests already relayed to it finish. None if unknown."""
        self.retiring.pop(url, None)
        return self.registry.remove(url, reason)

"""Background probes: each worker's /health and /v1/models, on a period, with thresholds.

A probe passes when /health answers 2xx and /v1/models lists the worker's models (so models
and LoRA adapters loaded at run time appear). `healthy_after` consecutive passes make a
joining or unhealthy worker ready; `unhealthy_after` consecutive failures make a ready (or
joining) worker unhealthy. A draining worker keeps its state; its models still refresh.
Probes write only through `WorkerRegistry` methods.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import aiohttp
import orjson

from vllm_gateway.config.gateway import ProbeConfig
from vllm_gateway.fleet.periodic import Periodic
from vllm_gateway.log import get_logger
from vllm_gateway.proxy.pool import UpstreamPool
from vllm_gateway.workers import Worker, WorkerRegistry, WorkerState

log = get_logger("vllm_gateway.health")


@dataclass(slots=True)
class ProbeResult:
    ok: bool
    models: list[str] = field(default_factory=list)
    reason: str = ""


async def probe_worker(
    session: aiohttp.ClientSession, url: str, timeout: float, api_key: str | None = None
) -> ProbeResult:
    """GET /health and /v1/models of one worker; never raises."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t = aiohttp.ClientTimeout(total=timeout)
    try:
        async with session.get(url + "/health", timeout=t, headers=headers) as r:
            await r.read()
            if r.status >= 300:
                return ProbeResult(False, reason=f"/health answered {r.status}")
        async with session.get(url + "/v1/models", timeout=t, headers=headers) as r:
            body = await r.read()
            if r.status >= 300:
                return ProbeResult(False, reason=f"/v1/models answered {r.status}")
        doc = orjson.loads(body)
        models = [m["id"] for m in doc.get("data", []) if isinstance(m, dict) and "id" in m]
    except TimeoutError:
        return ProbeResult(False, reason=f"no answer within {timeout:g} s")
    except aiohttp.ClientError as e:
        return ProbeResult(False, reason=f"{type(e).__name__}: {e}")
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        return ProbeResult(False, reason="/v1/models answered something that is not a model list")
    if not models:
        return ProbeResult(False, reason="/v1/models lists no model")
    return ProbeResult(True, models)


class Prober:
    """Probes every worker each `interval`, concurrently, and applies the thresholds."""

    def __init__(
        self,
        registry: WorkerRegistry,
        pool: UpstreamPool,
        config: ProbeConfig,
        api_key: str | None = None,
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.config = config
        self.api_key = api_key
        self._passes: dict[str, int] = {}
        self._fails: dict[str, int] = {}
        self._rounds = Periodic(
            "prober", self.probe_all, lambda: self.config.interval, log, "probe round failed"
        )

    async def probe_all(self) -> None:
        """One round: probe every worker now and apply the results."""
        workers = list(self.registry)
        results = await asyncio.gather(
            *(
                probe_worker(self.pool.session, w.url, self.config.timeout, self.api_key)
                for w in workers
            )
        )
        for worker, result in zip(workers, results, strict=True):
            self.apply(worker, result)
        # Forget the counts of workers that left, so one re-added later starts afresh.
        for counts in (self._passes, self._fails):
            for url in [u for u in counts if self.registry.get(u) is None]:
                del counts[url]

    async def probe_one(self, worker: Worker) -> ProbeResult:
        """Probe one worker now (it was just added, registered or undrained)."""
        result = await probe_worker(
            self.pool.session, worker.url, self.config.timeout, self.api_key
        )
        self.apply(worker, result)
        return result

    def forget(self, url: str) -> None:
        """Start counting afresh for `url` (it was re-added)."""
        self._passes.pop(url, None)
        self._fails.pop(url, None)

    def apply(self, worker: Worker, result: ProbeResult) -> None:
        """Count a probe result and move the worker's state when a threshold is crossed."""
        url = worker.url
        if self.registry.get(url) is not worker:
            return  # removed while the probe was out
        if result.ok:
            self._fails[url] = 0
            self._passes[url] = self._passes.get(url, 0) + 1
            self.registry.set_models(worker, result.models)
            if (
                worker.state in (WorkerState.JOINING, WorkerState.UNHEALTHY)
                and self._passes[url] >= self.config.healthy_after
            ):
                self.registry.set_state(worker, WorkerState.READY, "probe passed")
        else:
            self._passes[url] = 0
            self._fails[url] = self._fails.get(url, 0) + 1
            if (
                worker.state in (WorkerState.JOINING, WorkerState.READY)
                and self._fails[url] >= self.config.unhealthy_after
            ):
                self.registry.set_state(worker, WorkerState.UNHEALTHY, result.reason)

    async def start(self) -> None:
        """Probe once (bounded by `startup_wait`) so serving starts informed, then loop."""
        if self.config.startup_wait > 0 and len(self.registry):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.startup_wait):
                    await self.probe_all()
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

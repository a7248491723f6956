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
from vllm_gateway.config.load import check_model_name
from vllm_gateway.fleet.pages import PageTooLarge, parse_off_loop, read_capped
from vllm_gateway.fleet.periodic import Periodic
from vllm_gateway.log import get_logger
from vllm_gateway.proxy.pool import UpstreamPool
from vllm_gateway.workers import Worker, WorkerRegistry, WorkerState

log = get_logger("vllm_gateway.health")


# A /v1/models page listing more models than this fails the probe (vLLM lists one model
# plus its LoRA adapters; a thousand is far beyond any real server).
MAX_MODELS = 1000


@dataclass(slots=True)
class ProbeResult:
    ok: bool
    models: list[str] = field(default_factory=list)
    reason: str = ""
    bad_answer: bool = False  # the worker answered, with something the gateway refuses


def models_from_page(body: bytes) -> list[str]:
    """The model ids of a /v1/models page; ValueError saying why the page is refused.

    Every id must be a usable model name (a string, not empty, no control characters):
    one that is not would break every sorted list of models and every log line that
    names it, so the whole page is refused, not the one entry.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ValueError("/v1/models answered something that is not JSON") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models answered something that is not a model list")
    if len(data) > MAX_MODELS:
        raise ValueError(f"/v1/models lists {len(data)} models, over {MAX_MODELS}")
    models = []
    for entry in data:
        if not isinstance(entry, dict) or "id" not in entry:
            continue  # not a model entry; vLLM never sends one, a future field might
        model = entry["id"]
        if not isinstance(model, str):
            raise ValueError(f"/v1/models lists a model id that is not a string: {model!r:.80}")
        if problem := check_model_name(model):
            raise ValueError(f"/v1/models lists a bad model id: {problem:.120}")
        models.append(model)
    return models


async def probe_worker(
    session: aiohttp.ClientSession,
    url: str,
    timeout: float,
    api_key: str | None = None,
    max_bytes: int = 1 << 20,
) -> ProbeResult:
    """GET /health and /v1/models (at most `max_bytes` of it) of one worker; never raises."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t = aiohttp.ClientTimeout(total=timeout)
    try:
        async with session.get(url + "/health", timeout=t, headers=headers) as r:
            await read_capped(r, max_bytes)
            if r.status >= 300:
                return ProbeResult(False, reason=f"/health answered {r.status}")
        async with session.get(url + "/v1/models", timeout=t, headers=headers) as r:
            body = await read_capped(r, max_bytes)
            if r.status >= 300:
                return ProbeResult(False, reason=f"/v1/models answered {r.status}")
        models = await parse_off_loop(models_from_page, body)
    except TimeoutError:
        return ProbeResult(False, reason=f"no answer within {timeout:g} s")
    except aiohttp.ClientError as e:
        return ProbeResult(False, reason=f"{type(e).__name__}: {e}")
    except PageTooLarge as e:
        return ProbeResult(False, reason=f"/v1/models or /health: {e}", bad_answer=True)
    except (ValueError, RecursionError) as e:
        return ProbeResult(False, reason=str(e), bad_answer=True)
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
        self._told: dict[str, str] = {}  # url -> the bad answer last logged for it
        # Telemetry, read at scrape time by the metrics endpoint.
        self.failures = 0  # probes that failed, for any reason
        self.bad_answers = 0  # of those, answers the gateway refused (type, size)
        self._rounds = Periodic(
            "prober", self.probe_all, lambda: self.config.interval, log, "probe round failed"
        )

    async def probe_all(self) -> None:
        """One round: probe every worker now and apply the results."""
        workers = list(self.registry)
        results = await asyncio.gather(*(self._probe(w) for w in workers))
        for worker, result in zip(workers, results, strict=True):
            # Each result on its own: a bug applying one must not starve the workers after it.
            try:
                self.apply(worker, result)
            except Exception:
                log.exception("applying a probe result failed", worker=worker.url)
        # Forget the counts of workers that left, so one re-added later starts afresh.
        for counts in (self._passes, self._fails, self._told):
            for url in [u for u in counts if self.registry.get(u) is None]:
                del counts[url]

    async def probe_one(self, worker: Worker) -> ProbeResult:
        """Probe one worker now (it was just added, registered or undrained)."""
        result = await self._probe(worker)
        self.apply(worker, result)
        return result

    async def _probe(self, worker: Worker) -> ProbeResult:
        c = self.config
        return await probe_worker(
            self.pool.session, worker.url, c.timeout, self.api_key, c.max_models_bytes
        )

    def forget(self, url: str) -> None:
        """Start counting afresh for `url` (it was re-added)."""
        self._passes.pop(url, None)
        self._fails.pop(url, None)
        self._told.pop(url, None)

    def apply(self, worker: Worker, result: ProbeResult) -> None:
        """Count a probe result and move the worker's state when a threshold is crossed."""
        url = worker.url
        if self.registry.get(url) is not worker:
            return  # removed while the probe was out
        if result.ok:
            self._told.pop(url, None)
            self._fails[url] = 0
            self._passes[url] = self._passes.get(url, 0) + 1
            self.registry.set_models(worker, result.models)
            if (
                worker.state in (WorkerState.JOINING, WorkerState.UNHEALTHY)
                and self._passes[url] >= self.config.healthy_after
            ):
                self.registry.set_state(worker, WorkerState.READY, "probe passed")
        else:
            self._count_failure(url, result)
            self._passes[url] = 0
            self._fails[url] = self._fails.get(url, 0) + 1
            if (
                worker.state in (WorkerState.JOINING, WorkerState.READY)
                and self._fails[url] >= self.config.unhealthy_after
            ):
                self.registry.set_state(worker, WorkerState.UNHEALTHY, result.reason)

    def _count_failure(self, url: str, result: ProbeResult) -> None:
        """Count a failed probe; log a refused answer once per worker until it changes."""
        self.failures += 1
        if not result.bad_answer:
            return
        self.bad_answers += 1
        if self._told.get(url) != result.reason:
            self._told[url] = result.reason
            log.warning("worker answer refused", worker=url, reason=result.reason)

    async def start(self) -> None:
        """Probe once (bounded by `startup_wait`) so serving starts informed, then loop."""
        if self.config.startup_wait > 0 and len(self.registry):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.startup_wait):
                    await self.probe_all()
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

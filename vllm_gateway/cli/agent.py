"""`vllm-gateway register`: the agent that runs beside one vLLM server and keeps it registered.

    wait until the worker's /health answers 200 (it may take minutes to load a model)
    register it with every gateway (POST /register_worker, with its models and queue)
    every `heartbeat` seconds: POST /receive_heart_beat with the queue length read from the
        worker's /metrics (running + waiting); {"exist": false} means the gateway restarted
        and forgot the worker, so register again; an unreachable gateway is retried
    on SIGTERM or SIGINT: ask every gateway to drain the worker (POST /drain_worker), wait
        until it is idle, then deregister it (POST /unregister_worker) and exit 0

Idle means every gateway reports nothing of its own in flight on the worker and the
worker's own /metrics shows nothing running or waiting: the latter covers gateway
replicas the agent does not know of, and each process of a multi-process gateway. The wait
is bounded by `drain_timeout`; the worker is deregistered either way.

Under systemd, packaging/systemd/vllm-gateway-register@.service runs one agent per vLLM
unit, stopped before it (so the drain happens while the server still answers).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from vllm_gateway.fleet.scrape import MetricNames, parse_metrics
from vllm_gateway.log import get_logger

log = get_logger("vllm_gateway.agent")

# vLLM's queue gauges (the same names in every vLLM release with /metrics).
METRICS = MetricNames(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_cache=(),
)


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """How the agent behaves. Durations are in seconds."""

    gateways: tuple[str, ...]
    worker: str
    token: str | None = None  # the gateway's registration.token
    worker_api_key: str | None = None  # the worker's own --api-key, for /v1/models
    heartbeat: float = 10.0  # between two heartbeats (FastChat: 45; the expiry is 90)
    drain_timeout: float = 600.0  # longest wait for the worker to go idle when leaving
    startup_timeout: float = 0.0  # longest wait for the worker's first healthy answer; 0: none
    request_timeout: float = 5.0  # one request to a gateway or the worker

    @property
    def poll(self) -> float:
        """Between two /health probes while starting, and two looks for idle while leaving."""
        return min(1.0, self.heartbeat)


class Agent:
    """Keeps one worker registered with some gateways, and takes it out cleanly."""

    def __init__(self, settings: AgentSettings, session: aiohttp.ClientSession) -> None:
        self.s = settings
        self.session = session
        self.registered: dict[str, bool] = dict.fromkeys(settings.gateways, False)
        self._auth = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
        self._worker_auth = (
            {"Authorization": f"Bearer {settings.worker_api_key}"}
            if settings.worker_api_key
            else {}
        )

    async def run(self, stop: asyncio.Event) -> int:
        """Until `stop` is set: wait for the worker, register, heartbeat; then leave."""
        if not await self.wait_healthy(stop):
            return 0 if stop.is_set() else 1
        while not stop.is_set():
            await self.beat_all()
            await _sleep_unless(stop, self.s.heartbeat)
        if any(self.registered.values()):
            await self.leave()
        else:
            log.info("stopping; the worker was never registered", worker=self.s.worker)
        return 0

    # --- the worker ----------------------------------------------------------------------

    async def _get(self, path: str) -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=self.s.request_timeout)
        async with self.session.get(
            self.s.worker + path, headers=self._worker_auth, timeout=timeout
        ) as r:
            return r.status, await r.read()

    async def worker_healthy(self) -> bool:
        try:
            status, _ = await self._get("/health")
        except (aiohttp.ClientError, TimeoutError):
            return False
        return status == 200

    async def wait_healthy(self, stop: asyncio.Event) -> bool:
        """Wait until the worker answers /health; False on stop or startup timeout."""
        started = time.monotonic()
        logged = False
        while not stop.is_set():
            if await self.worker_healthy():
                log.info("worker healthy", worker=self.s.worker)
                return True
            if not logged:
                log.info("waiting for the worker to become healthy", worker=self.s.worker)
                logged = True
            if self.s.startup_timeout and time.monotonic() - started > self.s.startup_timeout:
                log.error(
                    "worker did not become healthy",
                    worker=self.s.worker,
                    waited_seconds=self.s.startup_timeout,
                )
                return False
            await _sleep_unless(stop, self.s.poll)
        return False

    async def models(self) -> list[str]:
        """The worker's models from its /v1/models; empty when it cannot say."""
        try:
            status, body = await self._get("/v1/models")
            if status != 200:
                return []
            return [m["id"] for m in orjson.loads(body).get("data", []) if "id" in m]
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError, TypeError):
            return []

    async def queue_length(self) -> float | None:
        """Requests running and waiting on the worker, from its /metrics; None if unknown."""
        try:
            status, body = await self._get("/metrics")
        except (aiohttp.ClientError, TimeoutError):
            return None
        if status != 200:
            return None
        stats = parse_metrics(body.decode("utf-8", "replace"), METRICS)
        return None if stats is None else stats.running + stats.waiting

    # --- the gateways --------------------------------------------------------------------

    async def _post(self, gateway: str, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """POST to a gateway; its JSON answer, or None (logged) when that failed."""
        timeout = aiohttp.ClientTimeout(total=self.s.request_timeout)
        try:
            async with self.session.post(
                gateway + path, data=orjson.dumps(body), headers=self._auth, timeout=timeout
            ) as r:
                raw = await r.read()
                if r.status != 200:
                    log.warning(
                        "gateway refused",
                        gateway=gateway,
                        path=path,
                        status=r.status,
                        answer=raw[:300].decode("utf-8", "replace"),
                    )
                    return None
                return orjson.loads(raw)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("gateway unreachable", gateway=gateway, path=path, error=str(e) or repr(e))
            return None

    async def register(self, gateway: str) -> bool:
        queue = await self.queue_length()
        status: dict[str, Any] = {"model_names": await self.models(), "speed": 1}
        if queue is not None:
            status["queue_length"] = queue
        answer = await self._post(
            gateway,
            "/register_worker",
            {"worker_name": self.s.worker, "check_heart_beat": True, "worker_status": status},
        )
        ok = answer is not None
        if answer is not None:
            log.info(
                "registered",
                gateway=gateway,
                worker=self.s.worker,
                state=answer.get("state"),
                models=answer.get("models"),
            )
        self.registered[gateway] = ok
        return ok

    async def heartbeat(self, gateway: str, queue: float | None) -> dict[str, Any] | None:
        body: dict[str, Any] = {"worker_name": self.s.worker}
        if queue is not None:
            body["queue_length"] = queue
        return await self._post(gateway, "/receive_heart_beat", body)

    async def beat_all(self) -> None:
        """Heartbeat every gateway (registering where the gateway does not know the worker)."""
        queue = await self.queue_length()
        for gateway in self.s.gateways:
            if not self.registered[gateway]:
                await self.register(gateway)
                continue
            answer = await self.heartbeat(gateway, queue)
            if answer is not None and not answer.get("exist", False):
                log.info(
                    "gateway forgot the worker (restarted?); registering again", gateway=gateway
                )
                await self.register(gateway)

    # --- leaving -------------------------------------------------------------------------

    async def leave(self) -> bool:
        """Drain at every gateway, wait until idle (bounded), deregister. True if idle."""
        log.info("draining", worker=self.s.worker, timeout_seconds=self.s.drain_timeout)
        for gateway in self.s.gateways:
            await self._post(gateway, "/drain_worker", {"worker_name": self.s.worker})
        started = time.monotonic()
        idle = False
        while True:
            inflight = await self._inflight()
            if inflight == 0:
                idle = True
                break
            if time.monotonic() - started >= self.s.drain_timeout:
                break
            await asyncio.sleep(self.s.poll)
        waited = round(time.monotonic() - started, 3)
        if idle:
            log.info("worker idle", worker=self.s.worker, waited_seconds=waited)
        else:
            log.warning(
                "worker still busy at the drain timeout; deregistering anyway",
                worker=self.s.worker,
                inflight=inflight,
                waited_seconds=waited,
            )
        for gateway in self.s.gateways:
            await self._post(gateway, "/unregister_worker", {"worker_name": self.s.worker})
        log.info("deregistered", worker=self.s.worker)
        return idle

    async def _inflight(self) -> float:
        """Requests still on the worker: the most any gateway or the worker itself reports."""
        counts: list[float] = []
        queue = await self.queue_length()
        if queue is not None:
            counts.append(queue)
        for gateway in self.s.gateways:
            answer = await self.heartbeat(gateway, queue)
            if answer is not None and answer.get("exist"):
                counts.append(float(answer.get("inflight", 0)))
        return max(counts, default=0.0)


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less if `stop` is set meanwhile."""
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        pass


def run_agent(settings: AgentSettings) -> int:
    """Run the agent until SIGTERM/SIGINT (then drain and deregister); the exit code."""
    from vllm_gateway.http.server import run_until_signal

    code = 0

    async def main(stop: asyncio.Event) -> None:
        nonlocal code
        async with aiohttp.ClientSession() as session:
            code = await Agent(settings, session).run(stop)

    run_until_signal(main)
    return code

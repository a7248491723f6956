"""Shared fixtures: real fake workers and real gateways on 127.0.0.1, port 0.

Every fixture stops what it started, so a test leaves no task or socket behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from vllm_gateway import log as log_setup
from vllm_gateway.app import create_app
from vllm_gateway.config.gateway import GatewayConfig, ProbeConfig, WorkerSpec
from vllm_gateway.fake_worker import FakeWorker, FakeWorkerConfig
from vllm_gateway.http.server import RunningServer, start_server

# Probes fast enough that a test sees state changes within a fraction of a second.
FAST_PROBES = ProbeConfig(
    interval=0.1, timeout=0.5, healthy_after=1, unhealthy_after=1, startup_wait=2.0
)
# For tests under sustained load on a busy machine: one slow probe does not take a worker
# out, three failed ones (0.6 s when connections are refused) do.
STEADY_PROBES = ProbeConfig(
    interval=0.2, timeout=2.0, healthy_after=1, unhealthy_after=3, startup_wait=2.0
)


@pytest.fixture
async def fake_worker() -> AsyncIterator[Callable[..., Awaitable[FakeWorker]]]:
    """Factory: `await fake_worker(models=("m",), tpot_ms=5, ...)` starts a fake worker."""
    started: list[FakeWorker] = []

    async def make(**kwargs: Any) -> FakeWorker:
        if "models" in kwargs and isinstance(kwargs["models"], str):
            kwargs["models"] = (kwargs["models"],)
        worker = FakeWorker(FakeWorkerConfig(**kwargs))
        await worker.start("127.0.0.1", 0)
        started.append(worker)
        return worker

    yield make
    for w in started:
        await w.stop()


@pytest.fixture
async def gateway() -> AsyncIterator[Callable[..., Awaitable[RunningServer]]]:
    """Factory: `await gateway(workers=[w1, w2], policy=...)` starts a gateway on port 0.

    `workers` may hold FakeWorkers, URLs or WorkerSpecs; other keyword arguments are
    GatewayConfig fields.
    """
    started: list[RunningServer] = []

    async def make(workers: list[Any] = (), **kwargs: Any) -> RunningServer:
        specs = tuple(
            w if isinstance(w, WorkerSpec) else WorkerSpec(url=w if isinstance(w, str) else w.url)
            for w in workers
        )
        kwargs.setdefault("probe", FAST_PROBES)
        config = GatewayConfig(host="127.0.0.1", port=0, workers=specs, **kwargs)
        server = await start_server(
            create_app(config), "127.0.0.1", 0, shutdown_timeout=1.0, client=config.client
        )
        started.append(server)
        return server

    yield make
    for s in started:
        await s.stop()


@pytest.fixture
async def client() -> AsyncIterator[Callable[..., openai.AsyncOpenAI]]:
    """Factory: `client(gw)` is the official openai SDK pointed at a gateway (or worker)."""
    made: list[openai.AsyncOpenAI] = []

    def make(server: Any, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 20)
        kwargs.setdefault("api_key", "unused")
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


class LogLines(io.StringIO):
    """What the gateway logged during a test, as JSON lines."""

    def records(self, event: str | None = None) -> list[dict[str, Any]]:
        out = [orjson.loads(line) for line in self.getvalue().splitlines() if line.startswith("{")]
        return [r for r in out if event is None or r.get("event") == event]


@pytest.fixture
def logs() -> Iterator[LogLines]:
    """Capture the structured log (JSON lines, level info) for the test's duration."""
    lines = LogLines()
    log_setup.configure("json", "info", stream=lines)
    yield lines
    logging.getLogger().handlers[:] = []


async def wait_until(
    predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02
) -> None:
    """Wait until `predicate()` is true, or fail the test after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


def replace(config: Any, **changes: Any) -> Any:
    return dataclasses.replace(config, **changes)

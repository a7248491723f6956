"""`vllm-gateway register` as a real subprocess: join, heartbeat, re-register, SIGTERM drain."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import orjson
import pytest

from tests.conftest import wait_until
from tests.support.streams import completions_at, stream_text
from vllm_gateway.app import REGISTRATION, REGISTRY
from vllm_gateway.config.gateway import RegistrationConfig
from vllm_gateway.workers import WorkerState

pytestmark = pytest.mark.timeout(60)

TOKEN = "agent-token-55e1"


async def start_agent(gateway_url: str, worker_url: str, *extra: str):
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vllm_gateway",
        "register",
        "--gateway",
        gateway_url,
        "--worker",
        worker_url,
        "--heartbeat",
        "0.2",
        "--log-format",
        "json",
        *extra,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "VLLM_GATEWAY_REGISTRATION_TOKEN": TOKEN},
    )


async def read_until(agent, event: str, timeout: float = 15) -> bytes:
    """The agent's log lines up to and including the first one for `event`."""
    seen = b""
    async with asyncio.timeout(timeout):
        while True:
            line = await agent.stderr.readline()
            assert line, f"the agent ended before logging {event!r}: {seen.decode()}"
            seen += line
            if line.startswith(b"{") and orjson.loads(line).get("event") == event:
                return seen


def events(stderr: bytes) -> list[dict]:
    return [orjson.loads(line) for line in stderr.splitlines() if line.startswith(b"{")]


async def test_agent_registers_heartbeats_and_drains_on_sigterm(fake_worker, gateway, client):
    static = await fake_worker(models="m", tpot_ms=40, ttft_ms=1)
    agented = await fake_worker(models="m", tpot_ms=40, ttft_ms=1)
    gw = await gateway(
        [static],
        registration=RegistrationConfig(token=TOKEN, heartbeat_expiry=5),
        policy="queue",  # equal prompts spread (the default keeps them together, bounded)
    )
    registry = gw.app[REGISTRY]
    agent = await start_agent(gw.url, agented.url)
    try:
        await wait_until(
            lambda: (w := registry.get(agented.url)) is not None and w.available, timeout=15
        )
        assert registry.get(agented.url).source == "registered"
        # Heartbeats carry the queue length the agent read from the worker's /metrics.
        beats = gw.app[REGISTRATION].heartbeats
        await wait_until(lambda: beats[agented.url].queue_length is not None, timeout=5)

        c = client(gw)
        streams = [asyncio.create_task(stream_text(c, 40)) for _ in range(6)]  # ~1.6 s each
        await wait_until(lambda: registry.get(agented.url).inflight >= 1, timeout=5)
        agent.send_signal(signal.SIGTERM)
        await wait_until(lambda: registry.get(agented.url).state is WorkerState.DRAINING, timeout=5)
        sent = completions_at(agented)
        quick = await asyncio.gather(*(stream_text(c, 2) for _ in range(8)))
        assert quick == [" w0 w1"] * 8 and completions_at(agented) == sent  # nothing new

        # The agent waits for the streams, then deregisters and exits 0.
        assert agent.returncode is None
        texts = await asyncio.gather(*streams)
        assert texts == ["".join(f" w{i}" for i in range(40))] * 6
        _, stderr = await asyncio.wait_for(agent.communicate(), timeout=10)
        assert agent.returncode == 0, stderr.decode()
        assert registry.get(agented.url) is None
        names = [e["event"] for e in events(stderr)]
        assert names.index("draining") < names.index("worker idle") < names.index("deregistered")
        assert TOKEN not in stderr.decode()
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()


async def test_agent_waits_for_the_worker_and_registers_again_after_a_gateway_restart(
    fake_worker, gateway
):
    w = await fake_worker(models="m")
    await w.pause()  # not up yet: the agent waits for its /health
    gw = await gateway([], registration=RegistrationConfig(token=TOKEN))
    agent = await start_agent(gw.url, w.url)
    try:
        before = await read_until(agent, "waiting for the worker to become healthy")
        assert len(gw.app[REGISTRY]) == 0
        await w.resume()
        await wait_until(lambda: gw.app[REGISTRY].get(w.url) is not None, timeout=15)

        # The gateway restarts (a new process would forget every registered worker).
        gw.app[REGISTRY].remove(w.url, "test: forget it")
        await wait_until(lambda: gw.app[REGISTRY].get(w.url) is not None, timeout=5)
        agent.send_signal(signal.SIGINT)
        _, stderr = await asyncio.wait_for(agent.communicate(), timeout=10)
        assert agent.returncode == 0
        names = [e["event"] for e in events(before + stderr)]
        assert "gateway forgot the worker (restarted?); registering again" in names
        assert names.count("registered") == 2
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()


async def test_agent_with_a_wrong_token_is_refused_and_keeps_trying(fake_worker, gateway):
    w = await fake_worker(models="m")
    gw = await gateway([], registration=RegistrationConfig(token="another-token"))
    agent = await start_agent(gw.url, w.url)
    try:
        await asyncio.sleep(1.5)
        assert len(gw.app[REGISTRY]) == 0
        agent.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(agent.communicate(), timeout=10)
        refusals = [e for e in events(stderr) if e["event"] == "gateway refused"]
        assert refusals and refusals[0]["status"] == 401
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()

"""`vllm-gateway rollout` as a real subprocess, under continuous streaming load."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import Counter

import openai
import pytest
from aiohttp import web

from tests.conftest import STEADY_PROBES, wait_until
from vllm_gateway.app import REGISTRY
from vllm_gateway.config.gateway import AdminConfig
from vllm_gateway.fake_worker import FakeWorker, FakeWorkerConfig
from vllm_gateway.http.server import start_server
from vllm_gateway.workers import WorkerState

pytestmark = pytest.mark.timeout(90)

TOKEN = "rollout-admin-token"
TOKENS = 12
EXPECTED = "".join(f" w{i}" for i in range(TOKENS))


async def run_rollout(gw, *args: str, timeout: float = 60) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vllm_gateway",
        "rollout",
        "--gateway",
        gw.url,
        "--poll",
        "0.05",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "VLLM_GATEWAY_ADMIN_TOKEN": TOKEN},
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, out.decode()


def completions(worker: FakeWorker) -> int:
    return sum(1 for r in worker.stats.requests if r.path == "/v1/completions")


class Load:
    """Streaming completions for `model` from `n` loops until stopped; every outcome kept."""

    def __init__(self, c: openai.AsyncOpenAI, model: str, n: int = 12) -> None:
        self.c = c
        self.model = model
        self.outcomes: Counter[str] = Counter()  # "ok:<served model>", "truncated", "error: ..."
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._loop()) for _ in range(n)]

    async def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                stream = await self.c.completions.create(
                    model=self.model, prompt="x", max_tokens=TOKENS, stream=True
                )
                parts, served = [], None
                async for chunk in stream:
                    served = chunk.model
                    if chunk.choices:
                        parts.append(chunk.choices[0].text)
                text = "".join(parts)
                self.outcomes["ok:" + str(served) if text == EXPECTED else "truncated"] += 1
            except openai.APIError as e:
                self.outcomes[f"error: {e}"] += 1

    async def stop(self) -> Counter[str]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes


async def test_rollout_replaces_every_worker_under_streaming_load_with_no_failed_request(
    fake_worker, gateway, client, http
):
    old = [await fake_worker(models="m-v1", tpot_ms=10, ttft_ms=2) for _ in range(3)]
    gw = await gateway(
        old, admin=AdminConfig(token=TOKEN), aliases={"m": {"m-v1": 1}}, probe=STEADY_PROBES
    )
    registry = gw.app[REGISTRY]
    new: list[FakeWorker] = []

    async def orchestrator() -> None:
        """Like a cluster manager: when a v1 worker is removed, stop it, start a v2 one."""
        pending = {w.url: w for w in old}
        while pending:
            for url, w in list(pending.items()):
                if registry.get(url) is None:
                    del pending[url]
                    await w.stop()
                    fresh = FakeWorker(FakeWorkerConfig(models=("m-v2",), tpot_ms=10, ttft_ms=2))
                    await fresh.start()
                    new.append(fresh)
                    async with http.post(
                        gw.url + "/register_worker", json={"worker_name": fresh.url}
                    ) as r:
                        assert r.status == 200
            await asyncio.sleep(0.02)

    load = Load(client(gw), "m")
    manager = asyncio.create_task(orchestrator())
    try:
        await wait_until(lambda: sum(load.outcomes.values()) >= 20, timeout=10)
        code, out = await run_rollout(gw, "--model", "m-v1", "--to", "m-v2", "--alias", "m")
        await asyncio.wait_for(manager, timeout=5)
        before_end = sum(load.outcomes.values())
        await wait_until(lambda: sum(load.outcomes.values()) >= before_end + 30, timeout=10)
        outcomes = await load.stop()

        assert code == 0, out
        failed = {k: n for k, n in outcomes.items() if not k.startswith("ok:")}
        assert not failed, (failed, out)
        assert outcomes["ok:m-v1"] > 0 and outcomes["ok:m-v2"] > 0
        for i in (1, 2, 3):
            assert f"[{i}/3]" in out
        assert "draining:" in out and "idle after" in out
        assert "traffic: m -> m-v1 67%, m-v2 33%" in out
        assert out.count("traffic: m -> m-v2 100%") == 1
        assert "summary: 3 of 3 worker(s) replaced" in out and "done: every worker replaced" in out

        # Afterwards all traffic reaches the new version, on the new workers.
        assert sorted(w.url for w in registry) == sorted(w.url for w in new)
        before = sum(completions(w) for w in new)
        answers = await asyncio.gather(
            *(client(gw).completions.create(model="m", prompt="x", max_tokens=1) for _ in range(30))
        )
        assert {a.model for a in answers} == {"m-v2"}
        assert sum(completions(w) for w in new) == before + 30
    finally:
        manager.cancel()
        if not load._stop.is_set():
            await load.stop()
        for w in new:
            await w.stop()


async def test_rollout_with_a_command_restarting_in_place_and_its_abort(
    fake_worker, gateway, client
):
    old = [await fake_worker(models="m", tpot_ms=5, ttft_ms=1) for _ in range(3)]
    by_port = {w.port: w for w in old}
    restarted: list[FakeWorker] = []

    async def restart(request: web.Request) -> web.Response:
        """The operator's command calls this: restart the worker on its port as m-v2."""
        port = int(request.query["port"])
        await by_port[port].stop()
        if request.query.get("broken"):
            return web.Response(text="not coming back\n")
        fresh = FakeWorker(FakeWorkerConfig(models=("m",), tpot_ms=5, ttft_ms=1))
        await fresh.start(port=port)
        restarted.append(fresh)
        return web.Response(text=f"restarted {port}\n")

    control = web.Application()
    control.router.add_post("/restart", restart)
    ctl = await start_server(control, "127.0.0.1", 0)
    gw = await gateway(old, admin=AdminConfig(token=TOKEN), probe=STEADY_PROBES)
    registry = gw.app[REGISTRY]
    call = (
        f'{sys.executable} -c "import sys, urllib.request as u; '
        f"print(u.urlopen(u.Request(sys.argv[1], method='POST')).read().decode())\" "
    )
    load = Load(client(gw), "m", n=6)
    try:
        code, out = await run_rollout(
            gw, "--model", "m", "--command", call + f"'{ctl.url}/restart?port={{port}}'"
        )
        assert code == 0, out
        assert f"| restarted {old[0].port}" in out and "summary: 3 of 3" in out
        assert sorted(w.url for w in registry) == sorted(w.url for w in old)  # same URLs
        assert all(w.state is WorkerState.READY for w in registry)

        # A replacement that never comes back: abort after the ready timeout, the rest serve.
        by_port.update({w.port: w for w in restarted})
        started = time.monotonic()
        code, out = await run_rollout(
            gw,
            "--model",
            "m",
            "--ready-timeout",
            "1",
            "--command",
            call + f"'{ctl.url}/restart?port={{port}}&broken=1'",
        )
        assert code == 1 and "ABORTED: no replacement" in out, out
        assert "summary: 0 of 3" in out and time.monotonic() - started < 20
        ready = [w for w in registry if w.state is WorkerState.READY]
        assert len(ready) == 2 and not any(w.state is WorkerState.DRAINING for w in registry)
        outcomes = await load.stop()
        assert set(outcomes) == {"ok:m"}, outcomes  # still no failed request
    finally:
        if not load._stop.is_set():
            await load.stop()
        for w in restarted:
            await w.stop()
        await ctl.stop()

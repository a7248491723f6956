"""The autoscaler end to end: a scripted demand ramp of real streams, scale commands that
start and stop fake workers, bounds held, and no flapping."""

from __future__ import annotations

import asyncio
import sys
import time

import openai
import pytest
from aiohttp import web

from tests.conftest import STEADY_PROBES
from vllm_gateway.app import AUTOSCALER, REGISTRY
from vllm_gateway.config.gateway import AdminConfig, AutoscaleConfig, ScaleRule, ScrapeConfig
from vllm_gateway.fake_worker import FakeWorker, FakeWorkerConfig
from vllm_gateway.http.server import start_server

pytestmark = pytest.mark.timeout(90)

TOKEN = "scale-admin-token"
# ~0.4 s per stream, at a modest chunk rate: 24 SDK clients parsing chunks must leave the
# test's one process room to run the scale commands on a loaded machine.
WORKER = FakeWorkerConfig(models=("m",), tpot_ms=40, ttft_ms=2)
TOKENS = 10  # and up to 6 more (see Ramp)


class Machines:
    """Stands in for systemd: the scale commands POST here to start or stop worker N.

    Stopping does what the register agent does on SIGTERM: drain, wait idle, deregister.
    """

    def __init__(self, http) -> None:
        self.http = http
        self.gateway = ""
        self.workers: dict[int, FakeWorker] = {}
        self.calls: list[tuple[str, int]] = []

    async def start(self, request: web.Request) -> web.Response:
        index = int(request.query["index"])
        worker = FakeWorker(WORKER)
        await worker.start()
        self.workers[index] = worker
        await self._post("/register_worker", worker.url)
        self.calls.append(("up", index))
        return web.Response(text="started\n")

    async def stop(self, request: web.Request) -> web.Response:
        index = int(request.query["index"])
        worker = self.workers.pop(index)
        await self._post("/drain_worker", worker.url)
        deadline = time.monotonic() + 10
        while (await self._post("/receive_heart_beat", worker.url)).get("inflight"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await self._post("/unregister_worker", worker.url)
        await worker.stop()
        self.calls.append(("down", index))
        return web.Response(text="stopped\n")

    async def _post(self, path: str, url: str) -> dict:
        async with self.http.post(self.gateway + path, json={"worker_name": url}) as r:
            assert r.status == 200
            return await r.json()

    async def close(self) -> None:
        for w in self.workers.values():
            await w.stop()


class Ramp:
    """Streaming clients whose number follows a script.

    Their demand must be steady: clients that start together and ask for answers of one
    length end and start again in step, and an evaluation that falls in that gap (long on
    a loaded machine, where restarting ten SDK clients takes a while) sees little demand,
    which the scale-up window then takes as the truth. So each client starts a little
    after the one before it and asks for its own answer length.
    """

    def __init__(self, c: openai.AsyncOpenAI, most: int) -> None:
        self.c = c
        self.concurrency = 0
        self.completed = 0
        self.failures: list[str] = []
        self._stop = False
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(most)]

    async def _client(self, i: int) -> None:
        tokens = TOKENS + 2 * (i % 4)
        active = False
        while not self._stop:
            if i >= self.concurrency:
                active = False
                await asyncio.sleep(0.02)
                continue
            if not active:
                active = True
                await asyncio.sleep(0.03 * (i % 10))
            try:
                stream = await self.c.completions.create(
                    model="m", prompt="x", max_tokens=tokens, stream=True
                )
                text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
                if text != "".join(f" w{k}" for k in range(tokens)):
                    self.failures.append("truncated")
                self.completed += 1
            except openai.APIError as e:
                self.failures.append(str(e))

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)


def directions(calls: list[tuple[str, int]]) -> list[str]:
    """The runs of one direction: ["up", "down"] means up*, then down*: no flapping."""
    runs: list[str] = []
    for direction, _ in calls:
        if not runs or runs[-1] != direction:
            runs.append(direction)
    return runs


async def test_autoscaler_follows_a_demand_ramp_within_bounds_without_flapping(
    fake_worker, gateway, client, http, logs
):
    machines = Machines(http)
    control = web.Application()
    control.router.add_post("/start", machines.start)
    control.router.add_post("/stop", machines.stop)
    ctl = await start_server(control, "127.0.0.1", 0)
    call = (
        f'{sys.executable} -c "import sys, urllib.request as u; '
        f"u.urlopen(u.Request(sys.argv[1], method='POST'), timeout=30)\" "
    )
    rule = ScaleRule(
        min_workers=1,
        max_workers=4,
        scale_up_command=call + f"'{ctl.url}/start?index={{index}}'",
        scale_down_command=call + f"'{ctl.url}/stop?index={{index}}'",
    )
    first = await fake_worker(**vars(WORKER))  # index 1: always there (the minimum)
    gw = await gateway(
        [first],
        probe=STEADY_PROBES,
        admin=AdminConfig(token=TOKEN),
        scrape=ScrapeConfig(interval=0.1),
        autoscale=AutoscaleConfig(
            enabled=True,
            interval=0.1,
            target_per_worker=6,
            scale_down_below=0.7,
            cooldown=0.5,
            scale_up_window=0.5,
            scale_down_window=1.0,
            startup_grace=10,
            models={"m": rule},
        ),
    )
    machines.gateway = gw.url
    autoscaler = gw.app[AUTOSCALER]
    registry = gw.app[REGISTRY]
    ramp = Ramp(client(gw), 24)
    counts: list[int] = []

    async def hold(concurrency: int, seconds: float) -> None:
        ramp.concurrency = concurrency
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            counts.append(len(registry.serving("m")))
            await asyncio.sleep(0.05)

    async def hold_until(concurrency: int, calls: int, timeout: float) -> None:
        """Hold the demand until the autoscaler ran `calls` commands in all (bounded)."""
        ramp.concurrency = concurrency
        deadline = time.monotonic() + timeout
        while len(machines.calls) < calls:
            assert time.monotonic() < deadline, (concurrency, machines.calls)
            counts.append(len(registry.serving("m")))
            await asyncio.sleep(0.05)

    # Each step holds a demand until the commands it calls for have run (however long a
    # loaded machine takes to run them), then a while longer: longer than the scale-up
    # window and the cooldown, so a command too many would show.
    try:
        await hold(0, 0.8)
        assert machines.calls == []  # no demand, at the minimum: nothing to do
        await hold_until(10, 1, timeout=15)
        await hold(10, 1.2)
        assert machines.calls == [("up", 2)]  # ceil(10 / 6) = 2 workers
        await hold_until(24, 3, timeout=20)
        await hold(24, 1.2)
        assert machines.calls[1:] == [("up", 3), ("up", 4)]  # ceil(24 / 6) = 4 = the maximum
        async with http.get(
            gw.url + "/admin/scale", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as r:
            view = await r.json()
        assert view["models"]["m"]["desired"] == 4 and view["models"]["m"]["max_workers"] == 4
        assert view["models"]["m"]["demand"] > 12
        await hold_until(3, 6, timeout=20)  # fits on one worker at 70 % of the target: down to 1
        await hold(0, 1.5)  # nothing: stay at the minimum
        await ramp.stop()
    finally:
        await ramp.stop()
        await machines.close()
        await ctl.stop()

    assert ramp.failures == [] and ramp.completed > 50
    assert directions(machines.calls) == ["up", "down"], machines.calls  # no flapping
    assert machines.calls[3:] == [("down", 4), ("down", 3), ("down", 2)]
    assert max(counts) <= 4 and min(counts) >= 1
    assert [w.url for w in registry] == [first.url]
    assert autoscaler.signals["m"].desired == 1 and autoscaler.command_failures == 0
    async with http.get(gw.url + "/metrics") as r:
        text = await r.text()
    assert 'vllm_gateway_model_desired_workers{model="m"} 1' in text
    assert 'vllm_gateway_autoscale_commands_total{result="ok"} 6' in text
    scaled = [
        (r["event"], r["workers"], r["desired"], r["demand"])
        for r in logs.records()
        if r["event"].startswith("scaling")
    ]
    runs = directions([(event.removeprefix("scaling "), 0) for event, *_ in scaled])
    assert runs == ["up", "down"], scaled  # each decision logged once, with its numbers


async def test_requests_waiting_in_the_admission_queue_count_as_demand(
    fake_worker, gateway, client
):
    w = await fake_worker(models="m", max_num_seqs=1, tpot_ms=20, ttft_ms=1)
    gw = await gateway(
        [w],
        scrape=ScrapeConfig(interval=0.05),
        autoscale=AutoscaleConfig(
            interval=0.05, target_per_worker=2, queue_wait_up=0.2, scale_up_window=0
        ),
    )
    autoscaler = gw.app[AUTOSCALER]
    c = client(gw)
    seen = {"queued": 0, "wait": 0.0, "desired": 0}

    async def watch() -> None:
        while True:
            d = autoscaler.signals.get("m")
            if d is not None:
                seen["queued"] = max(seen["queued"], d.queued)
                seen["wait"] = max(seen["wait"], d.queue_wait)
                seen["desired"] = max(seen["desired"], d.desired)
            await asyncio.sleep(0.02)

    async def wave(n: int) -> list[str]:
        answers = await asyncio.gather(
            *(c.completions.create(model="m", prompt="x", max_tokens=15) for _ in range(n))
        )
        return [a.choices[0].text for a in answers]

    # The first wave queues in the worker, which teaches the gateway the worker's room
    # (its token bucket, docs/dispatch.md); the second then waits in the gateway.
    assert await wave(4) == ["".join(f" w{i}" for i in range(15))] * 4
    watcher = asyncio.create_task(watch())
    try:
        assert await wave(8) == ["".join(f" w{i}" for i in range(15))] * 8
    finally:
        watcher.cancel()
    # One request at a time on the worker: the rest waited in the gateway, and counted.
    assert seen["queued"] >= 2 and seen["wait"] > 0.2, seen
    assert seen["desired"] >= 4, seen  # 1 running + 7 queued at 2 per worker; no rule: no max

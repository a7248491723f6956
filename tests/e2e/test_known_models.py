"""A known model never answers 404, seen through the openai SDK.

Known: declared on a worker in the config, learned from a worker that is out now, or
scaled from zero by the autoscaler. While no worker can take it, a request is retried
elsewhere, waits in the admission queue (scale from zero), or gets 503 with Retry-After,
which SDKs retry; only a model nobody knows is a 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time

import openai
import pytest
from aiohttp import web

from tests.conftest import wait_until
from vllm_gateway.app import DISPATCHER, GATEWAY, REGISTRY
from vllm_gateway.config.gateway import (
    AutoscaleConfig,
    DispatchConfig,
    ProbeConfig,
    ScaleRule,
    TimeoutConfig,
    WorkerSpec,
)
from vllm_gateway.fake_worker import FakeWorker, FakeWorkerConfig
from vllm_gateway.http.server import start_server
from vllm_gateway.process.reload import apply_config
from vllm_gateway.workers import WorkerState

pytestmark = pytest.mark.timeout(30)

QUICK = TimeoutConfig(connect=0.5, first_byte=5.0, idle=5.0, total=0.0)
# Probes that never take a worker out by themselves (unhealthy_after is out of reach
# within a test) but bring one back at the first pass: what a test sees is the passive
# take-out on a refused connection, not a probe.
PASSIVE = ProbeConfig(
    interval=0.1, timeout=0.5, healthy_after=1, unhealthy_after=10_000, startup_wait=2
)
MESSAGES = [{"role": "user", "content": "hi"}]


async def ask(c: openai.AsyncOpenAI, model: str = "m") -> str:
    r = await c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
    return r.choices[0].message.content or ""


async def status_of(c: openai.AsyncOpenAI, model: str = "m") -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        await ask(c, model)
    return caught.value


async def test_declared_models_are_known_before_first_contact(fake_worker, gateway, client):
    w = await fake_worker(models="m")
    await w.pause()  # never reached: the gateway knows "m" only from the config
    gw = await gateway([WorkerSpec(url=w.url, models=("m",))], timeouts=QUICK)
    c = client(gw)
    e = await status_of(c)
    assert e.status_code == 503 and e.body["code"] == "no_worker_available"
    assert int(e.response.headers["Retry-After"]) >= 1
    assert (await status_of(c, "nope")).status_code == 404  # unknown stays unknown

    # An SDK that retries (it honours Retry-After) gets its answer once the worker is up.
    patient = client(gw, max_retries=4)
    t0 = time.monotonic()
    answer = asyncio.create_task(ask(patient))
    await asyncio.sleep(0.2)
    await w.resume()
    assert await asyncio.wait_for(answer, 15)
    assert time.monotonic() - t0 >= 0.2


async def test_a_worker_refusing_connections_is_out_at_once_then_503_not_502(
    fake_worker, gateway, client
):
    w = await fake_worker(models="m")
    gw = await gateway([w], timeouts=QUICK, probe=PASSIVE)  # "m" learned from /v1/models
    c = client(gw)
    registry = gw.app[REGISTRY]
    assert await ask(c)
    await w.pause()
    # Let the gateway see its pooled connection close: one sent down it in the same instant
    # is a 502 `worker_error` by the retry rule (it may have reached the worker).
    await asyncio.sleep(0.1)
    # The first request meets the refused connection: the worker is out from then on.
    for _ in range(3):
        e = await status_of(c)
        assert e.status_code == 503 and e.body["code"] == "no_worker_available", e.body
        assert int(e.response.headers["Retry-After"]) >= 1
    (worker,) = list(registry)
    assert worker.state is WorkerState.UNHEALTHY and worker.state_reason == "connection failed"
    assert worker.failed == 1  # one connect, then dispatch answered without trying it
    assert "m" in registry.known_models()  # remembered while out
    await w.resume()
    await wait_until(lambda: worker.state is WorkerState.READY, timeout=5)
    assert await ask(c)


async def test_a_refused_worker_is_tried_once_then_skipped(fake_worker, gateway, client):
    dead = await fake_worker(models="m")
    ok = await fake_worker(models="m")
    gw = await gateway([dead, ok], timeouts=QUICK, probe=PASSIVE, policy="round_robin")
    c = client(gw)
    await dead.pause()
    for _ in range(6):
        assert await ask(c)
    assert gw.app[DISPATCHER].retries == 1  # not one per probe interval


async def test_a_model_scales_from_zero_while_its_requests_wait(fake_worker, gateway, client, http):
    started: list[FakeWorker] = []
    gateway_url = ""

    async def start(request: web.Request) -> web.Response:
        worker = FakeWorker(FakeWorkerConfig(models=("z",)))
        await worker.start("127.0.0.1", 0)
        started.append(worker)
        async with http.post(
            gateway_url + "/register_worker", json={"worker_name": worker.url}
        ) as r:
            assert r.status == 200
        return web.Response(text="started\n")

    control = web.Application()
    control.router.add_post("/start", start)
    ctl = await start_server(control, "127.0.0.1", 0)
    command = (
        f'{sys.executable} -c "import sys, urllib.request as u; '
        f"u.urlopen(u.Request(sys.argv[1], method='POST'), timeout=10)\" '{ctl.url}/start'"
    )
    other = await fake_worker(models="m")
    rule = ScaleRule(min_workers=0, max_workers=1, scale_up_command=command)
    gw = await gateway(
        [other],
        autoscale=AutoscaleConfig(enabled=True, interval=0.1, models={"z": rule}),
        dispatch=DispatchConfig(max_queue_wait=20),
    )
    gateway_url = gw.url
    try:
        c = client(gw)
        assert gw.app[REGISTRY].serving("z") == ()
        assert (await status_of(c, "nope")).status_code == 404
        t0 = time.monotonic()
        answers = await asyncio.gather(*(ask(c, "z") for _ in range(3)))
        assert all(answers) and len(started) == 1
        assert time.monotonic() - t0 > 0.05  # they waited for the worker to start
        assert gw.app[DISPATCHER].admission.admitted == 3
    finally:
        await ctl.stop()
        for worker in started:
            await worker.stop()


async def test_scale_from_zero_waits_within_the_queue_bound(gateway, client):
    rule = ScaleRule(min_workers=0, max_workers=1)  # no command: nothing will start
    gw = await gateway(
        [],
        autoscale=AutoscaleConfig(interval=0.1, models={"z": rule}),
        dispatch=DispatchConfig(max_queue_wait=0.5),
    )
    t0 = time.monotonic()
    e = await status_of(client(gw), "z")
    assert e.status_code == 503 and e.body["code"] == "queue_timeout"
    assert int(e.response.headers["Retry-After"]) >= 1
    assert 0.4 < time.monotonic() - t0 < 5


async def test_a_reload_that_adds_a_scale_from_zero_rule_makes_the_model_wait(gateway, client):
    gw = await gateway([], dispatch=DispatchConfig(max_queue_wait=0.3))
    c = client(gw)
    assert (await status_of(c, "z")).status_code == 404
    config = gw.app[GATEWAY].config
    rule = ScaleRule(min_workers=0, max_workers=1)
    autoscale = dataclasses.replace(config.autoscale, models={"z": rule})
    assert "autoscale settings changed" in apply_config(
        gw.app, dataclasses.replace(config, autoscale=autoscale)
    )
    e = await status_of(c, "z")
    assert e.status_code == 503 and e.body["code"] == "queue_timeout"
    apply_config(gw.app, config)  # and back: unknown again
    assert (await status_of(c, "z")).status_code == 404

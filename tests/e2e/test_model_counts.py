"""Per-model figures count a request under the model it asked for, not under every model
its worker serves: /stats, the autoscaler's demand and desired count, and /metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_until
from vllm_gateway.app import AUTOSCALER
from vllm_gateway.config.gateway import AutoscaleConfig, ScaleRule

pytestmark = pytest.mark.timeout(30)

HELD = 5


async def test_a_shared_workers_requests_count_under_their_own_model(
    fake_worker, gateway, client, http
):
    # One worker serves a base model and a LoRA adapter; a second serves the base only.
    shared = await fake_worker(models="demo-llama", lora_adapters=("demo-lora",), tpot_ms=50)
    gw = await gateway(
        [shared],
        autoscale=AutoscaleConfig(
            interval=0.1,
            target_per_worker=2,
            scale_up_window=0,
            models={"demo-lora": ScaleRule(min_workers=0, max_workers=4)},
        ),
    )
    c = client(gw)
    started = asyncio.Event()
    count = 0

    async def hold() -> None:
        nonlocal count
        stream = await c.chat.completions.create(
            model="demo-llama",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=200,
            stream=True,
        )
        async for _ in stream:
            count += 1
            if count >= HELD:
                started.set()
            await asyncio.sleep(10)  # hold the stream open; cancelled below

    holders = [asyncio.create_task(hold()) for _ in range(HELD)]
    try:
        await asyncio.wait_for(started.wait(), 10)
        signals = gw.app[AUTOSCALER].signals
        await wait_until(
            lambda: "demo-llama" in signals and signals["demo-llama"].inflight == HELD, 5
        )
        await asyncio.sleep(0.3)  # a few more evaluations, with the streams still held
        llama, lora = signals["demo-llama"], signals["demo-lora"]
        assert (llama.inflight, lora.inflight) == (HELD, 0)
        assert llama.demand >= HELD and lora.demand == 0
        assert lora.desired == 0 and llama.desired >= 3  # 5 requests at 2 per worker

        async with http.get(gw.url + "/stats") as r:
            models = {m["model"]: m for m in (await r.json())["models"]}
        assert models["demo-llama"]["inflight"] == HELD
        assert models["demo-lora"]["inflight"] == 0 and models["demo-lora"]["demand"] == 0

        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
        demand = {
            s.labels["model"]: s.value
            for f in text_string_to_metric_families(text)
            if f.name == "vllm_gateway_model_demand"
            for s in f.samples
        }
        assert demand["demo-lora"] == 0 and demand["demo-llama"] >= HELD
    finally:
        for h in holders:
            h.cancel()
        await asyncio.gather(*holders, return_exceptions=True)

"""Replicas decide alike: two gateways started apart, in front of the same workers, with a
conversation's turns alternating between them (as an L4 balancer sends them), place every
turn of it on the same worker, without sharing anything but the requests and the workers.
"""

from __future__ import annotations

import pytest

from vllm_gateway.config.gateway import ScrapeConfig

pytestmark = pytest.mark.timeout(60)

FAST_SCRAPES = ScrapeConfig(interval=0.05, timeout=0.5, stale_after=1.0)
# Long enough to be a shared preamble of whole blocks (prefix_hash.BLOCK_BYTES).
SYSTEM = "You are a helpful assistant for a travel agency; answer briefly. " * 40


async def test_two_gateways_place_each_conversation_on_one_worker(fake_worker, gateway, client):
    ws = [await fake_worker(models="m", ttft_ms=1, tpot_ms=1) for _ in range(4)]
    gateways = [await gateway(ws, scrape=FAST_SCRAPES) for _ in range(2)]
    clients = [client(gw) for gw in gateways]
    conversations = 12
    history: list[list[dict]] = [
        [{"role": "system", "content": SYSTEM}] for _ in range(conversations)
    ]
    for turn in range(4):
        for c in range(conversations):
            history[c].append({"role": "user", "content": f"conversation {c} question {turn}"})
            # Turns alternate between the two gateways, and so do conversations.
            answer = await clients[(c + turn) % 2].chat.completions.create(
                model="m", messages=history[c], max_tokens=4
            )
            history[c].append({"role": "assistant", "content": answer.choices[0].message.content})
    placed: dict[int, set[int]] = {c: set() for c in range(conversations)}
    for i, w in enumerate(ws):
        for record in w.stats.requests:
            if record.path != "/v1/chat/completions":
                continue
            for c in range(conversations):
                if f"conversation {c} question".encode() in record.body:
                    placed[c].add(i)
    assert all(len(where) == 1 for where in placed.values()), placed
    # ...and the conversations spread: a shared system prompt does not draw them together.
    assert len({i for where in placed.values() for i in where}) >= 3, placed


async def test_a_gateway_sees_another_replicas_requests_on_the_workers(
    fake_worker, gateway, client
):
    """Behind replicas nothing is weighed by cache pressure (docs/dispatch.md): each
    gateway must see the other's requests on the workers' pages (`Worker.others`), at
    light load too, and mark them shared; a gateway alone marks none."""
    import asyncio
    import math

    from vllm_gateway.app import REGISTRY

    ws = [await fake_worker(models="m", ttft_ms=5, tpot_ms=40) for _ in range(2)]
    a, b = [await gateway(ws, scrape=FAST_SCRAPES) for _ in range(2)]
    b_client = client(b)

    async def one(i: int) -> None:
        await b_client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=10
        )

    for i in range(16):  # two at a time through b only, 0.4 s each: light load
        await asyncio.gather(one(2 * i), one(2 * i + 1))
    seen_by_a = [w.others_at for w in a.app[REGISTRY]]
    seen_by_b = [w.others_at for w in b.app[REGISTRY]]
    assert all(math.isfinite(t) for t in seen_by_a), seen_by_a  # b's requests, seen by a
    assert not any(math.isfinite(t) for t in seen_by_b), seen_by_b  # its own: not others

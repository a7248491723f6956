"""End to end over real sockets: the openai SDK -> gateway -> fake vLLM workers."""

from __future__ import annotations

import asyncio
import itertools
import time

import openai
import orjson
import pytest

from tests.conftest import STEADY_PROBES, wait_until
from vllm_gateway.app import REGISTRY
from vllm_gateway.config.gateway import WorkerSpec

pytestmark = pytest.mark.timeout(30)


def served(worker, path: str = "/v1/completions") -> int:
    """Requests for `path` the worker answered in full."""
    return sum(1 for r in worker.stats.requests if r.path == path and r.outcome == "completed")


async def test_chat_and_completions_streaming_and_not(fake_worker, gateway, client):
    w = await fake_worker(models="m", tpot_ms=1, ttft_ms=1)
    gw = await gateway([w])
    c = client(gw)

    chat = await c.chat.completions.create(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.choices[0].message.content == "".join(f" w{i}" for i in range(5))
    assert chat.usage.completion_tokens == 5

    comp = await c.completions.create(model="m", prompt="say", max_tokens=4)
    assert comp.choices[0].text == " w0 w1 w2 w3"

    stream = await c.chat.completions.create(
        model="m",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}],
    )
    parts, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == "".join(f" w{i}" for i in range(6))
    assert usage is not None and usage.completion_tokens == 6

    stream = await c.completions.create(model="m", prompt="x", max_tokens=3, stream=True)
    texts = [chunk.choices[0].text async for chunk in stream]
    assert "".join(texts) == " w0 w1 w2"


async def test_stream_chunks_arrive_at_the_workers_pace(fake_worker, gateway, client):
    # 100 ms apart: a chunk read a few tens of ms late (a loaded machine) leaves a gap
    # well above the floor; only relaying chunks together would go below it.
    w = await fake_worker(models="m", tpot_ms=100, ttft_ms=1)
    gw = await gateway([w])
    stream = await client(gw).completions.create(model="m", prompt="x", max_tokens=8, stream=True)
    arrivals = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.monotonic())
    assert len(arrivals) == 8
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    # Paced, not buffered: every gap near 100 ms, none collapsed to zero.
    assert min(gaps) > 0.05, gaps
    assert arrivals[-1] - arrivals[0] > 0.6


async def test_routes_by_model_across_workers(fake_worker, gateway, client):
    a = await fake_worker(models="alpha")
    b = await fake_worker(models=("beta", "gamma"))
    gw = await gateway([a, b])
    c = client(gw)
    for model in ("alpha", "beta", "gamma", "alpha"):
        await c.completions.create(model=model, prompt="x", max_tokens=1)
    assert (served(a), served(b)) == (2, 2)


async def test_unknown_model_is_404_naming_the_models(fake_worker, gateway, client):
    gw = await gateway([await fake_worker(models="m")])
    with pytest.raises(openai.NotFoundError) as info:
        await client(gw).completions.create(model="nope", prompt="x")
    err = info.value.body
    assert err["code"] == "model_not_found" and "`m`" not in err["message"]
    assert "Available models: m" in err["message"]


async def test_bad_requests_get_openai_error_bodies(fake_worker, gateway, http):
    gw = await gateway([await fake_worker(models="m")], max_body_bytes=2048)
    url = gw.url + "/v1/chat/completions"
    cases = [
        (b"{not json", 400, "invalid_request_error"),
        (b'{"messages": []}', 400, "invalid_request_error"),
        (orjson.dumps({"model": "m", "prompt": "x" * 4096}), 413, "invalid_request_error"),
    ]
    for body, status, type_ in cases:
        async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == status
            doc = await r.json()
            assert doc["error"]["type"] == type_ and doc["error"]["message"]

    # A chunked body over the limit (no Content-Length) is refused the same way.
    async def chunks():
        yield b'{"model": "m", "prompt": "'
        for _ in range(10):
            yield b"y" * 1024
        yield b'"}'

    async with http.post(url, data=chunks()) as r:
        assert r.status == 413
        assert (await r.json())["error"]["code"] == "request_too_large"
    # Unknown routes and methods also answer in the OpenAI shape.
    async with http.get(gw.url + "/nothing/here") as r:
        assert r.status == 404 and "error" in await r.json()
    async with http.get(gw.url + "/v1/chat/completions") as r:
        assert r.status == 405 and "error" in await r.json()


async def test_no_ready_worker_is_503_with_retry_after(gateway, http):
    # A worker pinned to a model that never answers its probes: known model, no ready worker.
    gw = await gateway(workers=())
    gw.app[REGISTRY].add("http://127.0.0.1:9", models=("m",))
    async with http.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
        assert r.status == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert (await r.json())["error"]["code"] == "no_worker_available"


async def test_unreachable_worker_is_retried_on_another(fake_worker, gateway, client):
    a = await fake_worker(models="m")
    b = await fake_worker(models="m")
    gw = await gateway([a, b], policy="round_robin")
    await a.pause()  # connections refused from now on, but the gateway still thinks it ready
    c = client(gw)
    for _ in range(6):
        r = await c.completions.create(model="m", prompt="x", max_tokens=2)
        assert r.choices[0].text == " w0 w1"
    assert served(b) == 6


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_worker(fake_worker, gateway, http, stream):
    w = await fake_worker(models="m", tpot_ms=20, ttft_ms=1)
    gw = await gateway([w])
    body = {"model": "m", "prompt": "x", "max_tokens": 1000, "stream": stream}
    task = asyncio.create_task(http.post(gw.url + "/v1/completions", json=body))
    if stream:
        response = await task
        await response.content.readany()  # the stream has started
        response.close()  # the client goes away mid-stream
    else:
        await wait_until(lambda: w.stats.running == 1, timeout=5)
        task.cancel()
    t0 = time.monotonic()
    await wait_until(lambda: w.stats.aborted == 1, timeout=3)
    assert time.monotonic() - t0 < 1.0
    assert w.stats.running == 0
    registry = gw.app[REGISTRY]
    await wait_until(lambda: all(x.inflight == 0 for x in registry), timeout=2)


async def test_request_body_headers_and_request_id(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([w])
    body = b'{"model":"m",  "prompt": "x", "max_tokens": 1, "extra": [1,2,3]}'
    headers = {
        "Content-Type": "application/json",
        "X-Request-Id": "abc-123",
        "Authorization": "Bearer client-secret",
        "X-Custom": "kept",
        "Connection": "keep-alive, X-Custom",
    }
    async with http.post(gw.url + "/v1/completions", data=body, headers=headers) as r:
        assert r.status == 200
        assert r.headers["X-Request-Id"] == "abc-123"
        await r.read()
    seen = w.stats.requests[-1]
    assert seen.body == body  # forwarded as the same bytes
    lower = {k.lower(): v for k, v in seen.headers.items()}
    assert lower["x-request-id"] == "abc-123"
    assert lower["x-custom"] == "kept"
    assert "authorization" not in lower  # the client's credential stays at the gateway
    async with http.post(gw.url + "/v1/completions", json={"model": "m", "max_tokens": 1}) as r:
        made = r.headers["X-Request-Id"]
        await r.read()
    assert (
        made
        and {k.lower(): v for k, v in w.stats.requests[-1].headers.items()}["x-request-id"] == made
    )


async def test_embeddings_and_other_model_endpoints(fake_worker, gateway, http, client):
    w = await fake_worker(models="m")
    gw = await gateway([w])
    e = await client(gw).embeddings.create(model="m", input=["a", "b"])
    assert len(e.data) == 2 and len(e.data[0].embedding) > 0
    async with http.post(gw.url + "/tokenize", json={"model": "m", "prompt": "a b"}) as r:
        assert r.status == 200
    assert any(r.path == "/tokenize" for r in w.stats.requests)


async def test_worker_error_answers_are_relayed_as_is(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([w])
    async with http.post(
        gw.url + "/v1/completions",
        json={"model": "m", "prompt": "x"},
        headers={"X-Fake-Fault": "status=500"},
    ) as r:
        assert r.status == 500
        assert "error" in await r.json()


async def test_fleet_endpoints(fake_worker, gateway, http):
    a = await fake_worker(models="alpha")
    b = await fake_worker(models="beta", lora_adapters=("beta-lora",))
    gw = await gateway([a, b])
    async with http.get(gw.url + "/v1/models") as r:
        doc = await r.json()
    assert doc["object"] == "list"
    assert sorted(m["id"] for m in doc["data"]) == ["alpha", "beta", "beta-lora"]
    for path in ("/list_models",):
        async with http.get(gw.url + path) as r:
            assert (await r.json()) == {"models": ["alpha", "beta", "beta-lora"]}
        async with http.post(gw.url + path) as r:
            assert (await r.json()) == {"models": ["alpha", "beta", "beta-lora"]}
    async with http.get(gw.url + "/health") as r:
        assert r.status == 200
        doc = await r.json()
        assert doc["workers"]["ready"] == 2
    async with http.get(gw.url + "/list_workers") as r:
        workers = (await r.json())["workers"]
    by_url = {w["url"]: w for w in workers}
    assert by_url[a.url]["models"] == ["alpha"] and by_url[a.url]["state"] == "ready"
    assert by_url[b.url]["models"] == ["beta", "beta-lora"]
    assert by_url[a.url]["inflight"] == 0
    assert {"running", "waiting"} <= set(by_url[a.url])
    # All workers gone: /health says 503 and the models disappear.
    await a.pause()
    await b.pause()
    await wait_until(lambda: not gw.app[REGISTRY].ready_models(), timeout=5)
    async with http.get(gw.url + "/health") as r:
        assert r.status == 503
    async with http.get(gw.url + "/v1/models") as r:
        assert (await r.json())["data"] == []


@pytest.mark.timeout(60)
async def test_200_concurrent_streams_every_chunk_intact(fake_worker, gateway, client):
    workers = [
        await fake_worker(models="m", tpot_ms=20, ttft_ms=5, max_num_seqs=256) for _ in range(2)
    ]
    # Their batch size declared, so the capacity gate holds nothing back (learning it
    # starts at 8 per worker and doubles per scrape while requests wait).
    specs = [WorkerSpec(url=w.url, max_num_seqs=256) for w in workers]
    gw = await gateway(specs, probe=STEADY_PROBES)  # a slow probe under load is no failure
    c = client(gw, timeout=30)
    n_tokens = 20

    async def one(i: int) -> str:
        stream = await c.completions.create(
            model="m", prompt=f"p{i}", max_tokens=n_tokens, stream=True
        )
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    results = await asyncio.gather(*(one(i) for i in range(200)))
    expected = "".join(f" w{i}" for i in range(n_tokens))
    assert all(r == expected for r in results)
    assert sum(served(w) for w in workers) == 200
    # All 200 ran at once: no connection cap queued streams behind others (aiohttp's
    # default connector limit of 100 would hold the sum of these at 100).
    assert sum(w.stats.max_running_seen for w in workers) >= 190

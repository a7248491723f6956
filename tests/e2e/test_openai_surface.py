"""The OpenAI surface clients expect beyond the relay: the model object, 404 and 405 as
HTTP says them, CORS for browser pages, through the official `openai` SDK where a client
would see it."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import wait_until
from tests.support.scripted_worker import ScriptedWorker
from vllm_gateway.app import REGISTRY
from vllm_gateway.config.gateway import ApiKeyConfig, AuthConfig, ClientConfig, CorsConfig
from vllm_gateway.http.keys import hash_key
from vllm_gateway.workers import WorkerState

pytestmark = pytest.mark.timeout(30)

SLASHED = "meta-llama/Llama-3-8B"


async def ready_gateway(fake_worker, gateway, models=("demo-llama", SLASHED)):
    w = await fake_worker(models=models)
    gw = await gateway([w])
    await wait_until(lambda: bool(gw.app[REGISTRY].ready_models()))
    return gw


async def test_models_retrieve_answers_the_model_object(fake_worker, gateway, client):
    gw = await ready_gateway(fake_worker, gateway)
    sdk = client(gw)
    listed = {m.id: m for m in (await sdk.models.list()).data}
    for name in ("demo-llama", SLASHED):
        model = await sdk.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == (name, "model", "vllm-gateway")
        assert model.created == listed[name].created > 0
    with pytest.raises(openai.NotFoundError) as caught:
        await sdk.models.retrieve("no-such-model")
    assert caught.value.status_code == 404
    assert caught.value.code == "model_not_found"
    assert caught.value.body["param"] == "model"  # type: ignore[index]
    assert "no-such-model" in caught.value.body["message"]  # type: ignore[index]


async def test_models_retrieve_finds_a_known_model_whose_worker_is_out(
    fake_worker, gateway, client
):
    """A model whose only worker is down is still known (completions answer 503, not 404),
    so retrieve finds it too, while the list holds only ready models."""
    w = await fake_worker(models=("demo-llama",))
    gw = await gateway([w])
    registry = gw.app[REGISTRY]
    await wait_until(lambda: registry.ready_models() == ["demo-llama"])
    await w.stop()
    registry.set_state(registry.get(w.url), WorkerState.UNHEALTHY, "test: worker stopped")
    sdk = client(gw)
    assert [m.id for m in (await sdk.models.list()).data] == []
    assert (await sdk.models.retrieve("demo-llama")).id == "demo-llama"
    with pytest.raises(openai.NotFoundError):
        await sdk.models.retrieve("demo-mistral")


async def test_unknown_paths_are_404_and_a_wrong_method_405_with_allow(gateway, http):
    gw = await gateway([])
    for method, path in (
        ("POST", "/worker_get_status"),
        ("GET", "/no/such/path"),
        ("PUT", "/nothing"),
    ):
        async with http.request(method, gw.url + path) as r:
            assert r.status == 404, (method, path)
            assert "Allow" not in r.headers
            assert (await r.json())["error"]["code"] == "unknown_url"
    for method, path, allowed in (
        ("DELETE", "/v1/models", "GET"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("POST", "/health", "GET"),
    ):
        async with http.request(method, gw.url + path) as r:
            assert r.status == 405, (method, path)
            assert allowed in r.headers["Allow"].split(",")
            error = (await r.json())["error"]
        assert error["code"] == "unknown_url" and r.headers["Allow"] in error["message"]


# --- CORS ---------------------------------------------------------------------------------

PAGE = "https://chat.page.example"


async def test_a_browser_preflight_is_answered_by_the_gateway_even_with_client_keys(
    fake_worker, gateway, http
):
    w = await fake_worker(models="m")
    gw = await gateway([w], auth=AuthConfig(keys={"a": ApiKeyConfig(sha256=hash_key("k1"))}))
    # What Chromium sends before a fetch() with a JSON body and an Authorization header.
    preflight = {
        "Origin": PAGE,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    for path in ("/v1/chat/completions", "/v1/models", "/anything/at/all"):
        async with http.options(gw.url + path, headers=preflight) as r:
            assert r.status == 204, (path, await r.text())
            assert r.headers["Access-Control-Allow-Origin"] == "*"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert r.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    # Answered by the gateway, not relayed (the worker saw only probes).
    assert all(r.method == "GET" for r in w.stats.requests)


@pytest.mark.parametrize("front_path", [True, False], ids=["front-path", "aiohttp-path"])
async def test_answers_carry_cors_headers_relayed_streamed_and_errors(
    fake_worker, gateway, client, front_path
):
    w = await fake_worker(models="m")
    gw = await gateway([w], client=ClientConfig(front_path=front_path))
    await wait_until(lambda: bool(gw.app[REGISTRY].ready_models()))
    sdk = client(gw, default_headers={"Origin": PAGE})
    relayed = await sdk.completions.with_raw_response.create(model="m", prompt="x", max_tokens=2)
    assert relayed.headers["access-control-allow-origin"] == "*"
    assert relayed.parse().choices[0].text == " w0 w1"
    async with sdk.chat.completions.with_streaming_response.create(
        model="m", stream=True, messages=[{"role": "user", "content": "hi"}]
    ) as streamed:
        assert streamed.headers["access-control-allow-origin"] == "*"
        assert [c async for c in await streamed.parse()]
    listed = await sdk.models.with_raw_response.list()
    assert listed.headers["access-control-allow-origin"] == "*"
    with pytest.raises(openai.NotFoundError) as caught:
        await sdk.completions.create(model="nope", prompt="x")
    assert caught.value.response.headers["access-control-allow-origin"] == "*"
    # The worker never sees the Origin: the gateway answers CORS, once.
    assert all("origin" not in r.headers for r in w.stats.requests)
    plain = await client(gw).completions.with_raw_response.create(model="m", prompt="x")
    assert "access-control-allow-origin" not in plain.headers  # no Origin, no CORS


async def test_named_origins_are_echoed_and_others_refused(fake_worker, gateway, client, http):
    w = await fake_worker(models="m")
    gw = await gateway([w], cors=CorsConfig(allowed_origins=(PAGE,), allow_credentials=True))
    await wait_until(lambda: bool(gw.app[REGISTRY].ready_models()))
    ok = await client(gw, default_headers={"Origin": PAGE}).completions.with_raw_response.create(
        model="m", prompt="x"
    )
    assert ok.headers["access-control-allow-origin"] == PAGE
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert "Origin" in ok.headers.get_list("vary")
    other = client(gw, default_headers={"Origin": "https://evil.example"})
    answer = await other.completions.with_raw_response.create(model="m", prompt="x")
    assert "access-control-allow-origin" not in answer.headers
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    async with http.options(gw.url + "/v1/completions", headers=preflight) as r:
        assert r.status == 400
        assert "origin 'https://evil.example'" in (await r.json())["error"]["message"]


@pytest.mark.parametrize("front_path", [True, False])
async def test_a_workers_own_cors_headers_never_reach_the_client(gateway, client, front_path):
    """The gateway answers CORS by its [cors] rules alone: a worker that adds its own
    Access-Control-* headers (any origin, say) neither widens them nor doubles them."""

    async def script(t, body):
        t.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"access-control-allow-origin: *\r\naccess-control-allow-credentials: true\r\n"
            b"access-control-expose-headers: x-secret\r\ncontent-length: 2\r\n\r\n{}"
        )

    worker = await ScriptedWorker(script).start()
    try:
        gw = await gateway(
            [worker.url],
            cors=CorsConfig(allowed_origins=(PAGE,)),
            client=ClientConfig(front_path=front_path),
        )
        await wait_until(lambda: bool(gw.app[REGISTRY].ready_models()))
        evil = client(gw, default_headers={"Origin": "https://evil.example"})
        answer = await evil.completions.with_raw_response.create(model="m", prompt="x")
        assert answer.http_response.status_code == 200
        assert not [n for n in answer.headers if n.lower().startswith("access-control-")]
        page = client(gw, default_headers={"Origin": PAGE})
        answer = await page.completions.with_raw_response.create(model="m", prompt="x")
        assert answer.headers.get_list("access-control-allow-origin") == [PAGE]
        assert "access-control-expose-headers" not in answer.headers
    finally:
        await worker.stop()

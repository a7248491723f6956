"""The OpenAI surface clients expect beyond the relay: the model object, 404 and 405 as
HTTP says them, through the official `openai` SDK where a client would see it."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import wait_until
from vllm_gateway.app import REGISTRY

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

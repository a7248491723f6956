"""Worker URLs as people type them: a copied OpenAI base URL (`.../v1`) is respelled with a
warning and serves; a URL without a scheme or with another path is refused with what is
wrong, wherever it enters (config, registration, admin API)."""

from __future__ import annotations

import pytest

from tests.conftest import wait_until
from vllm_gateway.app import REGISTRY
from vllm_gateway.config.gateway import AdminConfig
from vllm_gateway.workers import WorkerState

pytestmark = pytest.mark.timeout(30)

TOKEN = "admin-secret-51ad"


async def test_a_config_worker_ending_in_v1_serves_through_the_sdk(
    fake_worker, gateway, client, logs
):
    w = await fake_worker(models="m")
    gw = await gateway([w.url + "/v1/"])
    registry = gw.app[REGISTRY]
    assert [x.url for x in registry] == [w.url]
    await wait_until(lambda: registry.get(w.url).state is WorkerState.READY)
    answer = await client(gw).completions.create(model="m", prompt="x", max_tokens=2)
    assert answer.choices[0].text == " w0 w1"
    [note] = logs.records("worker URL normalized")
    assert note["level"] == "warning" and "trailing /v1 was dropped" in note["problem"]


async def test_registration_and_admin_respell_v1_and_refuse_what_cannot_work(
    fake_worker, gateway, http, logs
):
    w1 = await fake_worker(models="m")
    w2 = await fake_worker(models="m")
    gw = await gateway([], admin=AdminConfig(token=TOKEN))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with http.post(
        gw.url + "/register_worker", json={"worker_name": w1.url + "/v1", "check_heart_beat": False}
    ) as r:
        assert r.status == 200, await r.text()
    async with http.post(
        gw.url + "/admin/workers/add", json={"url": w2.url + "/v1"}, headers=auth
    ) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["worker"]["url"] == w2.url
    assert sorted(x.url for x in gw.app[REGISTRY]) == sorted([w1.url, w2.url])
    assert len(logs.records("worker URL normalized")) == 2

    host_port = w1.url.removeprefix("http://")
    for path, body, headers in (
        ("/register_worker", {"worker_name": host_port}, {}),
        ("/admin/workers/add", {"url": host_port}, auth),
        ("/admin/workers/add", {"url": w1.url + "/prefix"}, auth),
    ):
        async with http.post(gw.url + path, json=body, headers=headers) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["type"] == "invalid_request_error"
        assert "add http://" in error["message"] or "has a path (/prefix)" in error["message"]
    assert len(gw.app[REGISTRY]) == 2

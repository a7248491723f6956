"""The admin API over real sockets: its token, worker operations, aliases and splits."""

from __future__ import annotations

import asyncio
from collections import Counter

import openai
import orjson
import pytest

from tests.conftest import STEADY_PROBES, wait_until
from vllm_gateway.app import DISPATCHER, REGISTRY
from vllm_gateway.cli.admin_client import AdminClient, AdminError
from vllm_gateway.config.gateway import AdminConfig, WorkerSpec
from vllm_gateway.workers import WorkerState

pytestmark = pytest.mark.timeout(30)

TOKEN = "admin-secret-7f3a"
ADMIN = AdminConfig(token=TOKEN)


def models_asked(worker) -> Counter:
    """The `model` of each completion request the worker received."""
    return Counter(
        orjson.loads(r.body)["model"] for r in worker.stats.requests if r.path == "/v1/completions"
    )


async def test_admin_api_without_a_configured_token_is_refused(gateway, http, logs):
    gw = await gateway([])
    for headers in ({}, {"Authorization": "Bearer anything"}):
        async with http.get(gw.url + "/admin/workers", headers=headers) as r:
            assert r.status == 403
            body = await r.json()
    assert body["error"]["type"] == "permission_error"
    assert "admin.token" in body["error"]["message"]
    refused = logs.records("control request refused")
    assert len(refused) == 2 and refused[0]["path"] == "/admin/workers"
    assert "anything" not in logs.getvalue()


@pytest.mark.parametrize("header", [None, "Bearer wrong-token", "Basic " + TOKEN, TOKEN])
async def test_admin_api_needs_the_right_bearer_token(gateway, http, logs, header):
    gw = await gateway([], admin=ADMIN)
    headers = {"Authorization": header} if header else {}
    async with http.post(gw.url + "/admin/workers/add", headers=headers, json={}) as r:
        assert r.status == 401
        body = await r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "authentication_error"
    [record] = logs.records("control request refused")
    assert record["api"] == "admin API" and record["peer"] == "127.0.0.1"
    assert TOKEN not in logs.getvalue() and "wrong-token" not in logs.getvalue()


async def test_add_weight_remove_a_worker(fake_worker, gateway, client):
    w = await fake_worker(models="m")
    gw = await gateway([], admin=ADMIN)
    async with AdminClient(gw.url, TOKEN) as admin:
        answer = await admin.add(w.url + "/")  # normalized: no trailing slash
        assert answer["added"] is True
        assert answer["worker"]["state"] == "ready"  # probed at once
        assert answer["worker"]["source"] == "admin" and answer["worker"]["url"] == w.url
        assert (await admin.add(w.url))["added"] is False  # idempotent
        await client(gw).completions.create(model="m", prompt="x", max_tokens=1)

        assert (await admin.set_weight(w.url, 3))["worker"]["weight"] == 3.0
        [listed] = await admin.workers()
        assert listed["circuit"] == "closed" and listed["completed"] == 1

        assert (await admin.remove(w.url, drain=True, timeout=5))["idle"] is True
        assert await admin.workers() == []
        with pytest.raises(AdminError) as e:
            await admin.remove(w.url)
        assert e.value.status == 404
        with pytest.raises(AdminError) as e:
            await admin.add("ftp://nowhere")
        assert e.value.status == 400 and "http://" in e.value.message


async def test_weighted_split_rewrites_the_model_and_skips_unavailable_targets(
    fake_worker, gateway, client
):
    v1 = await fake_worker(models="llama-v1", tpot_ms=1, ttft_ms=1)
    v2 = await fake_worker(models="llama-v2", tpot_ms=1, ttft_ms=1)
    # 200 requests at once: one slow probe on a busy machine must not take a worker out.
    gw = await gateway(
        [v1, v2], admin=ADMIN, aliases={"llama": {"llama-v1": 1}}, probe=STEADY_PROBES
    )
    c = client(gw)
    ids = [m.id for m in (await c.models.list()).data]
    assert ids == ["llama", "llama-v1", "llama-v2"]

    async with AdminClient(gw.url, TOKEN) as admin:
        await admin.set_alias("llama", {"llama-v1": 3, "llama-v2": 1})
        assert (await admin.aliases())["llama"] == {
            "targets": {"llama-v1": 0.75, "llama-v2": 0.25},
            "source": "admin",
        }
        answers = await asyncio.gather(
            *(c.completions.create(model="llama", prompt="x", max_tokens=1) for _ in range(200))
        )
        # Each worker saw only its own model name: the body was rewritten.
        assert set(models_asked(v1)) == {"llama-v1"} and set(models_asked(v2)) == {"llama-v2"}
        share = models_asked(v2)["llama-v2"] / 200
        assert 0.12 < share < 0.40, share  # 25 % expected
        assert {a.model for a in answers} == {"llama-v1", "llama-v2"}

        # One session stays on one version.
        for user in ("alice", "bob", "carol"):
            got = {
                (
                    await c.completions.create(model="llama", prompt="x", max_tokens=1, user=user)
                ).model
                for _ in range(8)
            }
            assert len(got) == 1, (user, got)

        # A target with no available worker is skipped while another can serve.
        await admin.drain(v1.url)
        answers = await asyncio.gather(
            *(c.completions.create(model="llama", prompt="x", max_tokens=1) for _ in range(20))
        )
        assert {a.model for a in answers} == {"llama-v2"}

        # Removing the admin alias lets the config's alias show through again.
        await admin.undrain(v1.url)
        await admin.remove_alias("llama")
        answer = await c.completions.create(model="llama", prompt="x", max_tokens=1)
        assert answer.model == "llama-v1"
        with pytest.raises(AdminError) as e:
            await admin.set_alias("bad", {"llama-v1": 0})
        assert e.value.status == 400


async def test_unknown_alias_target_is_a_404_naming_models(fake_worker, gateway, client):
    w = await fake_worker(models="m")
    gw = await gateway([w], aliases={"x": {"missing": 1}})
    with pytest.raises(openai.NotFoundError):
        await client(gw).completions.create(model="x", prompt="x", max_tokens=1)
    assert gw.app[REGISTRY].get(w.url).completed == 0


def test_check_config_masks_the_control_tokens():
    from vllm_gateway.config.load import effective_toml, load_config

    env = {
        "VLLM_GATEWAY_ADMIN_TOKEN": "adm-s3cr3t",
        "VLLM_GATEWAY_REGISTRATION_TOKEN": "reg-s3cr3t",
    }
    text = effective_toml(load_config(None, env=env))
    assert "s3cr3t" not in text and text.count('token = "***"') == 2


async def test_an_undrain_during_a_draining_remove_keeps_the_worker(fake_worker, gateway, http):
    """remove (drain, wait) then undrain while a stream is in flight: the later word wins,
    so when the stream ends the worker stays (the remove's wait must not remove it)."""
    w = await fake_worker(models="m")
    gw = await gateway([], admin=ADMIN, probe=STEADY_PROBES)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with AdminClient(gw.url, TOKEN) as admin:
        await admin.add(w.url)
        body = {"model": "m", "prompt": "x", "max_tokens": 60, "stream": True}  # ~0.6 s
        async with http.post(gw.url + "/v1/completions", json=body) as stream:
            assert stream.status == 200
            await stream.content.readline()
            removing = asyncio.create_task(
                http.post(
                    gw.url + "/admin/workers/remove",
                    json={"url": w.url, "drain": True, "timeout": 10},
                    headers=auth,
                )
            )
            # The remove's request reaches the gateway when the loop gets to it (a busy
            # machine: more than a fixed 0.1 s), within the stream's ~0.6 s.
            for _ in range(50):
                if gw.app[REGISTRY].get(w.url).state.value == "draining":
                    break
                await asyncio.sleep(0.01)
            assert gw.app[REGISTRY].get(w.url).state.value == "draining"
            assert (await admin.undrain(w.url))["changed"] is True
            assert (await stream.read()).rstrip().endswith(b"data: [DONE]")
        async with await asyncio.wait_for(removing, 5) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["removed"] is False
        worker = gw.app[REGISTRY].get(w.url)
        assert worker is not None and worker.state.value == "ready"
        # Without the undrain, the same remove waits for the stream, then says it removed.
        async with http.post(gw.url + "/v1/completions", json=body) as stream:
            await stream.content.readline()
            removing = asyncio.create_task(admin.remove(w.url, drain=True, timeout=10))
            await stream.read()
        answer = await asyncio.wait_for(removing, 5)
        assert answer["removed"] is True and answer["idle"] is True
        assert gw.app[REGISTRY].get(w.url) is None


async def test_a_split_request_waiting_for_a_drained_version_is_split_again(
    fake_worker, gateway, client
):
    """A request the split sent to v1 waits (v1 is full); v1's last worker drains, as in a
    rollout: the request is split again to v2, where workers are, instead of a 503."""
    v1 = await fake_worker(models="llama-v1", tpot_ms=40, ttft_ms=1)
    v2 = await fake_worker(models="llama-v2", tpot_ms=1, ttft_ms=1)
    gw = await gateway(
        [WorkerSpec(url=v1.url, max_num_seqs=1), v2],
        admin=ADMIN,
        aliases={"llama": {"llama-v1": 1}},
        probe=STEADY_PROBES,
    )
    c = client(gw)
    registry = gw.app[REGISTRY]
    await wait_until(lambda: registry.get(v1.url).available and registry.get(v2.url).available)
    async with AdminClient(gw.url, TOKEN) as admin:
        first = asyncio.create_task(
            c.completions.create(model="llama", prompt="x", max_tokens=30)  # v1's one slot
        )
        await wait_until(lambda: registry.get(v1.url).inflight == 1)
        waiting = asyncio.create_task(c.completions.create(model="llama", prompt="x", max_tokens=1))
        await wait_until(lambda: gw.app[DISPATCHER].admission.waiting_for("llama-v1") >= 1)
        await admin.set_alias("llama", {"llama-v1": 1, "llama-v2": 1})
        await admin.drain(v1.url)
        answer = await asyncio.wait_for(waiting, 10)
        assert answer.model == "llama-v2"
        assert models_asked(v2) == Counter({"llama-v2": 1})
        assert (await asyncio.wait_for(first, 10)).model == "llama-v1"  # finished where it ran


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/admin/workers/weight", {"weight": 1e308}, "weight"),
        ("/admin/workers/weight", {"weight": 2e6}, "weight"),
        ("/admin/workers/weight", {"weight": None}, "weight"),
        ("/admin/workers/add", {"weight": 1e308}, "weight"),
        ("/admin/workers/add", {"weight": None}, "weight"),
        ("/admin/workers/drain", {"timeout": 1e19}, "timeout"),
        ("/admin/workers/drain", {"timeout": None}, "timeout"),
        ("/admin/workers/remove", {"drain": True, "timeout": 1e19}, "timeout"),
    ],
)
async def test_a_weight_or_timeout_out_of_bounds_or_null_is_refused(
    fake_worker, gateway, http, path, body, param
):
    """Out of bounds (a weight past 1e6, a timeout past 1e7 s) or null (what orjson writes
    for a client's inf or NaN): 400 naming the field, and the worker as it was."""
    w = await fake_worker(models="m")
    gw = await gateway([WorkerSpec(w.url)], admin=ADMIN)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    url = w.url if path != "/admin/workers/add" else "http://127.0.0.1:9"
    async with http.post(gw.url + path, headers=headers, json={"url": url, **body}) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    [worker] = gw.app[REGISTRY]  # (not removed)
    assert worker.weight == 1.0 and worker.state is not WorkerState.DRAINING

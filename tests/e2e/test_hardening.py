"""A bad reload, LoRA updates from clients, and what error messages tell a client."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest

from tests.conftest import wait_until
from vllm_gateway.app import GATEWAY
from vllm_gateway.config.gateway import (
    AdminConfig,
    ApiKeyConfig,
    AuthConfig,
    GatewayConfig,
    TimeoutConfig,
)
from vllm_gateway.config.load import load_config
from vllm_gateway.process.daemon import Daemon
from vllm_gateway.process.sd_notify import Notifier

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "text",
    [
        "",  # emptied
        "# vllm-gateway config\n",  # truncated after the first line
        "[log]\nformat = 'json'\n",
    ],
)
async def test_an_empty_or_truncated_file_on_reload_is_refused(
    text, fake_worker, gateway, tmp_path, http, logs
):
    w = await fake_worker(models="m")
    auth = AuthConfig(keys={"k": ApiKeyConfig(sha256="0" * 64)})
    gw = await gateway([w], auth=auth, admin=AdminConfig(token="admin"))
    g = gw.app[GATEWAY]
    before = g.config
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    daemon = Daemon(before, lambda: load_config(path, env={}), Notifier(env={}))
    assert await daemon.reload(gw) is False
    assert g.config is before and g.reloads.failed == 1 and not g.reloads.last_ok
    assert g.registry.get(w.url) is not None  # the fleet stays
    async with http.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
        assert r.status == 401  # the keys stay
    refused = logs.records("configuration reload refused; the running configuration stays")
    assert len(refused) == 1
    assert any("reload.allow_no_workers" in p for p in refused[0]["problems"])
    # Said explicitly, the same emptying applies.
    path.write_text(
        "[reload]\nallow_no_workers = true\nallow_no_keys = true\nallow_no_admin = true\n"
    )
    assert await daemon.reload(gw) is True
    await wait_until(lambda: g.registry.get(w.url) is None)


async def test_nan_and_inf_never_reach_a_running_gateway(fake_worker, gateway, tmp_path, client):
    w = await fake_worker(models="m")
    gw = await gateway([w])
    g = gw.app[GATEWAY]
    path = tmp_path / "gateway.toml"
    path.write_text(f'[[workers]]\nurl = "{w.url}"\n[timeouts]\nfirst_byte = nan\nidle = inf\n')
    daemon = Daemon(g.config, lambda: load_config(path, env={}), Notifier(env={}))
    assert await daemon.reload(gw) is False
    assert g.relay.timeouts.first_byte == TimeoutConfig().first_byte
    answer = await client(gw).completions.create(model="m", prompt="x", max_tokens=2)
    assert answer.choices


async def test_lora_updates_are_refused_to_clients_by_default(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([w])
    body = {"lora_name": "evil", "lora_path": "/tmp/evil", "model": "m"}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1//load_lora_adapter"):
        async with http.post(gw.url + path, json=body) as r:
            assert r.status == 403, path
            assert (await r.json())["error"]["code"] == "path_not_allowed"
    assert not [r for r in w.stats.requests if "lora" in r.path]
    # Allowed by the setting: relayed (the fake worker has no such endpoint: its 404).
    gw2 = await gateway([w], auth=AuthConfig(lora_updates=True))
    async with http.post(gw2.url + "/v1/load_lora_adapter", json=body) as r:
        assert r.status != 403


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_errors_name_no_worker_address(fake_worker, gateway, client):
    """A 502 and a mid-stream SSE error say what happened, not where the worker is."""
    port = _free_port()  # nothing listens there: connections are refused
    dead = f"http://127.0.0.1:{port}"
    gw = await gateway([dead], probe=GatewayConfig().probe)  # slow probes: set ready below
    g = gw.app[GATEWAY]
    worker = g.registry.get(dead)
    g.registry.set_models(worker, ["m"])
    g.registry.set_state(worker, worker.state.READY, "test")
    with pytest.raises(openai.APIStatusError) as e:
        await client(gw).completions.create(model="m", prompt="x", max_tokens=2)
    assert e.value.status_code in (502, 503)  # 503 once the breaker took the worker out
    message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    assert "could not be reached" in message
    assert str(port) not in message and "127.0.0.1" not in message

    w = await fake_worker(models="m", tpot_ms=5)
    gw2 = await gateway([w])
    stream = await client(gw2).completions.create(
        model="m",
        prompt="x",
        max_tokens=50,
        stream=True,
        extra_headers={"X-Fake-Fault": "reset_midstream=2"},
    )
    with pytest.raises(openai.APIError) as e2:
        async for _ in stream:
            pass
    text = str(e2.value)
    assert "failed mid-answer" in text and w.url not in text and str(w.port) not in text
    await asyncio.sleep(0)

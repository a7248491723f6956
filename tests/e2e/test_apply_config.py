"""apply_config: a running gateway follows a new configuration without dropping a request."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tests.conftest import wait_until
from vllm_gateway.app import GATEWAY, REGISTRY
from vllm_gateway.config.gateway import ModelConfig, ReloadConfig, TimeoutConfig, WorkerSpec
from vllm_gateway.errors import ConfigError
from vllm_gateway.process.reload import apply_config
from vllm_gateway.workers import WorkerState

pytestmark = pytest.mark.timeout(30)


def with_workers(config, *urls, **changes):
    return dataclasses.replace(config, workers=tuple(WorkerSpec(url=u) for u in urls), **changes)


async def read_stream(response) -> bytes:
    body = b""
    async for chunk in response.content.iter_any():
        body += chunk
    return body


async def test_add_and_retire_static_workers(fake_worker, gateway, http, client):
    a = await fake_worker(models="m", tpot_ms=10, ttft_ms=1)
    b = await fake_worker(models="m", tpot_ms=1, ttft_ms=1)
    gw = await gateway([a])
    g = gw.app[GATEWAY]
    registry = gw.app[REGISTRY]
    # Requests in flight on `a` when the reload drops it.
    body = {"model": "m", "prompt": "x", "max_tokens": 30, "stream": True}
    streams = [await http.post(gw.url + "/v1/completions", json=body) for _ in range(4)]
    firsts = [await r.content.readany() for r in streams]

    changes = apply_config(gw.app, with_workers(g.config, b.url))
    assert f"worker added: {b.url}" in changes
    assert any(c.startswith(f"worker draining: {a.url}") for c in changes)
    assert registry.get(a.url).state is WorkerState.DRAINING
    await wait_until(lambda: registry.get(b.url).available, timeout=5)
    # New requests go to b only; a's streams finish whole, then a leaves the registry.
    for _ in range(3):
        await client(gw).completions.create(model="m", prompt="x", max_tokens=1)
    assert sum(1 for r in b.stats.requests if r.path == "/v1/completions") == 3
    rests = await asyncio.gather(*(read_stream(r) for r in streams))
    bodies = [first + rest for first, rest in zip(firsts, rests, strict=True)]
    assert all(body.rstrip().endswith(b"data: [DONE]") for body in bodies)
    assert all(body.count(b'"text":" w') == 30 for body in bodies), bodies
    await wait_until(lambda: registry.get(a.url) is None, timeout=5)
    assert g.fleet.retiring == {}


async def test_idle_worker_removed_at_once_and_taken_back(fake_worker, gateway):
    a = await fake_worker(models="m")
    b = await fake_worker(models="m")
    gw = await gateway([a, b])
    g = gw.app[GATEWAY]
    registry = gw.app[REGISTRY]
    changes = apply_config(gw.app, with_workers(g.config, b.url))
    assert changes == [f"worker removed: {a.url}"]
    assert registry.get(a.url) is None
    changes = apply_config(gw.app, with_workers(g.config, a.url, b.url))
    assert changes == [f"worker added: {a.url}"]
    await wait_until(lambda: registry.get(a.url).available, timeout=5)


async def test_registered_workers_are_not_the_configs(fake_worker, gateway):
    a = await fake_worker(models="m")
    gw = await gateway([a])
    registry = gw.app[REGISTRY]
    registry.add("http://127.0.0.1:9", models=("m",), source="registered")
    # Removing the file's last worker must be meant (reload.allow_no_workers).
    meant = ReloadConfig(allow_no_workers=True)
    apply_config(gw.app, with_workers(gw.app[GATEWAY].config, reload=meant))
    assert registry.get("http://127.0.0.1:9") is not None
    assert registry.get(a.url) is None


async def test_policy_timeouts_pins_and_restart_only_settings(fake_worker, gateway):
    a = await fake_worker(models="m")
    gw = await gateway([a])
    g = gw.app[GATEWAY]
    old_policy = g.dispatcher.policy
    new = dataclasses.replace(
        g.config,
        policy="round_robin",
        models={"m": ModelConfig(policy="least_inflight")},
        port=1234,
        timeouts=TimeoutConfig(idle=7.0),
        workers=(WorkerSpec(url=a.url, models=("pinned",), weight=2.0),),
    )
    changes = apply_config(gw.app, new)
    assert "policy: cache_aware -> round_robin" in changes
    assert "dispatch settings or per-model policies changed" in changes
    assert type(g.dispatcher.policy_for_model["m"]).__name__ != type(g.dispatcher.policy).__name__
    assert "timeouts changed" in changes
    assert "port: 1234 takes effect at the next restart" in changes
    assert f"worker reconfigured: {a.url}" in changes
    assert g.dispatcher.policy is not old_policy and g.relay.timeouts.idle == 7.0
    worker = gw.app[REGISTRY].get(a.url)
    assert worker.models == {"pinned"} and worker.weight == 2.0
    assert g.config is new and g.status.config is new


async def test_invalid_config_changes_nothing(fake_worker, gateway):
    a = await fake_worker(models="m")
    gw = await gateway([a])
    g = gw.app[GATEWAY]
    before = g.config
    with pytest.raises(ConfigError, match="unknown policy"):
        apply_config(gw.app, with_workers(before, policy="nope"))
    assert g.config is before and gw.app[REGISTRY].get(a.url) is not None


async def test_access_log_switched_by_reload(fake_worker, gateway):
    gw = await gateway([await fake_worker(models="m")])
    g = gw.app[GATEWAY]
    hooks = g.dispatcher.on_release
    n = len(hooks)
    apply_config(
        gw.app,
        dataclasses.replace(g.config, log=dataclasses.replace(g.config.log, access_log=True)),
    )
    assert g.access_log is not None and len(hooks) == n + 1
    apply_config(
        gw.app,
        dataclasses.replace(g.config, log=dataclasses.replace(g.config.log, access_log=False)),
    )
    assert g.access_log is None and len(hooks) == n


async def test_breaker_aliases_and_admin_token_follow_a_reload(fake_worker, gateway, http):
    from vllm_gateway.config.gateway import AdminConfig, BreakerConfig

    gw = await gateway([await fake_worker(models="m")])
    g = gw.app[GATEWAY]
    new = dataclasses.replace(
        g.config,
        breaker=BreakerConfig(failures=9),
        aliases={"friendly": {"m": 1.0}},
        admin=AdminConfig(token="rotated"),
    )
    changes = apply_config(gw.app, new)
    assert {"breaker settings changed", "aliases changed", "admin settings changed"} <= set(changes)
    assert g.breaker.config.failures == 9
    body = {"model": "friendly", "prompt": "x", "max_tokens": 1}
    async with http.post(gw.url + "/v1/completions", json=body) as r:
        assert r.status == 200  # the alias resolves to m
    async with http.get(gw.url + "/admin/workers") as r:
        assert r.status == 401
    headers = {"Authorization": "Bearer rotated"}
    async with http.get(gw.url + "/admin/workers", headers=headers) as r:
        assert r.status == 200

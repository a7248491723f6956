"""FastChat-compatible registration over real sockets: join, heartbeat, expiry, security."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import STEADY_PROBES, wait_until
from vllm_gateway.app import REGISTRATION, REGISTRY
from vllm_gateway.config.gateway import PRIVATE_NETWORKS, RegistrationConfig
from vllm_gateway.control.access import AllowedNetworks

pytestmark = pytest.mark.timeout(30)

TOKEN = "reg-token-91c2"


async def post(http, gw, path: str, body: dict, token: str | None = None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with http.post(gw.url + path, json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_registered_worker_serves_traffic_within_a_second(fake_worker, gateway, client, http):
    w = await fake_worker(models=("m",), lora_adapters=("m-lora",))
    gw = await gateway([], probe=STEADY_PROBES)
    c = client(gw)
    started = time.monotonic()
    # FastChat's model_worker sends exactly this shape.
    status, body = await post(
        http,
        gw,
        "/register_worker",
        {
            "worker_name": w.url,
            "check_heart_beat": True,
            "worker_status": {"model_names": ["m"], "speed": 1, "queue_length": 0},
            "multimodal": False,
        },
    )
    assert status == 200 and body["state"] == "ready"
    answer = await c.completions.create(model="m-lora", prompt="x", max_tokens=2)
    assert answer.choices[0].text == " w0 w1"
    assert time.monotonic() - started < 1.0
    # The adapter was learned from the worker's /v1/models, not from worker_status.
    assert body["models"] == ["m", "m-lora"]
    assert gw.app[REGISTRY].get(w.url).source == "registered"

    # FastChat's other controller calls.
    status, body = await post(http, gw, "/get_worker_address", {"model": "m"})
    assert body == {"address": w.url}
    status, body = await post(http, gw, "/get_worker_address", {"model": "nope"})
    assert body == {"address": ""}
    async with http.post(gw.url + "/list_models") as r:
        assert (await r.json())["models"] == ["m", "m-lora"]
    status, body = await post(http, gw, "/refresh_all_workers", {})
    assert status == 200 and body["workers"] == {"ready": 1}


async def test_registration_without_worker_status_asks_the_worker(fake_worker, gateway, http):
    w = await fake_worker(models="qwen")
    gw = await gateway([])
    status, body = await post(http, gw, "/register_worker", {"worker_name": w.url + "/"})
    assert status == 200 and body == {
        "ok": True,
        "new": True,
        "state": "ready",
        "models": ["qwen"],
    }
    # Registering again changes nothing (a multi-process gateway may apply it twice).
    status, body = await post(http, gw, "/register_worker", {"worker_name": w.url})
    assert body["new"] is False and len(gw.app[REGISTRY]) == 1


async def test_worker_that_stops_heartbeating_is_removed_after_the_expiry(
    fake_worker, gateway, http, logs
):
    w1 = await fake_worker(models="m")
    w2 = await fake_worker(models="m")
    gw = await gateway([], registration=RegistrationConfig(heartbeat_expiry=0.6))
    registry = gw.app[REGISTRY]
    for w in (w1, w2):
        await post(http, gw, "/register_worker", {"worker_name": w.url, "check_heart_beat": True})
    # A worker that asked not to be checked never expires.
    w3 = await fake_worker(models="m")
    await post(http, gw, "/register_worker", {"worker_name": w3.url, "check_heart_beat": False})

    # w1 keeps beating; w2 falls silent.
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        status, body = await post(
            http, gw, "/receive_heart_beat", {"worker_name": w1.url, "queue_length": 3}
        )
        assert status == 200 and body["exist"] is True
        await asyncio.sleep(0.1)
    assert registry.get(w1.url) is not None and registry.get(w3.url) is not None
    assert registry.get(w2.url) is None
    [removed] = logs.records("worker removed")
    assert removed["worker"] == w2.url and "no heartbeat" in removed["reason"]
    # Capacity lost without anyone asking: a WARNING an operator can alert on.
    [expired] = logs.records("worker heartbeat expired")
    assert expired["worker"] == w2.url and expired["level"] == "warning"
    assert gw.app[REGISTRATION].expired == 1
    assert gw.app[REGISTRATION].heartbeats[w1.url].queue_length == 3

    # A heartbeat from the removed worker is told to register again.
    status, body = await post(http, gw, "/receive_heart_beat", {"worker_name": w2.url})
    assert body == {"exist": False}


async def test_registration_needs_the_token_when_one_is_set(fake_worker, gateway, http, logs):
    w = await fake_worker(models="m")
    gw = await gateway([], registration=RegistrationConfig(token=TOKEN))
    body = {"worker_name": w.url}
    for token in (None, "wrong"):
        status, answer = await post(http, gw, "/register_worker", body, token)
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        status, _ = await post(http, gw, "/receive_heart_beat", body, token)
        assert status == 401
    assert len(gw.app[REGISTRY]) == 0
    refused = logs.records("control request refused")
    assert len(refused) == 4 and {r["reason"] for r in refused} == {
        "no bearer token",
        "wrong token",
    }
    assert TOKEN not in logs.getvalue() and "wrong" not in str([r.get("token") for r in refused])

    status, answer = await post(http, gw, "/register_worker", body, TOKEN)
    assert status == 200 and answer["state"] == "ready"
    # FastChat's address lookup is a read, open like /list_models.
    status, answer = await post(http, gw, "/get_worker_address", {"model": "m"})
    assert answer == {"address": w.url}


async def test_registration_outside_the_allowed_networks_is_forbidden(
    fake_worker, gateway, http, logs
):
    gw = await gateway(
        [],
        registration=RegistrationConfig(
            allowed_networks=("10.0.0.0/8",), allowed_hosts=("*.gpu.internal", "localhost")
        ),
    )
    for url in ("http://127.0.0.1:9", "http://203.0.113.7:8000", "http://169.254.169.254"):
        status, answer = await post(http, gw, "/register_worker", {"worker_name": url})
        assert status == 403, url
        assert answer["error"]["type"] == "permission_error"
        assert "outside the allowed networks" in answer["error"]["message"]
    refused = logs.records("control request refused")
    assert [r["worker"] for r in refused] == [
        "http://127.0.0.1:9",
        "http://203.0.113.7:8000",
        "http://169.254.169.254",
    ]
    assert len(gw.app[REGISTRY]) == 0
    # A listed host name is accepted as it is (127.0.0.1 itself is not allowed here).
    w = await fake_worker(models="m")
    url = f"http://localhost:{w.port}"
    status, answer = await post(http, gw, "/register_worker", {"worker_name": url})
    assert status == 200 and answer["state"] == "ready"


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("node1.gpu.internal", True),
        ("a.b.gpu.internal", True),
        ("gpu.internal", False),  # the wildcard needs a label before the suffix
        ("node1.gpu.internal.evil.example", False),
        ("exact.example", True),
    ],
)
async def test_allowed_host_names_are_not_resolved(host, allowed):
    asked = []

    async def resolve(name: str) -> list[str]:  # a public address for every name
        asked.append(name)
        return ["203.0.113.9"]

    check = AllowedNetworks(["10.0.0.0/8"], ["*.gpu.internal", "exact.example"], resolve)
    problem = await check.check(f"http://{host}:8000")
    assert (problem is None) is allowed, problem
    assert asked == ([] if allowed else [host])


async def test_a_host_name_must_resolve_inside_the_networks_only():
    answers = {"in.example": ["10.0.0.7"], "mixed.example": ["10.0.0.8", "198.51.100.1"]}

    async def resolve(name: str) -> list[str]:
        if name not in answers:
            raise OSError("no such name")
        return answers[name]

    check = AllowedNetworks(["10.0.0.0/8"], (), resolve)
    assert await check.check("http://in.example:8000") is None
    assert "198.51.100.1" in await check.check("http://mixed.example")
    assert "does not resolve" in await check.check("http://nowhere.example")


async def test_agent_paths_drain_and_unregister(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([])
    await post(http, gw, "/register_worker", {"worker_name": w.url})
    steps = [
        ("/drain_worker", {}, {"exist": True, "state": "draining", "inflight": 0}),
        ("/drain_worker", {}, {"exist": True, "state": "draining", "inflight": 0}),
        ("/drain_worker", {"undrain": True}, {"exist": True, "state": "ready", "inflight": 0}),
        ("/unregister_worker", {}, {"exist": True}),
        ("/unregister_worker", {}, {"exist": False}),
        ("/drain_worker", {}, {"exist": False}),
    ]
    for path, extra, expected in steps:
        assert await post(http, gw, path, {"worker_name": w.url, **extra}) == (200, expected)
    assert len(gw.app[REGISTRY]) == 0


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://10.1.2.3:8000", True),
        ("http://192.168.0.9", True),
        ("http://172.31.255.1", True),
        ("http://172.32.0.1", False),
        ("http://[::1]:8000", True),
        ("http://[fd00::5]:8000", True),
        ("http://[::ffff:10.0.0.1]:8000", True),
        ("http://8.8.8.8", False),
        ("http://169.254.169.254", False),
        ("http://localhost:8000", True),  # resolves to loopback
    ],
)
async def test_default_allowed_networks(url, allowed):
    problem = await AllowedNetworks(PRIVATE_NETWORKS).check(url)
    assert (problem is None) is allowed, problem


async def test_models_loaded_at_run_time_appear_after_a_probe(fake_worker, gateway, client):
    w = await fake_worker(models="base")
    gw = await gateway([w])  # probes every 0.1 s
    c = client(gw)
    assert [m.id for m in (await c.models.list()).data] == ["base"]
    # The server now lists a LoRA adapter (vLLM: POST /v1/load_lora_adapter); the fake
    # stands in by restarting on the same port with the adapter configured.
    port = w.port
    await w.stop()
    again = await fake_worker(models=("base",), lora_adapters=("sql-lora",))
    await again.stop()
    await again.start(port=port)
    registry = gw.app[REGISTRY]
    await wait_until(lambda: "sql-lora" in registry.ready_models(), timeout=5)
    answer = await c.completions.create(model="sql-lora", prompt="x", max_tokens=1)
    assert answer.model == "sql-lora"

"""The registration token acts only on workers that registered, and registration without a
token is closed to the network when the gateway listens beyond loopback."""

from __future__ import annotations

import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import STEADY_PROBES
from vllm_gateway.app import REGISTRATION, REGISTRY, create_app
from vllm_gateway.config.gateway import AdminConfig, GatewayConfig, RegistrationConfig
from vllm_gateway.control.access import LOCAL_PEER_HEADER
from vllm_gateway.control.registration import loopback_only
from vllm_gateway.errors import Forbidden
from vllm_gateway.http.server import start_server

pytestmark = pytest.mark.timeout(60)

TOKEN = "reg-token-5e1d"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def post(http, gw, path: str, body: object):
    async with http.post(gw.url + path, json=body, headers=AUTH) as r:
        return r.status, await r.json()


async def test_the_registration_token_never_drains_or_removes_a_static_worker(
    fake_worker, gateway, http
):
    static = await fake_worker(models="m")
    gw = await gateway([static], registration=RegistrationConfig(token=TOKEN))
    registry = gw.app[REGISTRY]
    for path in ("/drain_worker", "/unregister_worker"):
        status, body = await post(http, gw, path, {"worker_name": static.url})
        assert status == 409, body
        assert body["error"]["code"] == "worker_not_registered"
        assert "static worker" in body["error"]["message"]
    worker = registry.get(static.url)
    assert worker is not None and worker.state.value == "ready"
    assert gw.app[REGISTRATION].refused == 2


async def test_registering_a_static_url_changes_neither_its_source_nor_its_life(
    fake_worker, gateway, http
):
    static = await fake_worker(models="m")
    gw = await gateway([static], registration=RegistrationConfig(token=TOKEN))
    registration = gw.app[REGISTRATION]
    body = {"worker_name": static.url, "check_heart_beat": True}
    status, answer = await post(http, gw, "/register_worker", body)
    assert status == 200 and answer["new"] is False and answer["source"] == "static"
    worker = gw.app[REGISTRY].get(static.url)
    assert worker.source == "static"
    # Heartbeats stop: far past the expiry, the static worker stays.
    assert registration.expire(now=10**9) == []
    assert gw.app[REGISTRY].get(static.url) is worker


async def test_registered_workers_still_drain_and_leave(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([], probe=STEADY_PROBES, registration=RegistrationConfig(token=TOKEN))
    assert (await post(http, gw, "/register_worker", {"worker_name": w.url}))[0] == 200
    status, body = await post(http, gw, "/drain_worker", {"worker_name": w.url})
    assert status == 200 and body["state"] == "draining"
    status, body = await post(http, gw, "/unregister_worker", {"worker_name": w.url})
    assert status == 200 and body == {"exist": True}


@pytest.mark.parametrize(
    ("token", "open_", "host", "closed"),
    [
        ("", False, "0.0.0.0", True),
        ("", False, "::", True),
        ("", False, "10.0.0.5", True),
        ("", True, "0.0.0.0", False),  # explicitly open
        ("t", False, "0.0.0.0", False),  # the token guards it
        ("", False, "127.0.0.1", False),  # loopback: only local clients reach it anyway
        ("", False, "::1", False),
        ("", False, "localhost", False),
    ],
)
def test_when_registration_is_loopback_only(token, open_, host, closed):
    config = RegistrationConfig(token=token, open_without_token=open_)
    assert loopback_only(config, host) is closed


async def test_without_a_token_beyond_loopback_only_loopback_clients_register(logs):
    """The gateway listens on 0.0.0.0 (by config) with no token: a registration from a
    non-loopback peer is refused 403; one from 127.0.0.1 is served; a WARNING says so at
    start."""
    app = create_app(GatewayConfig(host="0.0.0.0", port=0))
    gw = await start_server(app, "127.0.0.1", 0, shutdown_timeout=1.0)  # config says 0.0.0.0
    try:
        warnings = [r for r in logs.records() if "loopback clients only" in r["event"]]
        assert len(warnings) == 1 and warnings[0]["level"] == "warning"
        await _check_peers(gw.app[REGISTRATION])
    finally:
        await gw.stop()


async def _check_peers(registration) -> None:
    assert registration.loopback_only

    def request(peer: str, sock: socket.socket | None = None, headers=None):
        return _Request(peer, _Transport(sock), headers)

    with pytest.raises(Forbidden):
        registration._authorize(request("192.168.1.20"))
    with pytest.raises(Forbidden):
        registration._authorize(request("::ffff:10.1.2.3"))
    registration._authorize(request("127.0.0.1"))  # no exception
    registration._authorize(request("::1"))
    assert registration.refused == 2
    # A sibling process re-sending the request on its unix socket (no peer address).
    with socket.socket(socket.AF_UNIX) as unix:
        registration._authorize(request("", unix))
        registration._authorize(request("", unix, {LOCAL_PEER_HEADER: "1"}))
        # ... a request its own process refused (a remote client's) is refused here too.
        with pytest.raises(Forbidden):
            registration._authorize(request("", unix, {LOCAL_PEER_HEADER: "0"}))
    assert registration.refused == 3


class _Request:
    """Just enough of an aiohttp request for the peer check and its refusal log line."""

    method = "POST"
    path = "/register_worker"

    def __init__(
        self, peer: str, transport: _Transport, headers: dict[str, str] | None = None
    ) -> None:
        self.remote = peer or None
        self.transport = transport
        self.headers = headers or {}


class _Transport:
    """Just enough of a transport for `access.local_peer`: the socket it runs on."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.sock = sock

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.sock if name == "socket" else default


control_bodies = st.dictionaries(
    st.sampled_from(
        ["worker_name", "check_heart_beat", "worker_status", "undrain", "queue_length", "x"]
    ),
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=30)
    | st.sampled_from(["http://127.0.0.1:1", "http://10.0.0.1:8000/", "http://[::1]:9"])
    | st.dictionaries(
        st.sampled_from(["model_names", "queue_length", "speed"]),
        st.none() | st.lists(st.text(max_size=5) | st.integers(), max_size=3) | st.floats(),
    ),
    max_size=5,
)


async def test_any_control_body_gets_an_answer_never_a_500(fake_worker, gateway, http):
    """Hypothesis over the registration API's bodies: 2xx or 4xx with an OpenAI error
    body; the static worker stays as it was."""
    static = await fake_worker(models="m")
    gw = await gateway([static], registration=RegistrationConfig(token=TOKEN))
    registry = gw.app[REGISTRY]
    paths = ["/register_worker", "/receive_heart_beat", "/drain_worker", "/unregister_worker"]
    seen: list[tuple[str, object, int]] = []

    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(path=st.sampled_from(paths), body=control_bodies | st.lists(st.integers()))
    def collect(path, body):
        seen.append((path, body, 0))

    collect()
    assert len(seen) >= 30
    for path, body, _ in seen:
        try:
            async with http.post(gw.url + path, json=body, headers=AUTH) as r:
                status, text = r.status, await r.text()
        except ValueError:  # a float aiohttp's json cannot write (nan): not sendable
            continue
        assert status < 500, (path, body, status, text)
        if status >= 400:
            assert '"error"' in text
    worker = registry.get(static.url)
    assert worker is not None and worker.source == "static" and worker.state.value == "ready"


@pytest.mark.parametrize("names", [[""], ["a\nb"], ["m", 1], [None], ["x" * 600]])
async def test_registered_model_names_are_checked_like_a_workers_own(
    names, fake_worker, gateway, http
):
    w = await fake_worker(models="m")
    gw = await gateway([], registration=RegistrationConfig(token=TOKEN))
    body = {"worker_name": w.url, "worker_status": {"model_names": names}}
    status, answer = await post(http, gw, "/register_worker", body)
    assert status == 400, answer
    assert gw.app[REGISTRY].get(w.url) is None


admin_bodies = st.fixed_dictionaries(
    {},
    optional={
        "url": st.sampled_from(["http://127.0.0.1:9", "http://[::1]:9", "ftp://x", ""])
        | st.text(max_size=20),
        "models": st.lists(st.text(max_size=8) | st.integers(), max_size=3) | st.text(max_size=5),
        "weight": st.sampled_from([0, 1, 0.5, -1, 1e308, 1.7e308, 2**64, "2"]) | st.floats(0, 10),
        "drain": st.booleans() | st.none(),
        "wait": st.booleans(),
        "timeout": st.sampled_from([0, 0.01, -1, "x"]),
        "name": st.text(max_size=8) | st.sampled_from(["m", "alias"]),
        "targets": st.dictionaries(
            st.sampled_from(["m", "x", ""]),
            st.sampled_from([0, 1, 50, -1, 1e308, "a"]) | st.floats(0, 100),
            max_size=3,
        )
        | st.lists(st.text(max_size=3), max_size=2),
    },
)


async def test_any_admin_body_gets_an_answer_and_requests_still_flow(fake_worker, gateway, http):
    """Hypothesis over the admin API's bodies (with its token): no 5xx, and after each one a
    completion for the static worker's model is answered (never the gateway's own 500)."""

    static = await fake_worker(models="m")
    gw = await gateway([static], admin=AdminConfig(token="adm"))
    headers = {"Authorization": "Bearer adm"}
    paths = ["/workers/add", "/workers/drain", "/workers/undrain", "/workers/weight"]
    paths += ["/aliases/set", "/aliases/remove", "/workers/remove"]
    seen: list[tuple[str, object]] = []

    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(path=st.sampled_from(paths), body=admin_bodies)
    def collect(path, body):
        if isinstance(body.get("url"), str) and body["url"] == "" and path != "/workers/add":
            body["url"] = static.url  # act on the real worker too
        seen.append((path, body))

    collect()
    completion = {"model": "m", "prompt": "x", "max_tokens": 1}
    for path, body in seen:
        async with http.post(gw.url + "/admin" + path, json=body, headers=headers) as r:
            text = await r.text()
            assert r.status < 500, (path, body, r.status, text)
        async with http.post(gw.url + "/v1/completions", json=completion) as r:
            assert "internal_error" not in await r.text(), (path, body)
        for get in ("/health", "/v1/models", "/list_workers", "/metrics", "/stats"):
            async with http.get(gw.url + get) as r:
                # /health is 503 while no worker is ready (a drain may do that): by design.
                assert r.status < 500 or (get, r.status) == ("/health", 503), (path, body, get)

"""Several gateway processes on one port: control requests reach all, /list_workers agrees."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys

import pytest
from aiohttp import web

from tests.conftest import FAST_PROBES
from tests.support.processes import sibling_apps
from vllm_gateway.app import REGISTRY
from vllm_gateway.config.gateway import AdminConfig, GatewayConfig, WorkerSpec
from vllm_gateway.process.siblings import SIBLING_HEADER, is_control

pytestmark = pytest.mark.timeout(40)

TOKEN = "admin-token-for-tests"


def test_control_requests_are_recognised_by_method_and_path():
    assert is_control("POST", "/admin/workers/drain")
    assert is_control("DELETE", "/admin/anything/new")
    assert is_control("POST", "/register_worker")
    assert is_control("POST", "/receive_heart_beat")
    assert is_control("POST", "/refresh_all_workers")
    assert not is_control("GET", "/admin/workers")
    assert not is_control("POST", "/v1/chat/completions")
    assert not is_control("POST", "/get_worker_address")
    assert not is_control("POST", "/list_models")


@pytest.fixture
async def two_processes(fake_worker):
    """Two gateway apps in this process wired as siblings (as `serve --processes 2` does),
    each with a test control endpoint that records what it was sent."""
    worker = await fake_worker(models="m")
    config = GatewayConfig(
        host="127.0.0.1",
        port=0,
        workers=(WorkerSpec(url=worker.url),),
        probe=FAST_PROBES,
        admin=AdminConfig(token=TOKEN),
    )
    seen: list[list[tuple[str, bytes, str | None]]] = []

    def prepare(i: int, app: web.Application) -> None:
        calls: list[tuple[str, bytes, str | None]] = []

        async def mark(request: web.Request) -> web.Response:
            calls.append((request.path, await request.read(), request.headers.get("X-A")))
            return web.json_response({"ok": True})

        app.router.add_post("/admin/mark", mark)
        app.router.add_delete("/admin/mark", mark)
        seen.append(calls)

    async with sibling_apps(config, prepare=prepare) as servers:
        yield worker, servers, seen


async def test_a_control_request_reaches_every_process_once(two_processes, http):
    _, (a, b), (seen_a, seen_b) = two_processes
    async with http.post(a.url + "/admin/mark", data=b'{"x": 1}', headers={"X-A": "1"}) as r:
        assert r.status == 200 and (await r.json()) == {"ok": True}
    assert seen_a == [("/admin/mark", b'{"x": 1}', "1")]
    assert seen_b == [("/admin/mark", b'{"x": 1}', "1")]  # same body and headers
    async with http.delete(b.url + "/admin/mark") as r:
        assert r.status == 200
    assert len(seen_a) == len(seen_b) == 2
    # The sibling header from a TCP client is not trusted: the request still fans out.
    async with http.post(a.url + "/admin/mark", headers={SIBLING_HEADER: "1"}) as r:
        assert r.status == 200
    assert len(seen_a) == len(seen_b) == 3
    # Reads and relayed requests stay in the process that got them.
    async with http.post(
        a.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}
    ) as r:
        assert r.status == 200
    assert len(seen_b) == 3


async def test_a_drain_is_idle_only_when_every_process_is(two_processes, http):
    worker, (a, b), _ = two_processes
    auth = {"Authorization": f"Bearer {TOKEN}"}
    drain = {"url": worker.url, "wait": True, "timeout": 0.3}
    body = {"model": "m", "prompt": "x", "max_tokens": 150, "stream": True}  # ~1.5 s
    async with http.post(b.url + "/v1/completions", json=body) as stream:
        assert stream.status == 200
        await stream.content.readline()  # the stream is under way, in process b only
        # Process a has nothing in flight, but the gateway does: not idle.
        async with http.post(a.url + "/admin/workers/drain", json=drain, headers=auth) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
        assert answer["idle"] is False and answer["worker"]["inflight"] == 1
        assert answer["waited_seconds"] >= 0.25  # process b's wait, not a's instant answer
        async with http.get(a.url + "/admin/workers", headers=auth) as r:
            (listed,) = (await r.json())["workers"]
        assert listed["inflight"] == 1 and listed["state"] == "draining"
        rest = await stream.read()
    assert rest.rstrip().endswith(b"data: [DONE]")  # a drain lets in-flight streams finish
    async with http.post(a.url + "/admin/workers/drain", json=drain, headers=auth) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["idle"] is True


async def test_a_registration_reaches_every_process(two_processes, fake_worker, http):
    _, (a, b), _ = two_processes
    new = await fake_worker(models="m2")
    async with http.post(a.url + "/register_worker", json={"worker_name": new.url}) as r:
        assert r.status == 200, await r.text()  # the process that got it registers it too
    for server in (a, b):
        assert new.url in {w.url for w in server.app[REGISTRY]}


async def test_list_workers_adds_up_the_processes(two_processes, http):
    worker, (a, b), _ = two_processes
    for server in (a, b, b):
        async with http.post(
            server.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}
        ) as r:
            assert r.status == 200
    docs = []
    for server in (a, b):
        async with http.get(server.url + "/list_workers") as r:
            docs.append(await r.json())
    for doc in docs:  # each process scrapes on its own clock, and learns on its own
        for w in doc["workers"]:
            w.pop("stats_age_seconds")
            w.pop("dispatch")
            # A rate averaged over each process's own scrape intervals (6.8 against 6.9).
            w.pop("cache_missed_per_s")
    assert docs[0] == docs[1]
    (w,) = docs[0]["workers"]
    assert w["url"] == worker.url and w["completed"] == 3 and w["inflight"] == 0
    assert docs[0]["processes"] == 2
    # Each process's own count is still its own.
    assert [next(iter(s.app[REGISTRY])).completed for s in (a, b)] == [1, 2]


async def test_serve_processes_shares_one_port(fake_worker, http):
    worker = await fake_worker(models="m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm_gateway", "serve", "--processes", "2"]
    cmd += ["--port", str(port), "--worker", worker.url, "--log-format", "json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:

        async def ready() -> bool:
            try:
                async with http.get(url + "/health") as r:
                    return r.status == 200
            except OSError:
                return False

        for _ in range(200):
            if await ready():
                break
            await asyncio.sleep(0.05)
        prefixes = set()
        for _ in range(30):  # new connections: the kernel spreads them over both processes
            async with http.post(
                url + "/v1/completions",
                json={"model": "m", "prompt": "x", "max_tokens": 1},
                headers={"Connection": "close"},
            ) as r:
                assert r.status == 200
                prefixes.add(r.headers["X-Request-Id"].rsplit("-", 1)[0])
        assert len(prefixes) == 2, prefixes  # two processes, distinct request-id prefixes
        async with http.get(url + "/list_workers") as r:
            doc = await r.json()
        assert doc["processes"] == 2 and doc["workers"][0]["completed"] == 30
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, proc.stderr.read().decode() if proc.stderr else ""


async def test_a_registration_refused_to_a_remote_peer_is_refused_by_every_process(
    fake_worker, http, monkeypatch
):
    """No registration token, listening beyond loopback: a non-loopback client is refused
    403 by the process it reached, and its siblings (which get the request re-sent on
    their unix sockets) must not register the worker either."""
    from vllm_gateway.control import access

    worker = await fake_worker(models="m")
    config = GatewayConfig(host="0.0.0.0", port=0, probe=FAST_PROBES)
    async with sibling_apps(config) as servers:
        # Every TCP peer counts as remote here (the test reaches 127.0.0.1 only).
        monkeypatch.setattr(access, "is_loopback", lambda address: False)
        async with http.post(
            servers[0].url + "/register_worker", json={"worker_name": worker.url}
        ) as r:
            assert r.status == 403, await r.text()
        for server in servers:
            assert worker.url not in {w.url for w in server.app[REGISTRY]}
        # A client cannot claim a loopback origin with a header of its own.
        async with http.post(
            servers[0].url + "/register_worker",
            json={"worker_name": worker.url},
            headers={"x-gateway-peer": "127.0.0.1", SIBLING_HEADER: "1"},
        ) as r:
            assert r.status == 403, await r.text()
        for server in servers:
            assert worker.url not in {w.url for w in server.app[REGISTRY]}

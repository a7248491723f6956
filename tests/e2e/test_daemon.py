"""The `serve` daemon as a real process: sd_notify, SIGHUP reloads, graceful SIGTERM.

Each test runs `python -m vllm_gateway serve --config FILE` with a fake `$NOTIFY_SOCKET`
(an abstract Unix datagram socket this test listens on) in front of in-process fake workers.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import GatewayProcess
from vllm_gateway.fake_worker import FakeWorker

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def gateway_process(tmp_path):
    made: list[GatewayProcess] = []

    def make(workers: list[FakeWorker], **settings: object) -> GatewayProcess:
        gp = GatewayProcess(tmp_path, workers, **settings)
        made.append(gp)
        return gp

    yield make
    for gp in made:
        await gp.close()


async def open_streams(http, url: str, n: int, max_tokens: int) -> list[aiohttp.ClientResponse]:
    """Start `n` streamed completions and return once each has sent its first event."""
    body = {"model": "m", "prompt": "x", "max_tokens": max_tokens, "stream": True}
    responses = await asyncio.gather(
        *(http.post(url + "/v1/completions", json=body) for _ in range(n))
    )
    firsts = await asyncio.gather(*(r.content.readline() for r in responses))
    assert all(line.startswith(b"data: ") for line in firsts)
    return responses


async def finish(response: aiohttp.ClientResponse, first: bytes = b"") -> bytes:
    body = first
    async for chunk in response.content.iter_any():
        body += chunk
    return body


def intact(body: bytes, tokens: int) -> bool:
    """All tokens after the first event, then [DONE]: nothing lost, nothing cut."""
    texts = [
        json.loads(line[6:])["choices"][0]["text"]
        for line in body.split(b"\n")
        if line.startswith(b"data: {")
    ]
    expected = [f" w{i}" for i in range(1, tokens)]  # event 0 was read by open_streams
    return texts == expected and body.rstrip().endswith(b"data: [DONE]")


async def test_notify_ready_reloading_stopping_in_order(fake_worker, gateway_process, http):
    w = await fake_worker(models="m")
    gp = gateway_process([w])
    ready = await gp.start(WATCHDOG_USEC="400000")
    assert ready["READY"] == "1" and "1 of 1 workers ready" in ready["STATUS"]
    # READY means listening and probed: a request works at once.
    async with http.post(gp.url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
        assert r.status == 200
    gp.signal(signal.SIGHUP)
    reloading = await gp.notification()
    assert reloading["RELOADING"] == "1" and int(reloading["MONOTONIC_USEC"]) > 0
    assert (await gp.notification())["READY"] == "1"
    gp.signal(signal.SIGTERM)
    assert (await gp.notification())["STOPPING"] == "1"
    assert await gp.wait() == 0
    # The watchdog was pinged (every 0.2 s) while the loop ran.
    events = [e["event"] for e in gp.logs()]
    assert events.index("gateway listening") < events.index("reloading configuration")
    assert events.index("configuration reloaded") < events.index("gateway stopped")


async def test_watchdog_pings_reach_systemd(fake_worker, gateway_process):
    gp = gateway_process([await fake_worker(models="m")])
    await gp.start(watchdog_pid=True, WATCHDOG_USEC="200000")
    pings = 0
    async with asyncio.timeout(10):
        while pings < 3:
            msg = await gp.notification(skip_watchdog=False)
            pings += msg == {"WATCHDOG": "1"}
    gp.signal(signal.SIGTERM)
    assert await gp.wait() == 0


async def test_sigterm_lets_50_active_streams_finish(fake_worker, gateway_process):
    w = await fake_worker(models="m", ttft_ms=1, tpot_ms=25, max_num_seqs=64)
    gp = gateway_process([w])
    await gp.start()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        streams = await open_streams(http, gp.url, 50, max_tokens=60)  # about 1.5 s each
        gp.signal(signal.SIGTERM)
        assert (await gp.notification())["STOPPING"] == "1"
        # No new connections from now on, while the 50 streams go on.
        async with asyncio.timeout(5):
            while True:
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", gp.port)
                    writer.close()
                    await asyncio.sleep(0.02)
                except (ConnectionRefusedError, ConnectionResetError):
                    break
        still_running = w.stats.running
        bodies = await asyncio.gather(*(finish(r) for r in streams))
    assert still_running > 0, "the streams ended before the port closed; lengthen them"
    assert all(intact(b, 60) for b in bodies), [b[-200:] for b in bodies if not intact(b, 60)]
    assert await gp.wait() == 0
    assert w.stats.aborted == 0 and w.stats.completed >= 50
    stopping = next(e for e in gp.logs() if e["event"] == "gateway stopping")
    assert stopping["in_flight"] == 50


async def test_streams_past_the_grace_end_cleanly(fake_worker, gateway_process):
    w = await fake_worker(models="m", ttft_ms=1, tpot_ms=20)
    gp = gateway_process([w], shutdown_timeout=0.5)
    await gp.start()
    async with aiohttp.ClientSession() as http:
        (stream,) = await open_streams(http, gp.url, 1, max_tokens=5000)  # 100 s
        t0 = time.monotonic()
        gp.signal(signal.SIGTERM)
        body = await asyncio.wait_for(finish(stream), 10)
    assert await gp.wait() == 0
    assert time.monotonic() - t0 < 8
    # An SSE error event tells the client the answer was cut; the worker saw the abort.
    last = [line for line in body.split(b"\n") if line.startswith(b"data: ")][-1]
    assert "shutting down" in json.loads(last[6:])["error"]["message"]
    async with asyncio.timeout(5):
        while w.stats.aborted != 1:
            await asyncio.sleep(0.02)
    assert any(
        e["event"] == "shutdown grace over; ending the requests still running" for e in gp.logs()
    )


async def test_sighup_adds_a_worker_while_older_streams_finish(fake_worker, gateway_process):
    a = await fake_worker(models="m", ttft_ms=1, tpot_ms=25)
    b = await fake_worker(models="m", ttft_ms=1, tpot_ms=1)
    gp = gateway_process([a])
    await gp.start()
    async with aiohttp.ClientSession() as http:
        streams = await open_streams(http, gp.url, 10, max_tokens=60)
        gp.write_config([a, b])
        gp.signal(signal.SIGHUP)
        assert "RELOADING" in await gp.notification()
        ready = await gp.notification()
        assert ready["READY"] == "1" and "2 of 2 workers ready" in ready["STATUS"]
        for _ in range(10):
            body = {"model": "m", "prompt": "x", "max_tokens": 2}
            async with http.post(gp.url + "/v1/completions", json=body) as r:
                assert r.status == 200
        bodies = await asyncio.gather(*(finish(r) for r in streams))
    # least_inflight: `a` holds 10 streams, so the new worker takes the new requests.
    assert sum(1 for r in b.stats.requests if r.path == "/v1/completions") == 10
    assert all(intact(body, 60) for body in bodies)
    reloaded = next(e for e in gp.logs() if e["event"] == "configuration reloaded")
    assert f"worker added: {b.url}" in reloaded["changes"]
    gp.signal(signal.SIGTERM)
    assert await gp.wait() == 0


async def test_sighup_with_a_broken_config_keeps_the_old_one(fake_worker, gateway_process, http):
    a = await fake_worker(models="m")
    gp = gateway_process([a])
    await gp.start()
    bad_configs = [
        ('port = 8000\npolicy = "nope"\n', "unknown policy 'nope'"),
        ("port = [oops\n", "not valid TOML"),
        ('[timeouts]\nidle = -1\n[[workers]]\nurl = "ftp://x"\n', "must start with http"),
    ]
    for raw, reason in bad_configs:
        gp.write_config([], raw=raw)
        gp.signal(signal.SIGHUP)
        assert "RELOADING" in await gp.notification()
        ready = await gp.notification()
        assert ready["READY"] == "1" and ready["STATUS"].startswith("reload refused")
        refused = [e for e in gp.logs() if e["event"].startswith("configuration reload refused")]
        assert reason in " ".join(refused[-1]["problems"]), refused[-1]
        # Still serving with the old configuration and its worker.
        async with http.post(gp.url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 200
    async with http.get(gp.url + "/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(await r.text())}
    reloads = {s.labels["result"]: s.value for s in families["vllm_gateway_config_reloads"].samples}
    assert reloads == {"success": 0, "failure": 3}
    assert families["vllm_gateway_config_last_reload_successful"].samples[0].value == 0
    gp.signal(signal.SIGTERM)
    assert await gp.wait() == 0


async def test_processes_reload_and_notify_as_one(fake_worker, gateway_process):
    """`--processes 2`: the supervisor speaks for both, and passes SIGHUP to each."""
    a = await fake_worker(models="m")
    b = await fake_worker(models="m")
    gp = gateway_process([a])
    gp.config_path.write_text("processes = 2\n" + gp.config_path.read_text())
    ready = await gp.start(watchdog_pid=True, WATCHDOG_USEC="400000")
    assert ready == {"READY": "1", "STATUS": "2 processes ready"}
    # The supervisor pings systemd's watchdog (every 0.2 s) only while both processes ping
    # it: over 1.6 s, well past the 0.4 s period, the pings go on.
    pings = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + 1.6
    while (left := end - loop.time()) > 0:
        try:
            msg = await gp.notification(timeout=left, skip_watchdog=False)
        except TimeoutError:
            break
        pings += msg == {"WATCHDOG": "1"}
    assert pings >= 4

    async def served_by_b(n: int) -> int:
        before = sum(1 for r in b.stats.requests if r.path == "/v1/completions")
        # A new connection each time, so the kernel spreads them over both processes.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:
            for _ in range(n):
                body = {"model": "m", "prompt": "x", "max_tokens": 1}
                async with http.post(gp.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
        return sum(1 for r in b.stats.requests if r.path == "/v1/completions") - before

    assert await served_by_b(6) == 0
    gp.write_config([b])  # a leaves, b comes
    gp.signal(signal.SIGHUP)
    assert "RELOADING" in await gp.notification()
    assert await gp.notification() == {"READY": "1", "STATUS": "2 processes reloaded"}
    assert await served_by_b(20) == 20  # whichever process answered, it reloaded
    gp.write_config([], raw='policy = "nope"\n')
    gp.signal(signal.SIGHUP)
    assert "RELOADING" in await gp.notification()
    refused = await gp.notification()
    assert refused["READY"] == "1" and refused["STATUS"].startswith("reload refused")
    assert await served_by_b(4) == 4
    gp.signal(signal.SIGTERM)
    assert (await gp.notification())["STOPPING"] == "1"
    assert await gp.wait() == 0
    stopped = [e for e in gp.logs() if e["event"] == "gateway stopped"]
    assert sorted(e["process"] for e in stopped) == [0, 1]

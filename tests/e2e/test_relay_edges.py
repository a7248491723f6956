"""The relay's edge cases over real sockets: framing, reuse, backpressure, sizes, timeouts.

The worker is scripted byte by byte (tests/support/scripted_worker.py) or the fake worker; the
client is aiohttp or a raw socket, so what reaches the client is checked exactly.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import socket

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.conftest import wait_until
from tests.support.scripted_worker import (
    CHUNKED_HEAD,
    LAST_CHUNK,
    SSE_HEAD,
    ScriptedWorker,
    chunk,
    response,
)
from vllm_gateway.app import REGISTRY
from vllm_gateway.config.gateway import TimeoutConfig
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.http.aiohttp_exchange import REQUEST_ID
from vllm_gateway.http.front import FrontConnection

pytestmark = pytest.mark.timeout(30)

BODY = {"model": "m", "prompt": "x"}


@pytest.fixture
async def scripted():
    made: list[ScriptedWorker] = []

    async def make(script) -> ScriptedWorker:
        w = await ScriptedWorker(script).start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.stop()


async def idle_registry(gw) -> None:
    await wait_until(lambda: all(w.inflight == 0 for w in gw.app[REGISTRY]), timeout=3)


async def test_content_length_and_chunked_bodies_arrive_intact(scripted, gateway, http):
    payload = bytes(range(256)) * 400  # 100 KiB, every byte value

    async def script(t, body):
        if b"chunked" in body:
            t.write(CHUNKED_HEAD % b"application/octet-stream")
            for i in range(0, len(payload), 1000):  # 103 chunks, some coalesced on the way
                t.write(chunk(payload[i : i + 1000]))
                if i % 10_000 == 0:
                    await asyncio.sleep(0.001)
            t.write(LAST_CHUNK)
        else:
            t.write(response(200, payload, b"application/octet-stream"))

    w = await scripted(script)
    gw = await gateway([w.url])
    for mode in ("length", "chunked"):
        async with http.post(gw.url + "/v1/x", json={**BODY, "mode": mode}) as r:
            assert r.status == 200
            assert (await r.read()) == payload
            if mode == "length":
                assert r.headers["Content-Length"] == str(len(payload))
            else:
                assert r.headers["Transfer-Encoding"] == "chunked"
    # Both answers were read to their end, so one kept-alive connection carried both.
    assert len(set(w.post_connections)) == 1


async def test_worker_closing_mid_body_is_visible_to_the_client(scripted, gateway, http):
    async def script(t, body):
        if b"sse" in body:
            t.write(SSE_HEAD + chunk(b'data: {"a": 1}\n\ndata: {"partial'))
        else:
            t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 400)
        await asyncio.sleep(0.05)
        t.close()

    w = await scripted(script)
    gw = await gateway([w.url])
    # A plain body is cut: the client cannot mistake it for a whole answer.
    async with http.post(gw.url + "/v1/x", json=BODY) as r:
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    # An event stream ends with an SSE error event, in a new event, and a proper end.
    async with http.post(gw.url + "/v1/x", json={**BODY, "sse": True}) as r:
        text = (await r.read()).decode()
    assert text.startswith('data: {"a": 1}\n\ndata: {"partial\n\ndata: {"error"')
    err = orjson.loads(text.split("\n\n")[2].removeprefix("data: "))["error"]
    assert "mid-answer" in err["message"]
    await idle_registry(gw)
    worker = next(iter(gw.app[REGISTRY]))
    assert worker.failed == 2


async def test_keep_alive_reuse_after_error_but_not_after_unfinished(scripted, gateway, http):
    async def script(t, body):
        if b"error" in body:
            t.write(response(500, b'{"error": {"message": "boom"}}'))
        elif b"endless" in body:
            t.write(SSE_HEAD)
            while True:
                t.write(chunk(b"data: {}\n\n"))
                await asyncio.sleep(0.01)
        else:
            t.write(response(200, b"{}"))

    w = await scripted(script)
    gw = await gateway([w.url])
    async with http.post(gw.url + "/v1/x", json={**BODY, "error": 1}) as r:
        assert r.status == 500 and (await r.json())["error"]["message"] == "boom"
    async with http.post(gw.url + "/v1/x", json=BODY) as r:
        assert r.status == 200
    assert len(w.post_connections) == 2 and w.post_connections[0] == w.post_connections[1]

    # A stream the client leaves unfinished: its connection is closed, never reused.
    r = await http.post(gw.url + "/v1/x", json={**BODY, "endless": 1})
    await r.content.readany()
    r.close()
    await wait_until(lambda: w.closed >= 1, timeout=3)
    async with http.post(gw.url + "/v1/x", json=BODY) as r:
        assert r.status == 200
    assert w.post_connections[3] not in (w.post_connections[2],)
    await idle_registry(gw)


async def test_slow_client_bounds_what_the_gateway_buffers(scripted, gateway):
    total = 64 * 2**20  # 64 MiB, far more than any socket buffer
    piece = b"y" * 65536
    pushed = 0

    async def script(t, body):
        nonlocal pushed
        t.write(CHUNKED_HEAD % b"application/octet-stream")
        framed = chunk(piece)
        while pushed < total:
            t.write(framed)
            pushed += len(piece)
            while t.get_write_buffer_size() > 1 << 20:  # like a server honouring drain
                await asyncio.sleep(0.005)
        t.write(LAST_CHUNK)

    w = await scripted(script)
    gw = await gateway([w.url])
    host, port = gw.url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, int(port)))
    req = orjson.dumps(BODY)
    await loop.sock_sendall(
        sock,
        b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(req), req),
    )
    try:
        # The client reads nothing: the worker must soon be unable to push more.
        await asyncio.sleep(1.0)
        stalled = pushed
        await asyncio.sleep(0.5)
        assert pushed == stalled, "the gateway kept reading from the worker"
        assert pushed < 24 * 2**20, f"{pushed} bytes left the worker for a client reading none"
        # Now the client reads: everything arrives, in order.
        digest, got = hashlib.sha256(), 0
        async with asyncio.timeout(20):
            head = b""
            while b"\r\n\r\n" not in head:
                head += await loop.sock_recv(sock, 65536)
            rest = head.split(b"\r\n\r\n", 1)[1]
            buf = rest
            while not buf.endswith(b"0\r\n\r\n"):
                data = await loop.sock_recv(sock, 1 << 20)
                assert data, "connection closed early"
                buf += data
                # Keep memory small: count and hash whole chunks as they complete.
                while True:
                    size_end = buf.find(b"\r\n")
                    if size_end < 0:
                        break
                    size = int(buf[:size_end], 16)
                    if size == 0 or len(buf) < size_end + 2 + size + 2:
                        break
                    digest.update(buf[size_end + 2 : size_end + 2 + size])
                    got += size
                    buf = buf[size_end + 2 + size + 2 :]
        assert got == total
        expected = hashlib.sha256()
        for _ in range(total // len(piece)):
            expected.update(piece)
        assert digest.digest() == expected.digest()
    finally:
        sock.close()


async def test_one_megabyte_request_body_forwarded_as_is(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([w])
    body = orjson.dumps({"model": "m", "prompt": "z" * (1 << 20), "max_tokens": 2})
    async with http.post(
        gw.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 200
        assert (await r.json())["choices"][0]["text"] == " w0 w1"
    assert w.stats.requests[-1].body == body


async def test_many_small_events_and_a_few_huge_ones(scripted, gateway, http):
    small = [b'data: {"i": %d}\n\n' % i for i in range(3000)]
    huge = [
        b"data: " + bytes([97 + i]) * (size - 8) + b"\n\n"
        for i, size in enumerate((130 * 1024, 300 * 1024, 1 << 20))
    ]

    async def script(t, body):
        t.write(SSE_HEAD)
        events = huge if b"huge" in body else small
        for i, event in enumerate(events):
            t.write(chunk(event))
            if i % 100 == 0:
                await asyncio.sleep(0)
        t.write(chunk(b"data: [DONE]\n\n") + LAST_CHUNK)

    w = await scripted(script)
    gw = await gateway([w.url])
    for kind, events in (("small", small), ("huge", huge)):
        async with http.post(gw.url + "/v1/x", json={**BODY, kind: 1}) as r:
            assert r.headers["Content-Type"] == "text/event-stream"
            got = await r.read()
        assert got == b"".join(events) + b"data: [DONE]\n\n"


async def test_first_byte_and_idle_timeouts(fake_worker, gateway, http):
    w = await fake_worker(models="m", ttft_ms=1, tpot_ms=1)
    gw = await gateway([w], timeouts=TimeoutConfig(first_byte=0.3, idle=0.3))
    url = gw.url + "/v1/completions"
    body = {"model": "m", "prompt": "x", "max_tokens": 20, "stream": True}
    async with http.post(url, json=body, headers={"X-Fake-Fault": "hang"}) as r:
        assert r.status == 504
        assert "no answer within 0.3 s" in (await r.json())["error"]["message"]
    async with http.post(url, json=body, headers={"X-Fake-Fault": "stall_midstream=2"}) as r:
        assert r.status == 200
        text = (await r.read()).decode()
    assert '"error"' in text and "sent nothing for 0.3 s" in text
    await wait_until(lambda: w.stats.running == 0, timeout=3)  # the worker saw the abort
    await idle_registry(gw)


@pytest.mark.parametrize("path", ["front", "aiohttp"])
async def test_request_body_is_released_once_the_answer_streams(fake_worker, gateway, http, path):
    """A long prompt is not held for the whole stream: once the worker's answer is being
    relayed no retry can need it, so neither the bytes nor the parsed JSON stay, whichever
    path served the request (a Content-Encoding sends it through aiohttp, front.py)."""
    w = await fake_worker(models="m", tpot_ms=20, ttft_ms=1)
    gw = await gateway([w])
    prompt = "p" * (256 * 1024)
    body = orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 100, "stream": True})
    headers = {"Content-Encoding": "identity"} if path == "aiohttp" else {}
    async with http.post(gw.url + "/v1/completions", data=body, headers=headers) as r:
        assert r.status == 200
        await r.content.readany()  # the stream has started
        gc.collect()
        rid = r.headers["X-Request-Id"]
        infos = [o for o in gc.get_objects() if isinstance(o, RequestInfo) and o.request_id == rid]
        assert infos, "the stream's RequestInfo should be alive"
        assert all(i.body == b"" and i.prefix_text(10) == "" for i in infos)
        # Nor does the exchange keep a copy (bytes are not tracked by gc: ask their holders).
        fronts = [o for o in gc.get_objects() if isinstance(o, FrontConnection)]
        mine = [o for o in fronts if o.exchange is not None and o.exchange.request_id == rid]
        assert all(
            not c.exchange.body_parts and len(c.reader.pending) + len(c.reader.buf) < 1000
            for c in mine
        )
        requests = [
            o
            for o in gc.get_objects()
            if isinstance(o, web.BaseRequest) and o.get(REQUEST_ID) == rid  # not the worker's
        ]
        assert all(not q._read_bytes for q in requests)  # aiohttp's copy: never made
        assert len(mine if path == "front" else requests) == 1
        r.close()
    assert w.stats.requests[-1].body == body  # the worker got it whole

"""The front path (front.py): which requests it serves, what it hands to aiohttp, and that a
client cannot tell the two apart.

Requests are written as raw bytes (tests/support/rawhttp.py) so framing, pipelining and the exact
answer are visible. A `Content-Encoding: identity` header is a harmless way to send the same
request through aiohttp's path (the front path hands over any Content-Encoding).
"""

from __future__ import annotations

import asyncio
import functools
import sys

import orjson
import pytest

from tests.support.rawhttp import Answer, Connection, exchange, parse, request
from vllm_gateway.app import GATEWAY, create_app
from vllm_gateway.config.gateway import ClientConfig, GatewayConfig
from vllm_gateway.http.front import FRONT, READ_LIMIT
from vllm_gateway.http.gate import GATE
from vllm_gateway.http.server import RunningServer

pytestmark = pytest.mark.timeout(30)

GOOD = b'{"model": "m", "prompt": "x", "max_tokens": 2}'
STREAM = b'{"model": "m", "prompt": "x", "max_tokens": 3, "stream": true}'
VIA_AIOHTTP = {"Content-Encoding": "identity"}


@pytest.fixture
async def served(fake_worker, gateway):
    worker = await fake_worker(models="m", ttft_ms=1, tpot_ms=1)
    limits = ClientConfig(header_timeout=1.0, body_timeout=1.0)
    gw = await gateway([worker], max_body_bytes=4096, client=limits)
    return gw, worker


def counters(gw: RunningServer) -> tuple[int, int]:
    front = gw.app[FRONT]
    return front.served, front.handed_off


def comparable(answer: Answer) -> tuple:
    """An answer without what differs by nature (date, request id, generated ids)."""
    headers = {k: v for k, v in answer.headers.items() if k not in ("date", "x-request-id")}
    body = answer.body
    if answer.headers.get("content-type", "").startswith("application/json"):
        doc = orjson.loads(body)
        if isinstance(doc, dict):
            doc.pop("id", None)
            doc.pop("created", None)
        body = orjson.dumps(doc)
    elif b"data: " in body:
        body = b"".join(
            orjson.dumps(
                {k: v for k, v in orjson.loads(line[6:]).items() if k not in ("id", "created")}
            )
            if line.startswith(b"data: {")
            else line
            for line in body.split(b"\n")
        )
    return answer.status, headers, body


CASES = {
    "answer": (GOOD, "/v1/completions", {}),
    "stream": (STREAM, "/v1/completions", {}),
    "unknown model": (b'{"model": "nope"}', "/v1/completions", {}),
    "not JSON": (b"{nope", "/v1/chat/completions", {}),
    "no body": (b"", "/tokenize", {}),
    "too large": (b'{"model": "m", "prompt": "' + b"y" * 5000 + b'"}', "/v1/completions", {}),
    "client request id": (GOOD, "/v1/completions", {"X-Request-Id": "mine-1"}),
    "query string": (GOOD, "/v1/completions?a=1&b=two", {}),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_the_front_path_answers_as_aiohttp_does(served, case):
    gw, worker = served
    body, path, headers = CASES[case]
    served_before, handed_before = counters(gw)
    native = await exchange(gw.port, request(body, path=path, headers=headers))
    assert counters(gw) == (served_before + 1, handed_before)
    target = worker.stats.requests[-1].path if worker.stats.requests else None
    seen = {id(r) for r in worker.stats.requests}
    via = await exchange(gw.port, request(body, path=path, headers={**headers, **VIA_AIOHTTP}))
    assert counters(gw)[1] == handed_before + 1
    assert comparable(native) == comparable(via)
    assert native.closed == via.closed
    if case == "client request id":
        assert native.headers["x-request-id"] == via.headers["x-request-id"] == "mine-1"
    if native.status == 200:
        # The same target reached the worker (among what it got since: the gateway's own
        # model probe, GET /v1/models, may land in between).
        assert target in [r.path for r in worker.stats.requests if id(r) not in seen]


async def test_other_requests_on_a_connection_go_to_aiohttp_in_order(served):
    gw, _worker = served
    conn = await Connection.open(gw.port)
    try:
        first = await conn.send(request(GOOD, close=False))
        assert first.status == 200 and counters(gw) == (1, 0)
        health = await conn.send(b"GET /health HTTP/1.1\r\nHost: g\r\n\r\n")
        assert health.status == 200 and orjson.loads(health.body)["status"] == "ok"
        assert counters(gw) == (1, 1)
        # aiohttp owns the connection from then on, relay requests included.
        again = await conn.send(request(GOOD, close=False))
        assert again.status == 200 and counters(gw) == (1, 1)
    finally:
        conn.close()


async def test_pipelined_requests_are_answered_in_order(served):
    gw, _worker = served
    ids = [f"pipe-{i}" for i in range(5)]
    data = b"".join(request(GOOD, headers={"X-Request-Id": i}, close=False) for i in ids)
    data += b"GET /health HTTP/1.1\r\nHost: g\r\n\r\n"  # then one for aiohttp
    data += request(STREAM, headers={"X-Request-Id": "last"})
    answers = await read_answers(gw.port, data, 7)
    assert [a.headers.get("x-request-id") for a in answers[:5]] == ids
    assert all(a.status == 200 for a in answers)
    assert orjson.loads(answers[5].body)["status"] == "ok"
    assert answers[6].headers["x-request-id"] == "last"
    assert answers[6].body.rstrip().endswith(b"data: [DONE]")
    assert counters(gw) == (5, 1)


async def test_pipelined_requests_behind_a_stream_wait_in_a_bounded_buffer(fake_worker, gateway):
    """A client that pipelines megabytes of requests behind a slow stream: the gateway reads
    about READ_LIMIT of them, then stops reading until the stream's answer is out (the rest
    waits in the kernel's socket buffers); then every request is answered, in order."""
    worker = await fake_worker(models="m", ttft_ms=1, tpot_ms=40)
    gw = await gateway([worker])
    slow = b'{"model": "m", "prompt": "x", "max_tokens": 25, "stream": true}'  # about 1 s
    big = orjson.dumps({"model": "m", "prompt": "p" * (64 * 1024), "max_tokens": 1})
    ids = [f"big-{i}" for i in range(40)]  # 40 x 64 KiB: 2.6 MB behind the stream
    data = request(slow, headers={"X-Request-Id": "slow"}, close=False)
    data += b"".join(request(big, headers={"X-Request-Id": i}, close=False) for i in ids)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(data)
        front = gw.app[FRONT]
        async with asyncio.timeout(10):
            while not front.connections:
                await asyncio.sleep(0.01)
        (conn,) = front.connections
        largest, paused = 0, False
        for _ in range(25):  # 0.5 s without reading an answer
            largest = max(largest, len(conn.reader.buf), len(conn.reader.pending))
            paused = paused or conn.read_paused
            await asyncio.sleep(0.02)
        assert paused, "reading did not pause behind the stream"
        assert largest < READ_LIMIT + 512 * 1024 < len(data) // 2, largest
        answers = await read_from(reader, 41)
    finally:
        writer.close()
    assert [a.headers["x-request-id"] for a in answers] == ["slow", *ids]
    assert all(a.status == 200 for a in answers)
    assert answers[0].body.rstrip().endswith(b"data: [DONE]")


async def test_chunked_bodies_in_pieces_with_a_request_right_after(served):
    gw, worker = served
    head = b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
    # A chunk holding CRLF CRLF, a chunk extension and a trailer: the end is still found.
    pieces = [GOOD[:10], b"       \r\n\r\n  ", GOOD[10:]]
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces[:2])
    body += b"%x;ext=1\r\n%s\r\n" % (len(pieces[2]), pieces[2])
    body += b"0\r\nX-Trailer: t\r\n\r\n"
    then = request(GOOD, headers={"X-Request-Id": "next"})
    stream = head + body + then
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        for i in range(0, len(stream), 7):  # 7 bytes at a time: every split point is met
            writer.write(stream[i : i + 7])
            await writer.drain()
            await asyncio.sleep(0)
        answers = await read_from(reader, 2)
    finally:
        writer.close()
    assert [a.status for a in answers] == [200, 200]
    assert answers[1].headers["x-request-id"] == "next"
    relayed = [r for r in worker.stats.requests if r.path == "/v1/completions"]
    assert relayed[0].body == b"".join(pieces) and relayed[1].body == GOOD
    assert "X-Trailer" not in relayed[0].headers
    assert counters(gw) == (2, 0)


BAD_CHUNKS = {
    "bad size": (b"zz\r\n" + GOOD + b"\r\n0\r\n\r\n", 400),
    "no CRLF after the data": (b"%x\r\n" % len(GOOD) + GOOD + b"XX0\r\n\r\n", 400),
    "cut short": (b"%x\r\n" % len(GOOD) + GOOD[:20], 408),  # the rest never comes
}


@pytest.mark.parametrize("case", list(BAD_CHUNKS))
async def test_bad_chunk_framing_is_a_400_that_closes(served, case):
    gw, worker = served
    chunks, status = BAD_CHUNKS[case]
    data = b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer = await exchange(gw.port, data + chunks)
    code = "malformed_request" if status == 400 else "request_timeout"
    assert answer.status == status and answer.error()["code"] == code
    assert answer.closed
    assert not [r for r in worker.stats.requests if r.path == "/v1/completions"]
    assert counters(gw) == (1, 0)


TRAILERS = {
    "300 trailer lines": b"0\r\n" + b"X-T: 1\r\n" * 300 + b"\r\n",
    "a 20 kB trailer": b"0\r\nX-T: " + b"a" * 20_000 + b"\r\n\r\n",
    # Never ends: without a bound the parser would hold all of it until the body timeout.
    "an endless trailer": b"0\r\nX-T: " + b"a" * 2_000_000,
}


@pytest.mark.parametrize("case", list(TRAILERS))
async def test_trailers_are_bounded_as_headers_are(served, case):
    """A chunked body's trailers are not kept, but each line and their count are bounded by
    the limits on headers (431), as aiohttp bounds them, and nothing reaches a worker."""
    gw, worker = served
    body = b"%x\r\n%s\r\n" % (len(GOOD), GOOD) + TRAILERS[case]
    head = b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n"
    # The front path, then aiohttp's; not for the endless one: aiohttp closes at once, so a
    # client still sending may see a reset there instead of the 431.
    vias = [b"", b"Content-Encoding: identity\r\n"][: 1 if case == "an endless trailer" else 2]
    for via in vias:
        data = head + via + b"\r\n" + body
        answer = await exchange(gw.port, [data[i : i + 65536] for i in range(0, len(data), 65536)])
        assert answer.status == 431 and answer.error()["code"] == "malformed_request", via
        assert answer.closed
    assert not [r for r in worker.stats.requests if r.path == "/v1/completions"]
    assert counters(gw) == (1, len(vias) - 1)


async def test_a_body_in_tiny_chunks_is_held_in_about_its_own_size(fake_worker, gateway):
    """A chunked body of 200,000 two-byte chunks (400 kB) is held in about 400 kB while it
    arrives, not in an object per chunk (about 20 times the body), as aiohttp holds it."""
    worker = await fake_worker(models="m")
    gw = await gateway([worker], max_body_bytes=1 << 20, client=ClientConfig(body_timeout=10))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b'{"model": "m", "max_tokens": 1, "prompt": "' + b"ab" * 200_000 + b'"}'
    pieces = [body[i : i + 2] for i in range(0, len(body), 2)]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(head + chunks)  # not the last chunk yet: the body is held
        front = gw.app[FRONT]
        async with asyncio.timeout(10):
            while not front.connections or next(iter(front.connections)).reader.body_size < len(
                body
            ):
                await asyncio.sleep(0.01)
        (conn,) = front.connections
        parts = conn.exchange.body_parts
        held = sys.getsizeof(parts) + sum(sys.getsizeof(p) for p in parts)
        assert held < 2 * len(body), held
        writer.write(b"0\r\n\r\n")
        (answer,) = await read_from(reader, 1)
    finally:
        writer.close()
    assert answer.status == 200
    assert worker.stats.last("/v1/completions").body == body


async def test_connection_close_and_http_1_0(served):
    gw, _worker = served
    answer = await exchange(gw.port, request(GOOD, close=True))
    assert answer.status == 200 and answer.closed and answer.headers["connection"] == "close"
    old = request(GOOD, close=False).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    answer = await exchange(gw.port, old)
    assert answer.status == 200 and answer.closed
    assert counters(gw) == (1, 1)  # HTTP/1.0 is aiohttp's


async def test_an_idle_connection_is_closed_after_the_header_timeout(served):
    gw, _worker = served
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(request(GOOD, close=False))
        answers = await read_from(reader, 1)
        assert answers[0].status == 200
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed by the gateway
        assert 0.8 < loop.time() - t0 < 4  # header_timeout is 1 s
    finally:
        writer.close()


async def test_shutdown_closes_idle_connections_and_lets_answers_finish(fake_worker):
    from vllm_gateway.config.gateway import WorkerSpec
    from vllm_gateway.http.server import start_server

    worker = await fake_worker(models="m", ttft_ms=1, tpot_ms=30)
    config = GatewayConfig(workers=(WorkerSpec(url=worker.url),))
    gw = await start_server(create_app(config), "127.0.0.1", 0, shutdown_timeout=5)
    try:
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", gw.port)
        busy_r, busy_w = await asyncio.open_connection("127.0.0.1", gw.port)
        body = b'{"model": "m", "prompt": "x", "max_tokens": 20, "stream": true}'
        busy_w.write(request(body, close=False))
        await busy_r.readuntil(b"data: ")  # streaming
        assert len(gw.app[FRONT].connections) == 2
        await gw.stop_listening()
        async with asyncio.timeout(3):
            assert await idle_r.read() == b""  # the idle one is closed at once
        async with asyncio.timeout(5):
            rest = await busy_r.read()  # the stream finishes, then the connection closes
        assert b"data: [DONE]" in rest and rest.endswith(b"0\r\n\r\n")
    finally:
        idle_w.close()
        busy_w.close()
        await gw.stop()


def test_both_paths_call_the_one_gate():
    """Nothing is mirrored by hand: aiohttp's first middleware (the siblings' fan-out aside,
    which skips relay paths) is the gate's, and the front path serves a request with the
    same gate's `serve`. Something every request needs goes into the gate, for both; inside
    it only the CORS preflight answer (OPTIONS, never the front path's)."""
    app = create_app(GatewayConfig())
    gate = app[GATE]
    names = [getattr(m, "__name__", repr(m)) for m in app.middlewares]
    assert app.middlewares[0] == gate.middleware and names[1:] == ["answer_preflight"], names
    serve = app[FRONT].serve
    assert isinstance(serve, functools.partial) and serve.func == gate.serve
    assert serve.keywords == {"handle": app[GATEWAY].routes.relay_exchange}


# --- helpers ---------------------------------------------------------------------------------


async def read_from(reader: asyncio.StreamReader, count: int) -> list[Answer]:
    buf = b""
    answers: list[Answer] = []
    async with asyncio.timeout(10):
        while len(answers) < count:
            while (parsed := parse(buf)) is not None and len(answers) < count:
                answer, used = parsed
                answers.append(answer)
                buf = buf[used:]
            if len(answers) < count:
                chunk = await reader.read(65536)
                assert chunk, (answers, buf[:200])
                buf += chunk
    return answers


async def read_answers(port: int, data: bytes, count: int) -> list[Answer]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await read_from(reader, count)
    finally:
        writer.close()


HANDED_OVER = {
    "Upgrade with Connection: upgrade": (
        request(GOOD, headers={"Connection": "upgrade", "Upgrade": "websocket"}),
        200,
    ),
    "Upgrade alone": (request(GOOD, headers={"Upgrade": "h2c"}), 200),
    "Expect: 100-continue": (request(GOOD, headers={"Expect": "100-continue"}), 200),
    "Content-Encoding": (request(GOOD, headers=VIA_AIOHTTP), 200),
    "HTTP/1.0": (request(GOOD).replace(b"HTTP/1.1", b"HTTP/1.0", 1), 200),
    "two Host headers": (request(GOOD, headers={"Host": "again"}), 400),
    "NUL in a value": (request(GOOD, headers={"X-A": "a\x00b"}), 400),
    "a percent-escape": (request(GOOD, path="/v1/completion%73"), 200),
    "a plus in the query": (request(GOOD, path="/v1/completions?a=b+c"), 200),
    # Refused by aiohttp's path (routes.has_dot_segment): never relayed.
    "a dot segment": (request(GOOD, path="/v1/x/../completions"), 404),
    "GET of a model path": (
        b"GET /v1/models HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n",
        200,
    ),
    "another path": (request(GOOD, path="/list_models"), 200),
    "absolute-form target": (request(GOOD, path="http://g/v1/completions"), 200),
    "a bad header line": (request(GOOD, headers={"Bad Name": "x"}), 400),
    # aiohttp refuses the old websocket handshake's header; the worker must not be asked.
    "Sec-WebSocket-Key1": (request(GOOD, headers={"Sec-WebSocket-Key1": "x"}), 400),
}


@pytest.mark.parametrize("case", list(HANDED_OVER))
async def test_unusual_requests_are_handed_to_aiohttp(served, case):
    gw, _ = served
    data, status = HANDED_OVER[case]
    answer = await exchange(gw.port, data)
    assert answer.status == status, answer
    if status == 400:
        assert answer.error()["code"] == "malformed_request"
    assert counters(gw) == (0, 1)


async def test_client_front_path_false_serves_everything_with_aiohttp(fake_worker, gateway):
    worker = await fake_worker(models="m", ttft_ms=1, tpot_ms=1)
    on = await gateway([worker])
    off = await gateway([worker], client=ClientConfig(front_path=False))
    assert on.runner.server.front is on.app[FRONT]  # type: ignore[union-attr]
    assert FRONT not in off.app and off.runner.server.front is None  # type: ignore[union-attr]
    answer = await exchange(off.port, request(STREAM))
    assert answer.status == 200 and answer.body.rstrip().endswith(b"data: [DONE]")
    assert worker.stats.requests[-1].path == "/v1/completions"
    assert on.app[FRONT].served == 0  # the other gateway's front path saw nothing

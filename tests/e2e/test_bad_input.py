"""Bad input from clients, over raw sockets: a clean 4xx, nothing reaches a worker, and the
gateway keeps serving.

Each test proves rows of docs/reliability.md. Requests no client library would send (request
smuggling, oversized or malformed headers, slow-loris clients) are written byte by byte with
tests/support/rawhttp.py.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import time

import orjson
import pytest

from tests.conftest import wait_until
from tests.support.rawhttp import Connection, exchange, request
from vllm_gateway.app import REGISTRY
from vllm_gateway.config.gateway import ApiKeyConfig, AuthConfig, ClientConfig, TimeoutConfig
from vllm_gateway.fake_worker import FakeWorker
from vllm_gateway.http.keys import hash_key
from vllm_gateway.http.server import RunningServer

pytestmark = pytest.mark.timeout(30)

GOOD = b'{"model": "m", "prompt": "x", "max_tokens": 1}'


def completions(worker: FakeWorker) -> int:
    """Inference requests the worker received (probes aside)."""
    return sum(1 for r in worker.stats.requests if r.path.startswith("/v1/c"))


async def still_serves(gw: RunningServer, worker: FakeWorker) -> None:
    """A good request after the bad ones gets its answer; nothing is left in flight."""
    before = completions(worker)
    answer = await exchange(gw.port, request(GOOD))
    assert answer.status == 200, answer
    assert orjson.loads(answer.body)["choices"][0]["text"] == " w0"
    assert completions(worker) == before + 1
    registry = gw.app[REGISTRY]
    await wait_until(lambda: all(w.inflight == 0 for w in registry), timeout=3)


@pytest.fixture
async def served(fake_worker, gateway):
    """A gateway in front of one fake worker serving `m`, with short client limits."""
    worker = await fake_worker(models=("m", "org/model-v2"))
    limits = ClientConfig(header_timeout=1.0, body_timeout=1.0)
    gw = await gateway([worker], max_body_bytes=4096, client=limits)
    return gw, worker


# --- HTTP framing -------------------------------------------------------------------------

SMUGGLING = {
    "content-length and chunked": (
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n2f\r\n" + GOOD + b"\r\n0\r\n\r\n"
    ),
    "chunked and content-length": (
        b"Transfer-Encoding: chunked\r\nContent-Length: 47\r\n\r\n2f\r\n" + GOOD + b"\r\n0\r\n\r\n"
    ),
    "two different lengths": b"Content-Length: 47\r\nContent-Length: 5\r\n\r\n" + GOOD,
    "chunked, identity": b"Transfer-Encoding: chunked, identity\r\n\r\n" + GOOD,
    "unknown coding": b"Transfer-Encoding: xchunked\r\n\r\n" + GOOD,
    "space before colon": b"Content-Length : 47\r\n\r\n" + GOOD,
    "obsolete line folding": b"X-A: a\r\n b\r\nContent-Length: 47\r\n\r\n" + GOOD,
    "bare CR in a value": b"X-A: a\rb\r\nContent-Length: 47\r\n\r\n" + GOOD,
    "negative length": b"Content-Length: -1\r\n\r\n" + GOOD,
    "signed length": b"Content-Length: +47\r\n\r\n" + GOOD,
    "length in hex": b"Content-Length: 0x2f\r\n\r\n" + GOOD,
}


@pytest.mark.parametrize("case", list(SMUGGLING))
async def test_request_smuggling_is_refused(served, case):
    gw, worker = served
    data = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n" + SMUGGLING[case]
    answer = await exchange(gw.port, data)
    assert answer.status == 400
    assert answer.error()["code"] == "malformed_request"
    assert answer.closed  # framing that cannot be trusted ends the connection
    assert completions(worker) == 0
    await still_serves(gw, worker)


async def test_a_length_with_thousands_of_leading_zeros_is_read_by_its_value(served, logs):
    """The parser reads `Content-Length: 000...047` by its value; Python's int() refuses a
    string of more than 4,300 digits. On either path the request is served, not a 500."""
    gw, worker = served
    for via in ({}, {"Content-Encoding": "identity"}):  # the front path, aiohttp's
        data = request(GOOD, headers=via)
        data = data.replace(b"Content-Length: ", b"Content-Length: " + b"0" * 5000, 1)
        answer = await exchange(gw.port, data)
        assert answer.status == 200, answer
    assert completions(worker) == 2
    # The control APIs read their small bodies the same way.
    data = request(orjson.dumps({"worker_name": worker.url}), path="/register_worker")
    data = data.replace(b"Content-Length: ", b"Content-Length: " + b"0" * 5000, 1)
    answer = await exchange(gw.port, data)
    assert answer.status == 200, answer
    assert not [r for r in logs.records() if r.get("level") == "error"]


async def test_bytes_after_the_body_are_the_next_request_never_the_workers(served):
    gw, worker = served
    # A body with an HTTP request inside a JSON string, then a second request on the same
    # connection: the worker gets the first body exactly, framed by the gateway's own length.
    inner = '"x\\r\\n\\r\\nGET /admin HTTP/1.1\\r\\nHost: w\\r\\n\\r\\n"'
    body = b'{"model": "m", "max_tokens": 1, "prompt": ' + inner.encode() + b"}"
    data = request(body, close=False) + request(GOOD, path="/nothing-here")
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(data)
    raw = b""
    async with asyncio.timeout(5):
        while raw.count(b"HTTP/1.1 ") < 2 or not raw.endswith(b"}"):
            raw += await reader.read(65536)
    writer.close()
    assert raw.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 404" in raw
    paths = [r.path for r in worker.stats.requests if r.path != "/v1/models"]
    assert paths == ["/v1/completions"]
    record = worker.stats.last("/v1/completions")
    assert record.body == body
    assert record.headers["Content-Length"] == str(len(body))


async def test_chunked_body_reaches_the_worker_with_a_length(served):
    gw, worker = served
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: chunked\r\n"
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (GOOD[:16], GOOD[16:], b""))
    data = head + b"Connection: close\r\n\r\n" + chunks
    answer = await exchange(gw.port, data)
    assert answer.status == 200
    record = worker.stats.last("/v1/completions")
    assert record.body == GOOD and "Transfer-Encoding" not in record.headers


@pytest.mark.parametrize(
    "case",
    ["one huge header", "too many headers", "huge request line"],
)
async def test_oversized_headers_get_431(served, case):
    gw, worker = served
    if case == "one huge header":
        data = request(GOOD, headers={"X-Big": "a" * 20_000})
    elif case == "too many headers":
        data = request(GOOD, headers=[(f"X-H{i}", "v") for i in range(300)])
    else:
        data = request(GOOD, path="/v1/" + "a" * 20_000)
    answer = await exchange(gw.port, data)
    assert answer.status == 431 and answer.error()["code"] == "malformed_request"
    assert answer.closed and completions(worker) == 0
    await still_serves(gw, worker)


async def test_not_http_at_all_gets_400(served):
    gw, worker = served
    tls_hello = b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(32))
    for data in (tls_hello, b"GET\r\n\r\n", b"POST / HTTP/9.9\r\n\r\n", b"GET / HTTP/1.1\r\n\r\n"):
        answer = await exchange(gw.port, data)
        assert answer.status == 400 and answer.error()["code"] == "malformed_request", data
    answer = await exchange(gw.port, request(GOOD).replace(b"POST", b"BREW", 1))
    assert answer.status == 400 and answer.error()["code"] == "malformed_request"
    answer = await exchange(gw.port, request(GOOD).replace(b"POST", b"PATCH", 1))
    assert answer.status == 405 and answer.error()["code"] == "unknown_url"
    await still_serves(gw, worker)


async def test_invalid_utf8_in_a_header_is_harmless(served):
    gw, worker = served
    data = request(GOOD, headers={"X-Note": "caf\xe9 \xff\xfe"})  # latin-1 bytes, not UTF-8
    answer = await exchange(gw.port, data)
    assert answer.status == 200
    await still_serves(gw, worker)


async def test_hostile_request_ids_are_replaced(served):
    gw, worker = served
    for given in ("a" * 500, "two words", "caf\xe9"):
        answer = await exchange(gw.port, request(GOOD, headers={"X-Request-Id": given}))
        assert answer.status == 200
        assert answer.headers["x-request-id"].startswith("gw-")
        assert worker.stats.last("/v1/completions").headers["X-Request-Id"].startswith("gw-")
    answer = await exchange(gw.port, request(GOOD, headers={"X-Request-Id": "trace-42.a_b"}))
    assert answer.headers["x-request-id"] == "trace-42.a_b"


# --- slow clients ---------------------------------------------------------------------------


async def test_slow_loris_headers_are_cut_at_the_header_timeout(served):
    gw, worker = served
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nX-Slow: " + b"a" * 500

    async def loris() -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        t0 = time.monotonic()
        try:
            for byte in head:  # one byte every 50 ms: 25 s if nobody stopped it
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)
                if reader.at_eof():
                    break
            else:
                raise AssertionError("the gateway read slow headers for ever")
        except ConnectionError:
            pass
        finally:
            writer.close()
        return time.monotonic() - t0

    async def read_eof(reader: asyncio.StreamReader) -> None:
        await reader.read()

    lorises = [asyncio.create_task(loris()) for _ in range(20)]
    await asyncio.sleep(0.2)
    await still_serves(gw, worker)  # the lorises hold no slot a real client needs
    elapsed = await asyncio.gather(*lorises)
    # header_timeout is 1 s; allow for a loaded machine, but far below 25 s.
    assert all(0.9 < e < 5 for e in elapsed), elapsed
    await still_serves(gw, worker)


async def test_slow_body_gets_408_and_reaches_no_worker(served):
    gw, worker = served
    head = request(GOOD)[: -len(GOOD)]  # headers promising 47 bytes
    t0 = time.monotonic()
    answer = await exchange(gw.port, [head, GOOD[:10]], timeout=5)  # ...and 10 of them
    assert answer.status == 408 and answer.error()["code"] == "request_timeout"
    assert 0.9 < time.monotonic() - t0 < 4
    assert answer.headers["connection"] == "close"  # the rest of that body is not awaited
    assert completions(worker) == 0
    await still_serves(gw, worker)


async def test_client_that_stops_reading_is_let_go(fake_worker, gateway):
    w = await fake_worker(models="m", tpot_ms=5)
    gw = await gateway([w], timeouts=TimeoutConfig(connect=1, first_byte=5, idle=0.5))
    body = orjson.dumps({"model": "m", "prompt": "x", "max_tokens": 2000, "stream": True})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gw.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    # An 8 MB event, more than the socket buffers hold, then tokens for 10 s.
    writer.write(request(body, headers={"X-Fake-Fault": "huge_event=8000000"}))
    await reader.readuntil(b"\r\n\r\n")  # the stream started... and is never read again
    t0 = time.monotonic()
    registry = gw.app[REGISTRY]
    await wait_until(lambda: all(x.inflight == 0 for x in registry), timeout=10)
    await w.wait_for(lambda s: s.running == 0, timeout=3)
    assert time.monotonic() - t0 < 5  # let go after the idle limit, not after 10 s of tokens
    assert w.stats.last("/v1/completions").outcome == "aborted"  # the worker's slot is free
    writer.close()


# --- bodies --------------------------------------------------------------------------------


async def test_huge_bodies_get_413_without_being_read(served):
    gw, worker = served
    # Announced: refused from the header alone, before any of the 10 GB is sent.
    data = b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 10000000000\r\n\r\n"
    answer = await exchange(gw.port, data)
    assert answer.status == 413 and answer.error()["code"] == "request_too_large"
    # Just over the limit (4096), by length and chunked; exactly at it is fine.
    over = b'{"model": "m", "prompt": "' + b"y" * 4096 + b'"}'
    assert (await exchange(gw.port, request(over))).status == 413
    chunked = b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    data = b"POST /v1/completions HTTP/1.1\r\nHost: g\r\n" + chunked
    data += b"%x\r\n%s\r\n0\r\n\r\n" % (len(over), over)
    answer = await exchange(gw.port, data)
    assert answer.status == 413 and answer.error()["code"] == "request_too_large"
    at_limit = b'{"model": "m", "max_tokens": 1, "prompt": "' + b"z" * 4000
    at_limit += b" " * (4096 - len(at_limit) - 2) + b'"}'
    assert len(at_limit) == 4096
    assert (await exchange(gw.port, request(at_limit))).status == 200
    assert completions(worker) == 1
    await still_serves(gw, worker)


async def test_an_early_answer_reaches_a_client_still_sending_its_body(fake_worker, gateway):
    """401 (no key) and 413 (too large) are answered before the body is read. A client that
    writes its whole body before it reads (as HTTP client libraries do) gets that answer on
    either path, not a connection reset: the rest of the body is read and dropped."""
    worker = await fake_worker(models="m")
    keys = AuthConfig(keys={"k": ApiKeyConfig(sha256=hash_key("sk-right"))})
    limits = ClientConfig(header_timeout=20.0, body_timeout=2.0)  # the linger's limit is 2 s
    gw = await gateway([worker], max_body_bytes=64 * 1024, auth=keys, client=limits)
    big = b'{"model": "m", "prompt": "' + b"y" * 2_000_000 + b'"}'  # 2 MB, sent 64 KiB a write
    key = {"Authorization": "Bearer sk-right"}
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in split(big)) + b"0\r\n\r\n"
    chunked = {**key, "Transfer-Encoding": "chunked"}
    cases = [
        (request(big), 401, "invalid_api_key"),
        (request(big, headers=key), 413, "request_too_large"),
        (request(b"", headers=chunked, length=False) + chunks, 413, "request_too_large"),
    ]
    for data, status, code in cases:
        for via in (b"", b"Content-Encoding: identity\r\n"):  # the front path, aiohttp's
            sent = data.replace(b"\r\n", b"\r\n" + via, 1)
            answer = await exchange(gw.port, split(sent))
            assert answer.status == status and answer.error()["code"] == code, (via, answer)
            assert answer.closed
    assert completions(worker) == 0
    # The rest of a refused body is dropped for at most client.body_timeout, then the
    # connection closes, even if the client never stops sending.
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 10000000000\r\n\r\n"
    writer.write(head)
    await reader.readuntil(b"\r\n\r\n")  # the 401
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 15:  # 15 s if nobody stopped it
            writer.write(b"x" * 1000)
            await writer.drain()
            await asyncio.sleep(0.05)
    except ConnectionError:
        pass
    finally:
        writer.close()
    assert time.monotonic() - t0 < 8, "the rest of the body was read for ever"
    await still_serves_with_key(gw, worker, key)


def split(data: bytes, size: int = 65536) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


async def still_serves_with_key(gw: RunningServer, worker: FakeWorker, key: dict) -> None:
    answer = await exchange(gw.port, request(GOOD, headers=key))
    assert answer.status == 200, answer
    assert completions(worker) == 1


async def test_compressed_bodies_are_decoded_once_and_bombs_refused(served):
    gw, worker = served
    body = orjson.dumps({"model": "m", "prompt": "x", "max_tokens": 1})
    gz = {"Content-Encoding": "gzip"}
    answer = await exchange(gw.port, request(gzip.compress(body), headers=gz))
    assert answer.status == 200
    record = worker.stats.last("/v1/completions")
    # The gateway decoded it, so it goes out decoded, without the coding header.
    assert record.body == body and "Content-Encoding" not in record.headers
    # A body that is not in the coding it claims: 400, not a gateway failure.
    answer = await exchange(gw.port, request(body, headers=gz))
    assert answer.status == 400 and "Content-Encoding: gzip" in answer.error()["message"]
    # 20 kB of gzip that would inflate to 20 MB: refused at the limit (4096 bytes here).
    bomb = gzip.compress(b'{"model": "m", "prompt": "' + b"0" * 20_000_000 + b'"}', 9)
    answer = await exchange(gw.port, request(bomb, headers=gz))
    assert answer.status == 413 and answer.error()["code"] == "request_too_large"
    assert completions(worker) == 1
    await still_serves(gw, worker)


async def test_expect_headers(served):
    gw, worker = served
    answer = await exchange(gw.port, request(GOOD, headers={"Expect": "100-continue"}))
    assert answer.status == 200 and orjson.loads(answer.body)["choices"]
    # The gateway met the expectation itself: the worker gets the body, not the question.
    assert "Expect" not in worker.stats.last("/v1/completions").headers
    answer = await exchange(gw.port, request(GOOD, headers={"Expect": "coffee"}))
    assert answer.status == 417 and answer.error()["code"] == "expectation_failed"
    assert completions(worker) == 1


BAD_BODIES = {
    "empty": (b"", None),
    "not JSON": (b"{not json", None),
    "truncated JSON": (GOOD[:-3], None),
    "JSON array": (b'[{"model": "m"}]', None),
    "JSON string": (b'"m"', None),
    "JSON number": (b"42", None),
    "JSON null": (b"null", None),
    "no model": (b'{"prompt": "x"}', "model"),
    "model is a number": (b'{"model": 7}', "model"),
    "model is a list": (b'{"model": ["m"]}', "model"),
    "model is null": (b'{"model": null}', "model"),
    "model is an object": (b'{"model": {"name": "m"}}', "model"),
    "model is empty": (b'{"model": ""}', "model"),
    "stream is a string": (b'{"model": "m", "stream": "true"}', "stream"),
    "stream is a number": (b'{"model": "m", "stream": 1}', "stream"),
    "invalid UTF-8": (b'{"model": "m\xff\xfe", "prompt": "x"}', None),
    "lone surrogate": (b'{"model": "m", "prompt": "\\ud800"}', None),
    "NaN": (b'{"model": "m", "temperature": NaN}', None),
    "nested 1,500 deep": (b'{"model": "m", "x": ' + b"[" * 1500 + b"]" * 1500 + b"}", None),
    "model with CR LF": (b'{"model": "m\\r\\nX-Injected: 1"}', "model"),
    "model with NUL": (b'{"model": "m\\u0000"}', "model"),
    "model too long": (b'{"model": "' + b"m" * 600 + b'"}', "model"),
}


async def test_bad_bodies_get_400_and_the_connection_goes_on(served):
    gw, worker = served
    # All on one keep-alive connection: a bad body is not bad framing, so the connection
    # stays usable, and a good request on it afterwards is served.
    conn = await Connection.open(gw.port)
    try:
        for case, (body, param) in BAD_BODIES.items():
            answer = await conn.send(request(body, close=False))
            assert answer.status == 400, (case, answer)
            error = answer.error()
            assert error["type"] == "invalid_request_error", case
            assert error["param"] == param, (case, error)
        assert (await conn.send(request(GOOD, close=False))).status == 200
    finally:
        conn.close()
    assert completions(worker) == 1


async def test_model_names_with_path_characters_reach_no_worker(served):
    gw, worker = served
    for model in ("../../admin", "/etc/passwd", "m/../m", "%2e%2e/m", "m?x=1", "m#f", " m"):
        answer = await exchange(gw.port, request(orjson.dumps({"model": model, "prompt": "x"})))
        assert answer.status == 404 and answer.error()["code"] == "model_not_found", model
    assert completions(worker) == 0
    # A slash is legal in a model name ("org/name") and served as any other.
    body = orjson.dumps({"model": "org/model-v2", "prompt": "x", "max_tokens": 1})
    assert (await exchange(gw.port, request(body))).status == 200


@pytest.mark.parametrize(
    "target",
    [
        "/v1/%2e%2e/reset_prefix_cache",
        "/v1/%2E%2E/%2e%2e/sleep",
        "/v1/./completions",
        "/v1/x/..",
        "/v1/%5c..%5creset_prefix_cache",
        "/v1/completions%5C",
        "/v1/x\\y",
    ],
)
async def test_dot_segments_in_a_target_reach_no_worker(served, target):
    """aiohttp decodes `%2e%2e` to `..` and `%5c` to a backslash: relayed, a worker behind a
    proxy that resolves dot segments (or takes `\\` for `/`) could be reached outside the
    model paths. Refused, on either server path."""
    gw, worker = served
    for via in ({}, {"Content-Encoding": "identity"}):
        answer = await exchange(gw.port, request(GOOD, path=target, headers=via))
        if answer.status == 400:  # a raw backslash: aiohttp's parser may refuse it outright
            assert answer.error()["code"] == "malformed_request", answer
            continue
        assert answer.status == 404 and answer.error()["code"] == "unknown_url", answer
    assert all(
        ".." not in r.path and "/./" not in r.path and "\\" not in r.path and "%5" not in r.path
        for r in worker.stats.requests
    )
    assert completions(worker) == 0
    await still_serves(gw, worker)

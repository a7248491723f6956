"""What one client connection may cost before it is anyone's (no key is checked before a
head is whole): a head's total size (`client.max_head_bytes`: 431, then closed) and the
number of open connections (`client.max_connections`: 503, then closed), on the front path,
on aiohttp's path after a hand-over, and with the front path off (guard.py)."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
import pytest

from tests.support.rawhttp import Answer, parse, request
from vllm_gateway.config.gateway import ApiKeyConfig, AuthConfig, ClientConfig
from vllm_gateway.http.keys import hash_key

pytestmark = pytest.mark.timeout(30)

GOOD = b'{"model": "m", "prompt": "x", "max_tokens": 2}'
KEYS = AuthConfig(keys={"a": ApiKeyConfig(sha256=hash_key("sk-gw-test-key"))})
HEALTH = b"GET /health HTTP/1.1\r\nHost: g\r\n\r\n"
# The attack: lines under the line limit, their number under the count limit,
# never a whole head (120 x 8,100 bytes: about 1 MB a connection).
PAD = b"a" * 8100
LINES = [b"X-Pad-%d: %s\r\n" % (i, PAD) for i in range(120)]
PATHS = ["front", "handed over", "front path off"]


async def read_answer(reader: asyncio.StreamReader, timeout: float = 5.0) -> Answer:
    buf = b""
    async with asyncio.timeout(timeout):
        while (parsed := parse(buf)) is None:
            chunk = await reader.read(65536)
            assert chunk, buf[:300]
            buf += chunk
    return parsed[0]


async def answer_or_none(reader: asyncio.StreamReader) -> Answer | None:
    try:
        return await read_answer(reader, timeout=0.05)
    except TimeoutError:
        return None


@pytest.mark.parametrize("path", PATHS)
async def test_a_head_over_max_head_bytes_gets_431_and_the_connection_closes(
    fake_worker, gateway, path
):
    worker = await fake_worker(models="m")
    limits = ClientConfig(front_path=path != "front path off", max_head_bytes=64 * 1024)
    gw = await gateway([worker], auth=KEYS, client=limits)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        if path == "handed over":  # aiohttp owns the connection from this request on
            writer.write(HEALTH)
            assert (await read_answer(reader)).status == 200
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: g\r\n")
        sent, answer = 0, None
        for i in range(0, len(LINES), 2):
            with contextlib.suppress(ConnectionError):
                writer.write(b"".join(LINES[i : i + 2]))
                await writer.drain()
            sent += 2
            if (answer := await answer_or_none(reader)) is not None:
                break
        assert answer is not None, "the head was never refused"
        assert answer.status == 431 and answer.error()["code"] == "malformed_request"
        assert sent * len(LINES[0]) <= 64 * 1024 + 4 * len(LINES[0]), sent  # at the bound
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # and the connection is closed
    finally:
        writer.close()
    assert worker.stats.requests == [] or all(
        r.path != "/v1/completions" for r in worker.stats.requests
    )


async def test_a_long_head_within_max_head_bytes_is_served(fake_worker, gateway):
    """Many lines, each under the line limit, in all under the bound: served as before."""
    worker = await fake_worker(models="m")
    gw = await gateway([worker], client=ClientConfig(max_head_bytes=128 * 1024))
    headers = [(f"X-Pad-{i}", "b" * 8000) for i in range(12)]  # 96 KB
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(request(GOOD, headers=headers))
        answer = await read_answer(reader)
    finally:
        writer.close()
    assert answer.status == 200, answer


@pytest.mark.parametrize("front_path", [True, False])
async def test_connections_past_max_connections_get_503_and_are_closed(
    fake_worker, gateway, front_path
):
    worker = await fake_worker(models="m")
    limits = ClientConfig(front_path=front_path, max_connections=3)
    gw = await gateway([worker], client=limits)
    held = []
    try:
        for _ in range(3):  # each one served (so counted) and kept open
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            held.append(writer)
            writer.write(request(GOOD, close=False))
            assert (await read_answer(reader)).status == 200
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            refused = await read_answer(reader)
            async with asyncio.timeout(5):
                assert await reader.read() == b""
        finally:
            writer.close()
        assert refused.status == 503 and refused.headers["retry-after"] == "1"
        assert refused.error()["code"] == "too_many_connections"
        assert "connections" in orjson.loads(refused.body)["error"]["message"]
        held.pop().close()  # one leaves: room for one more
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        held.append(writer)
        writer.write(request(GOOD, close=False))
        assert (await read_answer(reader)).status == 200
    finally:
        for w in held:
            w.close()

"""Hypothesis over what a worker answers a relayed request: status lines, headers, bodies and
SSE streams, written byte for byte by a scripted worker.

Whatever the worker writes (a status out of range, duplicate or contradictory lengths,
broken chunking, an event stream cut anywhere, a close at any point), the client gets an
answer or a clean cut within the gateway's limits, never the gateway's own 500; the
worker's lease ends (in flight back to 0); the gateway's memory stays put.
"""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import wait_until
from tests.support.scripted_worker import ScriptedWorker, chunk
from vllm_gateway.app import GATEWAY
from vllm_gateway.config.gateway import BreakerConfig, TimeoutConfig

pytestmark = pytest.mark.timeout(90)

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))

status_line = st.one_of(
    st.sampled_from([200, 201, 204, 301, 400, 404, 429, 500, 502, 503, 599, 999]).map(
        lambda s: b"HTTP/1.1 %d X\r\n" % s
    ),
    st.sampled_from([b"HTTP/1.0 200 OK\r\n", b"HTTP/1.1 200\r\n", b"HTTP/2 200\r\n", b"\r\n"]),
    st.binary(max_size=20).map(lambda b: b + b"\r\n"),
)
header = st.one_of(
    st.sampled_from(
        [
            b"content-type: text/event-stream",
            b"content-type: application/json",
            b"transfer-encoding: chunked",
            b"transfer-encoding: gzip, chunked",
            b"content-length: 5",
            b"content-length: 0",
            b"content-length: -1",
            b"content-length: 99999999999999999999",
            b"connection: close",
            b"connection: keep-alive, upgrade",
            b"x-long: " + b"a" * 9000,
            b"bad header",
            b": empty-name",
            b"set-cookie: a=b",
        ]
    ),
    st.binary(max_size=30).filter(lambda b: b"\r" not in b and b"\n" not in b),
)
event = st.one_of(
    st.sampled_from(
        [b'data: {"choices":[{"text":"x"}]}\n\n', b"data: [DONE]\n\n", b": ping\n\n", b"data: "]
    ),
    st.binary(max_size=40),
)
body_plan = st.tuples(
    st.lists(event, max_size=6),
    st.sampled_from(["chunked", "raw", "broken-chunk"]),
    st.sampled_from(["close", "keep", "reset"]),
)


def render(head: tuple[bytes, list[bytes]], plan: tuple[list[bytes], str, str]) -> bytes:
    status, headers = head
    events, framing, _ = plan
    out = status + b"".join(h + b"\r\n" for h in headers) + b"\r\n"
    for e in events:
        if framing == "chunked":
            out += chunk(e) if e else b""
        elif framing == "broken-chunk":
            out += b"zz\r\n" + e
        else:
            out += e
    if framing == "chunked":
        out += b"0\r\n\r\n"
    return out


def draw_examples(n: int) -> list:
    drawn: list = []

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.tuples(status_line, st.lists(header, max_size=5)), body_plan)
    def draw(head, plan):
        drawn.append((head, plan))

    draw()
    return drawn


async def test_any_worker_answer_ends_cleanly_and_leaves_nothing_in_flight(gateway):
    current: list[tuple] = []

    async def script(transport: asyncio.Transport, body: bytes) -> None:
        head, plan = current[0]
        transport.write(render(head, plan))
        end = plan[2]
        if end == "close":
            transport.close()
        elif end == "reset":
            transport.abort()
        # "keep": leave it open; the gateway's idle and first-byte limits end it

    worker = await ScriptedWorker(script).start()
    timeouts = TimeoutConfig(connect=1, first_byte=0.5, idle=0.3, total=2)
    # No breaker: every example must reach the worker, not a circuit opened by the last one.
    gw = await gateway([worker.url], timeouts=timeouts, breaker=BreakerConfig(failures=0))
    g = gw.app[GATEWAY]
    rss_before = _rss()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            examples = draw_examples(EXAMPLES)
            for example in examples:
                current[:] = [example]
                for stream in (False, True):
                    await _one(http, gw.url, stream, example)
                await wait_until(lambda: all(w.inflight == 0 for w in g.registry), timeout=3)
                for t in list(worker.transports):  # left open by "keep": not reused
                    t.abort()
        assert len(worker.requests) == 2 * len(examples)  # each one reached the worker
        assert _rss() - rss_before < 50 << 20
    finally:
        await worker.stop()


async def _one(http: aiohttp.ClientSession, url: str, stream: bool, example: tuple) -> None:
    body = {"model": "m", "prompt": "x", "stream": stream}
    try:
        async with http.post(url + "/v1/completions", json=body) as r:
            text = await r.read()
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
        return  # a cut answer: the client sees it failed, as the rule says
    except aiohttp.ClientResponseError:
        return
    assert b"internal_error" not in text, (example, r.status, text[:300])


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_a_worker_head_that_never_ends_is_cut_at_its_limit(gateway):
    """A worker sending header lines without end (or one endless status line) gets a 502
    once its head passes HEAD_LIMIT, long before the first-byte limit; the gateway does not
    hold the head (before: it grew by every byte until `first_byte`, 600 s by default)."""

    async def endless(transport: asyncio.Transport, body: bytes) -> None:
        if b"reason" in body:
            transport.write(b"HTTP/1.1 200 " + b"R" * 4096)
            line = b"R" * 65536
        else:
            transport.write(b"HTTP/1.1 200 OK\r\n")
            line = b"x-filler: " + b"a" * 8000 + b"\r\n"
        for _ in range(1000):  # up to 64 MB
            if transport.is_closing():
                return
            transport.write(line)
            await asyncio.sleep(0)

    worker = await ScriptedWorker(endless).start()
    gw = await gateway([worker.url], timeouts=TimeoutConfig(first_byte=20))
    g = gw.app[GATEWAY]
    rss_before = _rss()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for prompt in ("headers", "reason"):
                body = {"model": "m", "prompt": prompt}
                async with http.post(gw.url + "/v1/completions", json=body) as r:
                    assert r.status == 502, await r.text()
                    message = (await r.json())["error"]["message"]
                    assert "head" in message, message
        await wait_until(lambda: all(w.inflight == 0 for w in g.registry))
        assert _rss() - rss_before < 20 << 20
    finally:
        await worker.stop()

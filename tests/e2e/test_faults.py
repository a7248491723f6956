"""Worker faults seen through the gateway: what the client gets, and that nothing leaks.

Each test proves one or more rows of docs/reliability.md. Every fault must end the client's
request with a clear answer (an OpenAI error body, or on a started event stream an SSE error
event and the end of the stream) and leave nothing behind: the gateway's in-flight counts
and the worker's batch slots are free again afterwards (`settled`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from structlog.testing import capture_logs

from tests.conftest import wait_until
from tests.support.scripted_worker import LAST_CHUNK, SSE_HEAD, ScriptedWorker, chunk, response
from vllm_gateway.app import DISPATCHER, REGISTRY
from vllm_gateway.config.gateway import ProbeConfig, RetryConfig, TimeoutConfig
from vllm_gateway.fake_worker import FakeWorker
from vllm_gateway.http.server import RunningServer
from vllm_gateway.http.wire import TransportSink
from vllm_gateway.proxy.pool import UpstreamPool

pytestmark = pytest.mark.timeout(30)

# Limits short enough that a timeout test takes about a second.
QUICK = TimeoutConfig(connect=0.5, first_byte=1.0, idle=0.5, total=0.0)
# Probe once at start (so the workers are ready), then not again within a test: the relay
# itself must meet each fault, not a probe that marks the worker unhealthy first.
ONCE = ProbeConfig(interval=600, timeout=0.5, healthy_after=1, unhealthy_after=1, startup_wait=2)
BODY = {"model": "m", "prompt": "x", "max_tokens": 8}


def fault(name: str) -> dict[str, str]:
    return {"X-Fake-Fault": name}


async def settled(gw: RunningServer, *workers: FakeWorker) -> None:
    """Wait until the gateway counts nothing in flight and no worker holds a request."""
    registry = gw.app[REGISTRY]
    await wait_until(lambda: all(w.inflight == 0 for w in registry), timeout=3)
    for w in workers:
        await w.wait_for(
            lambda s: (
                s.running == 0
                and s.waiting == 0
                and all(r.outcome != "pending" for r in s.requests)
            ),
            timeout=3,
        )


async def call(
    http: aiohttp.ClientSession,
    gw: RunningServer,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    path: str = "/v1/completions",
) -> tuple[int, Any, bytes]:
    """POST and read the whole answer: status, headers, body. A cut body raises."""
    async with http.post(gw.url + path, json=body or BODY, headers=headers) as r:
        return r.status, r.headers, await r.read()


def sse_data(raw: bytes) -> list[Any]:
    """The JSON payload of each `data:` event ("[DONE]" stays a string)."""
    out: list[Any] = []
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: "):
            data = event[len(b"data: ") :]
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def asked(worker: FakeWorker, outcome: str | None = None) -> int:
    """Inference requests the worker received (probes aside), optionally by outcome."""
    return sum(
        1
        for r in worker.stats.requests
        if r.path == "/v1/completions" and outcome in (None, r.outcome)
    )


def error_of(body: bytes) -> dict[str, Any]:
    """The `error` object of an OpenAI error body (fails the test if it is not one)."""
    doc = orjson.loads(body)
    assert set(doc) == {"error"}, doc
    assert {"message", "type", "param", "code"} <= set(doc["error"]), doc
    return doc["error"]


def ended_with_error_event(raw: bytes) -> dict[str, Any]:
    """Assert a stream ends with one whole SSE error event (and no [DONE]); return its error.

    The event before it may be a partial one, cut where the worker stopped; the gateway
    ends it with a blank line so the error event is parsed on its own.
    """
    assert raw.endswith(b"\n\n") and b"data: [DONE]" not in raw, raw[-300:]
    last = raw[:-2].rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: "), raw[-300:]
    doc = orjson.loads(last[len(b"data: ") :])
    assert set(doc) == {"error"} and doc["error"]["message"], doc
    return doc["error"]


# --- timeouts --------------------------------------------------------------------------------


async def test_connect_timeout_is_unreachable_and_retried_elsewhere(fake_worker, gateway, http):
    dark = await fake_worker(models="m")
    ok = await fake_worker(models="m")
    gw = await gateway([dark, ok], timeouts=QUICK, probe=ONCE, policy="round_robin")
    alone = await gateway([dark], timeouts=QUICK, probe=ONCE)
    await dark.blackhole()  # connects to it now hang until the connect timeout
    results = await asyncio.gather(*(call(http, gw) for _ in range(4)))
    assert [status for status, _, _ in results] == [200] * 4
    assert asked(ok, "completed") == 4 and asked(dark) == 0
    assert gw.app[DISPATCHER].retries >= 1

    t0 = time.monotonic()
    status, headers, body = await call(http, alone)
    # The only worker: out now, so 503 with Retry-After (SDKs retry it), and why.
    assert status == 503 and error_of(body)["code"] == "no_worker_available"
    assert "connect timed out" in error_of(body)["message"] and headers["Retry-After"]
    assert 0.4 < time.monotonic() - t0 < 3  # the connect limit (0.5 s), not longer
    await settled(gw, ok)
    await settled(alone)


@pytest.mark.parametrize("stream", [False, True])
async def test_first_byte_timeout_is_504_and_frees_the_worker(fake_worker, gateway, http, stream):
    a = await fake_worker(models="m")
    b = await fake_worker(models="m")
    gw = await gateway([a, b], timeouts=QUICK, probe=ONCE)
    t0 = time.monotonic()
    status, _, body = await call(http, gw, {**BODY, "stream": stream}, fault("hang"))
    elapsed = time.monotonic() - t0
    assert status == 504
    err = error_of(body)
    assert err["code"] == "worker_timeout" and "1 s" in err["message"]
    assert 0.9 < elapsed < 3
    # The worker got the request, so it is not replayed on the other one.
    (hung,) = [w for w in (a, b) if asked(w)]
    assert asked(a) + asked(b) == 1 and gw.app[DISPATCHER].retries == 0
    await settled(gw, a, b)
    # The worker saw the gateway give up: its request was aborted, its slot freed.
    assert hung.stats.last("/v1/completions").outcome == "aborted"


async def test_accepted_but_never_answered_is_504_not_retried(fake_worker, gateway, http):
    frozen = await fake_worker(models="m")
    other = await fake_worker(models="m")
    gw = await gateway([frozen, other], timeouts=QUICK, probe=ONCE, policy="round_robin")
    await frozen.freeze()  # the kernel accepts; nothing reads or answers
    # Round robin: one request each. The frozen one's answer never comes.
    (s1, _, b1), (s2, _, b2) = await asyncio.gather(call(http, gw), call(http, gw))
    assert sorted([s1, s2]) == [200, 504]
    assert error_of(b1 if s1 == 504 else b2)["code"] == "worker_timeout"
    # The request bytes were written to a live connection: they may have reached the app,
    # so the timed-out one is not replayed on the other worker.
    assert asked(other) == 1 and gw.app[DISPATCHER].retries == 0
    await settled(gw, other)


async def test_idle_timeout_mid_stream_sends_sse_error_then_ends(
    fake_worker, gateway, http, client
):
    w = await fake_worker(models="m", tpot_ms=5)
    gw = await gateway([w], timeouts=QUICK, probe=ONCE)
    status, headers, raw = await call(
        http, gw, {**BODY, "stream": True}, fault("stall_midstream=3")
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_data(raw)
    assert [e["choices"][0]["text"] for e in events[:3]] == [" w0", " w1", " w2"]
    err = ended_with_error_event(raw)
    assert "sent nothing for 0.5 s" in err["message"] and len(events) == 4
    await settled(gw, w)
    assert w.stats.last().outcome == "aborted"

    # The official SDK raises on that event, with the gateway's message.
    stream = await client(gw).completions.create(
        model="m", prompt="x", max_tokens=8, stream=True, extra_headers=fault("stall_midstream=2")
    )
    texts = []
    with pytest.raises(openai.APIError, match="sent nothing for"):
        async for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts == [" w0", " w1"]
    await settled(gw, w)


async def test_idle_timeout_mid_body_cuts_the_connection(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([w], timeouts=QUICK, probe=ONCE)
    # Not streamed: the worker sends half its JSON body, then nothing. The status line went
    # out with a Content-Length; cutting the connection is how the client learns.
    with pytest.raises(aiohttp.ClientPayloadError):
        await call(http, gw, headers=fault("stall_midstream=1"))
    await settled(gw, w)
    assert w.stats.last().outcome == "aborted"


async def test_total_timeout_before_and_during_the_answer(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    limits = TimeoutConfig(connect=0.5, first_byte=10, idle=10, total=1.0)
    gw = await gateway([w], timeouts=limits, probe=ONCE)
    t0 = time.monotonic()
    status, _, body = await call(http, gw, headers=fault("stall_headers=5"))
    assert status == 504 and error_of(body)["code"] == "worker_timeout"
    assert 0.9 < time.monotonic() - t0 < 3
    # A stream that keeps going (a byte every 50 ms) is still cut at the total limit.
    t0 = time.monotonic()
    status, _, raw = await call(http, gw, {**BODY, "stream": True}, fault("drip=50"))
    assert status == 200
    assert "longer than the 1 s limit" in ended_with_error_event(raw)["message"]
    assert 0.9 < time.monotonic() - t0 < 3
    await settled(gw, w)


# --- a worker failing mid-answer -----------------------------------------------------------


async def test_stall_before_headers_within_the_limit_is_served(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([w], timeouts=QUICK, probe=ONCE)
    status, _, body = await call(http, gw, headers=fault("stall_headers=0.3"))
    assert status == 200 and orjson.loads(body)["choices"][0]["text"].startswith(" w0")


async def test_reset_mid_stream_sends_sse_error_and_is_not_replayed(fake_worker, gateway, http):
    a = await fake_worker(models="m")
    b = await fake_worker(models="m")
    gw = await gateway([a, b], timeouts=QUICK, probe=ONCE, policy="round_robin")
    status, _, raw = await call(http, gw, {**BODY, "stream": True}, fault("reset_midstream=2"))
    assert status == 200
    events = sse_data(raw)
    assert [e["choices"][0]["text"] for e in events[:2]] == [" w0", " w1"]
    assert "failed mid-answer" in ended_with_error_event(raw)["message"]
    # The client already had bytes: never replayed on the other worker.
    assert asked(a) + asked(b) == 1 and gw.app[DISPATCHER].retries == 0
    await settled(gw, a, b)


async def test_reset_mid_body_cuts_the_connection(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([w], timeouts=QUICK, probe=ONCE)
    with pytest.raises(aiohttp.ClientPayloadError):
        await call(http, gw, headers=fault("reset_midstream=1"))
    await settled(gw, w)


async def test_clean_close_without_done_sends_sse_error(fake_worker, gateway, http, client):
    w = await fake_worker(models="m")
    gw = await gateway([w], timeouts=QUICK, probe=ONCE)
    status, _, raw = await call(http, gw, {**BODY, "stream": True}, fault("close_midstream=3"))
    assert status == 200 and len(sse_data(raw)) == 4
    assert "without [DONE]" in ended_with_error_event(raw)["message"]
    # Chat too, through the SDK, which would otherwise end the answer silently short.
    stream = await client(gw).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_headers=fault("close_midstream=2"),
    )
    with pytest.raises(openai.APIError, match="without"):
        async for _ in stream:
            pass
    # A complete stream, even one dripped a few bytes per chunk, is not flagged.
    status, _, raw = await call(http, gw, {**BODY, "stream": True}, fault("drip=1"))
    assert status == 200 and sse_data(raw)[-1] == "[DONE]"
    await settled(gw, w)


# --- busy and failing workers: what is retried ----------------------------------------------


@pytest.mark.parametrize("code", [503, 429])
async def test_busy_worker_is_retried_on_another(fake_worker, gateway, http, code):
    busy = await fake_worker(models="m", fault=f"status={code}")
    ok = await fake_worker(models="m")
    gw = await gateway([busy, ok], timeouts=QUICK, probe=ONCE, policy="round_robin")
    for stream in (False, True, False, True):
        status, _, raw = await call(http, gw, {**BODY, "stream": stream})
        assert status == 200, raw
    assert asked(ok, "completed") == 4
    assert asked(busy) == gw.app[DISPATCHER].retries >= 1
    await settled(gw, busy, ok)


async def test_when_every_worker_is_busy_the_last_answer_is_relayed(fake_worker, gateway, http):
    a = await fake_worker(models="m", fault="status=503")
    b = await fake_worker(models="m", fault="status=503")
    gw = await gateway([a, b], timeouts=QUICK, probe=ONCE)
    status, headers, body = await call(http, gw)
    # The worker's own answer, as it sent it: status, Retry-After, body.
    assert status == 503 and headers["Retry-After"] == "1"
    assert error_of(body)["message"] == "fake worker fault: status 503"
    assert asked(a) == asked(b) == 1  # each tried once, no more
    assert gw.app[DISPATCHER].retries == 1
    await settled(gw, a, b)


async def test_retries_are_bounded_and_back_off(fake_worker, gateway, http):
    workers = [await fake_worker(models="m", fault="status=429") for _ in range(4)]
    retry = RetryConfig(max_attempts=3, backoff=0.2, backoff_max=0.25)
    gw = await gateway(workers, timeouts=QUICK, probe=ONCE, retry=retry)
    t0 = time.monotonic()
    status, _, _ = await call(http, gw)
    elapsed = time.monotonic() - t0
    assert status == 429
    assert sum(asked(w) for w in workers) == 3  # max_attempts, not every worker
    # Two pauses: at least half of 0.2 s, then half of min(0.4, 0.25) s.
    assert elapsed >= 0.1 + 0.125
    assert elapsed < 3


async def test_worker_errors_are_relayed_as_is_not_retried(fake_worker, gateway, http):
    a = await fake_worker(models="m")
    b = await fake_worker(models="m")
    gw = await gateway([a, b], timeouts=QUICK, probe=ONCE, policy="round_robin")
    for code in (500, 400, 502, 404):
        status, _, body = await call(http, gw, headers=fault(f"status={code}"))
        assert status == code
        assert error_of(body)["message"] == f"fake worker fault: status {code}"
    assert asked(a) + asked(b) == 4
    assert gw.app[DISPATCHER].retries == 0
    await settled(gw, a, b)


async def test_retry_logs_one_warning_per_retry(fake_worker, gateway, http):
    workers = [await fake_worker(models="m", fault="status=503") for _ in range(3)]
    gw = await gateway(workers, timeouts=QUICK, probe=ONCE)
    with capture_logs() as logs:
        status, _, _ = await call(http, gw)
    assert status == 503
    retries = [e for e in logs if e["event"] == "retrying on another worker"]
    assert len(retries) == 2 == gw.app[DISPATCHER].retries
    assert all(e["log_level"] == "warning" for e in retries)
    assert [e["attempt"] for e in retries] == [1, 2]
    assert {e["worker"] for e in retries} < {w.url for w in workers}
    assert all(e["reason"] == "worker_refused" for e in retries)


# --- bytes relayed untouched ----------------------------------------------------------------


async def test_drip_is_relayed_intact(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([w], timeouts=QUICK, probe=ONCE)
    status, _, raw = await call(http, gw, {**BODY, "stream": True}, fault("drip=1"))
    texts = [e["choices"][0]["text"] for e in sse_data(raw)[:-1]]
    assert status == 200 and texts == [f" w{i}" for i in range(8)]


async def test_malformed_sse_is_relayed_untouched(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([w], timeouts=QUICK, probe=ONCE)
    status, _, raw = await call(http, gw, {**BODY, "stream": True}, fault("malformed_sse"))
    # The gateway does not parse events: the worker's garbage reaches the client as is.
    assert status == 200
    assert all(b"not-an-sse-field w%d\n\n" % i in raw for i in range(8))
    assert raw.endswith(b"data: [DONE]\n\n")


async def test_huge_event_is_relayed_intact(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    gw = await gateway([w], timeouts=QUICK, probe=ONCE)
    size = 2 * 1024 * 1024
    status, _, raw = await call(http, gw, {**BODY, "stream": True}, fault(f"huge_event={size}"))
    texts = [e["choices"][0]["text"] for e in sse_data(raw)[:-1]]
    assert status == 200 and texts[0] == "x" * size and texts[1:] == [f" w{i}" for i in range(8)]


# --- dead and restarted workers -------------------------------------------------------------


async def test_refused_connections_are_retried_then_503(fake_worker, gateway, http):
    dead = await fake_worker(models="m")
    ok = await fake_worker(models="m")
    gw = await gateway([dead, ok], timeouts=QUICK, probe=ONCE, policy="round_robin")
    alone = await gateway([dead], timeouts=QUICK, probe=ONCE)
    await dead.pause()
    results = await asyncio.gather(*(call(http, gw) for _ in range(4)))
    assert [s for s, _, _ in results] == [200] * 4 and asked(ok, "completed") == 4
    # Requests picked before the first refusal took the dead worker out may meet it too.
    assert 1 <= gw.app[DISPATCHER].retries <= 2

    # The only worker refusing: out at once, 503 with Retry-After; so once a probe saw it.
    probed = ProbeConfig(interval=0.1, timeout=0.5, unhealthy_after=1, startup_wait=2)
    for _ in range(2):
        status, headers, body = await call(http, alone)
        assert status == 503 and error_of(body)["code"] == "no_worker_available"
        assert int(headers["Retry-After"]) >= 1
    watched = await gateway([ok], timeouts=QUICK, probe=probed)
    await ok.pause()
    registry = watched.app[REGISTRY]
    await wait_until(lambda: not registry.ready_models(), timeout=3)
    status, headers, body = await call(http, watched)
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert error_of(body)["code"] == "no_worker_available"
    await settled(gw)
    await settled(alone)


async def test_worker_restart_mid_stream_then_serves_again(fake_worker, gateway, http):
    w = await fake_worker(models="m", tpot_ms=20)
    gw = await gateway([w], timeouts=QUICK, probe=ONCE)
    # Warm the keep-alive pool, then hold streams open across the restart.
    await asyncio.gather(*(call(http, gw) for _ in range(8)))
    body = {**BODY, "stream": True, "max_tokens": 1000}
    streams = [asyncio.create_task(call(http, gw, body)) for _ in range(8)]
    await w.wait_for(lambda s: s.running == 8, timeout=5)
    await w.pause()
    for status, _, raw in await asyncio.gather(*streams):
        assert status == 200 and "failed mid-answer" in ended_with_error_event(raw)["message"]
    await w.resume()
    # No request may be sent down a connection the restart killed: all of these succeed.
    results = await asyncio.gather(*(call(http, gw) for _ in range(16)))
    assert [s for s, _, _ in results] == [200] * 16
    await settled(gw, w)


# --- the keep-alive pool ---------------------------------------------------------------------


class _Client:
    """A stand-in for the client's transport in the relay: it can go away on cue."""

    def __init__(self) -> None:
        self.closing = False
        self.written: list[bytes] = []

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def writelines(self, parts: list[bytes]) -> None:
        self.written.extend(parts)

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (16384, 65536)


async def test_a_connection_paused_for_a_departed_client_is_read_again_in_the_pool():
    """The soak's hung requests: a client left just as the worker's last bytes arrived, so
    reading paused for it on an answer that was complete; the connection went back to the
    pool still paused, and the next request on it waited for an answer nobody read. Now a
    complete answer never pauses reading, and a connection back in the pool reads again."""
    go = asyncio.Event()

    async def script(t, body):
        if body == b"again":
            t.write(response(200, b'{"ok": 1}'))
            return
        t.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await go.wait()
        t.write(chunk(b"data: 2\n\n") + chunk(b"data: [DONE]\n\n") + LAST_CHUNK)  # one read

    worker = await ScriptedWorker(script).start()
    pool = UpstreamPool(connect_timeout=2.0)
    await pool.open()
    try:
        head = b"POST /v1/x HTTP/1.1\r\nHost: w\r\nContent-Length: %d\r\n\r\n"
        conn = await pool.acquire(worker.url)
        conn.send(head % 2, b"{}")
        await asyncio.wait_for(conn.wait_head(None), 2)
        client = _Client()
        conn.attach(TransportSink(client, chunked=True))  # type: ignore[arg-type]
        client.closing = True  # the client leaves...
        go.set()  # ...as the rest of the answer arrives, whole
        await wait_until(lambda: conn.complete, timeout=3)
        assert conn.transport is not None and conn.transport.is_reading()  # no pause: complete
        conn.transport.pause_reading()  # as any pause left for this exchange would
        pool.release(conn)
        assert conn.reusable and conn.transport.is_reading()  # read again once idle
        again = await pool.acquire(worker.url)
        assert again is conn
        again.send(head % 5, b"again")
        await asyncio.wait_for(again.wait_head(None), 2)  # hung for ever before the fix
        assert again.status == 200
    finally:
        await pool.close()
        await worker.stop()


async def test_a_worker_closing_idle_connections_is_met_on_a_new_one(gateway, http):
    async def script(t, body):
        t.write(response(200, b'{"ok": 1}'))
        await asyncio.sleep(0.05)
        t.close()  # the worker drops the idle keep-alive connection (no "Connection: close")

    worker = await ScriptedWorker(script).start()
    try:
        gw = await gateway([worker.url], timeouts=QUICK, probe=ONCE)
        for _ in range(3):
            status, _, _ = await call(http, gw)
            assert status == 200
            await asyncio.sleep(0.2)  # the close has arrived by now
        # Each request on a connection of its own: a closed one is never written to.
        assert len(set(worker.post_connections)) == 3
    finally:
        await worker.stop()


async def test_a_reused_connection_failing_before_any_answer_is_not_replayed(gateway, http):
    """The subtle case of the retry rule: a request written on a pooled connection that the
    worker closes before answering (say, just as it restarts) may have reached its
    application. It is a 502 `worker_error`, never replayed on another worker."""
    seen: dict[int, int] = {}

    async def flaky(t, body):
        n = seen[id(t)] = seen.get(id(t), 0) + 1
        if n == 1:
            t.write(response(200, b'{"ok": 1}'))
        else:
            t.close()  # the second request on this connection: read, never answered

    async def steady(t, body):
        t.write(response(200, b'{"ok": 1}'))

    a = await ScriptedWorker(flaky).start()
    b = await ScriptedWorker(steady).start()
    try:
        gw = await gateway([a.url, b.url], timeouts=QUICK, probe=ONCE, policy="round_robin")
        statuses = []
        for _ in range(4):
            status, _, body = await call(http, gw)
            statuses.append(status)
            if status != 200:
                assert status == 502 and error_of(body)["code"] == "worker_error"
        assert sorted(statuses) == [200, 200, 200, 502]
        assert len(a.requests) == 2 and len(b.requests) == 2  # no third request on b
        assert gw.app[DISPATCHER].retries == 0
        await settled(gw)
    finally:
        await a.stop()
        await b.stop()


async def test_one_slow_connect_does_not_take_a_healthy_worker_out(fake_worker, gateway, http):
    """A connect that timed out once (a SYN lost, an accept queue full for a moment) is not
    a refusal: the worker stays in, so the next request is served at once rather than
    answered 503 until a probe passes (here: never, the probes are 10 minutes apart)."""
    w = await fake_worker(models="m")
    gw = await gateway([w], timeouts=QUICK, probe=ONCE)
    await w.blackhole()
    status, _, body = await call(http, gw)
    assert status == 503 and "connect timed out" in error_of(body)["message"]
    await w.resume()
    status, _, body = await call(http, gw)
    assert status == 200, body
    assert gw.app[REGISTRY].get(w.url).available
    await settled(gw, w)

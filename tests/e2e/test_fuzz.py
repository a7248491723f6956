"""Property-based tests (hypothesis) over request bodies and headers, through real sockets.

Whatever a client sends, an answer comes; its status is 2xx, 4xx or 5xx; an error answer
has an OpenAI error body; a streamed 200 ends with `data: [DONE]`; and afterwards no worker
is left with a request in flight at the gateway.

Hypothesis drives blocking sockets, so the fake worker and the gateway run on their own
event loop in a thread (`Live`), started once for the module. Example counts are small
(CI), and the whole module stays within a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.rawhttp import Answer, exchange_sync, request
from vllm_gateway.app import REGISTRY, create_app
from vllm_gateway.config.gateway import GatewayConfig, TimeoutConfig, WorkerSpec
from vllm_gateway.fake_worker import FakeWorker, FakeWorkerConfig
from vllm_gateway.http.server import RunningServer, start_server

pytestmark = pytest.mark.timeout(120)

# FUZZ_EXAMPLES=5000 scripts/test tests/e2e/test_fuzz.py digs deeper than CI does.
FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize")
# Fields that make the fake worker generate for long; the fuzzer leaves them alone.
LONG = {"max_tokens", "max_completion_tokens", "n", "best_of", "model", "stream"}


class Live:
    """A fake worker and a gateway on an event loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.worker: FakeWorker | None = None
        self.gateway: RunningServer | None = None

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self.thread.start()
        self.run(self._start())

    async def _start(self) -> None:
        self.worker = FakeWorker(
            FakeWorkerConfig(models=("m",), ttft_ms=0, tpot_ms=0, max_tokens=2)
        )
        await self.worker.start()
        config = GatewayConfig(
            workers=(WorkerSpec(url=self.worker.url),),
            max_body_bytes=64 * 1024,
            timeouts=TimeoutConfig(connect=2, first_byte=5, idle=5),
        )
        self.gateway = await start_server(create_app(config), "127.0.0.1", 0)

    def stop(self) -> None:
        async def _stop() -> None:
            if self.gateway is not None:
                await self.gateway.stop()
            if self.worker is not None:
                await self.worker.stop()

        with contextlib.suppress(Exception):
            self.run(_stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    @property
    def port(self) -> int:
        assert self.gateway is not None
        return self.gateway.port

    def inflight(self) -> int:
        assert self.gateway is not None
        return sum(w.inflight for w in self.gateway.app[REGISTRY])

    def settle(self, timeout: float = 5.0) -> None:
        """Wait until nothing is in flight; fail if something stays."""
        deadline = time.monotonic() + timeout
        while self.inflight():
            assert time.monotonic() < deadline, f"{self.inflight()} left in flight"
            time.sleep(0.005)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    gw = Live()
    gw.start()
    yield gw
    gw.stop()


def check(answer: Answer) -> None:
    """The properties every answer has, whatever the request was."""
    assert 200 <= answer.status < 300 or 400 <= answer.status < 600, answer
    if answer.status >= 400:
        answer.error()  # an OpenAI error body, whoever answered
    elif answer.headers.get("content-type", "").startswith("text/event-stream"):
        assert answer.body.rstrip().endswith(b"data: [DONE]"), answer.body[-200:]


# --- strategies ------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
absent = st.just(None)  # a key left out


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """Request bodies: mostly JSON objects near a valid request, some anything at all."""
    kind = draw(st.sampled_from(["request", "request", "request", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    doc: dict[str, Any] = {
        k: v
        for k, v in draw(st.dictionaries(st.text(max_size=12), json_values, max_size=5)).items()
        if k not in LONG
    }
    model = draw(st.one_of(st.just("m"), st.text(max_size=20), json_values, absent))
    if model is not None:
        doc["model"] = model
    stream = draw(st.one_of(st.booleans(), json_values, absent))
    if stream is not None:
        doc["stream"] = stream
    doc["max_tokens"] = 2
    if draw(st.booleans()):
        doc["prompt"] = draw(st.text(max_size=40))
    if draw(st.booleans()):
        doc["messages"] = [{"role": "user", "content": draw(st.text(max_size=40))}]
    # The stdlib writes what orjson cannot (integers over 64 bits): both reach the gateway.
    return json.dumps(doc).encode()


header_names = st.one_of(
    st.sampled_from(
        [
            "Content-Type",
            "Content-Encoding",
            "Accept-Encoding",
            "Authorization",
            "X-Request-Id",
            "Expect",
            "Connection",
            "Upgrade",
            "TE",
            "Trailer",
            "Keep-Alive",
            "Proxy-Authorization",
            "X-Session-Id",
            "X-Priority",
            "Cookie",
            "Host",
        ]
    ),
    st.from_regex(r"\A[A-Za-z0-9!#$%&'*+.^_`|~-]{1,30}\Z"),
).filter(lambda n: n.lower() not in ("x-fake-fault", "content-length", "transfer-encoding"))
# Values that mean something in some header, values a client library would send (visible
# ASCII and spaces), and some with any byte but CR and LF (which end the line): obs-text,
# NUL, DEL, other controls, as latin-1.
header_values = st.one_of(
    st.sampled_from(
        ["100-continue", "gzip", "deflate", "chunked", "close", "keep-alive", "upgrade", "0"]
    ),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
    st.text(
        alphabet=st.characters(min_codepoint=0, max_codepoint=255, blacklist_characters="\r\n"),
        max_size=40,
    ),
)


# --- properties ------------------------------------------------------------------------------


@FUZZ
@given(body=bodies(), path=st.sampled_from(PATHS))
def test_any_body_gets_an_answer_and_leaves_nothing_in_flight(live, body, path):
    answer = exchange_sync(live.port, request(body, path=path))
    check(answer)
    live.settle()


@FUZZ
@given(
    headers=st.lists(st.tuples(header_names, header_values), max_size=8),
    stream=st.booleans(),
)
def test_any_headers_get_an_answer_and_leave_nothing_in_flight(live, headers, stream):
    body = orjson.dumps({"model": "m", "prompt": "x", "max_tokens": 2, "stream": stream})
    answer = exchange_sync(live.port, request(body, headers=headers))
    check(answer)
    live.settle()


def test_the_gateway_still_serves_after_the_fuzzing(live):
    body = orjson.dumps({"model": "m", "prompt": "x", "max_tokens": 2})
    answer = exchange_sync(live.port, request(body))
    assert answer.status == 200 and orjson.loads(answer.body)["choices"][0]["text"] == " w0 w1"
    live.settle()

"""A fixed-answer vLLM stand-in for benchmarks, far cheaper than any relay in front of it.

A raw asyncio protocol on uvloop with httptools' request parser: no framework, no JSON
parsing, answers built once at start. It serves what a gateway needs to call a worker
ready (GET /health, /v1/models, /metrics) and answers every POST with either

- a fixed non-streamed completion (about 400 bytes, Content-Length), or, when the body
  says `"stream": true`,
- an SSE stream of `--chunks` events, chunked, one event per stream every `--pace-ms`
  milliseconds. Every stream is advanced by one ticker, like a vLLM engine step that
  emits one token for each running sequence; each event carries the time it was written
  (`"t"`, CLOCK_MONOTONIC seconds, comparable across processes on one machine), so the
  client can measure how long the event took to reach it.

    python -m benchmarks.backend --port 0 --chunks 64 --pace-ms 20

prints `listening PORT` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time

import httptools
import uvloop

MODEL = "bench-model"

_JSON_ANSWER = (
    b'{"id":"cmpl-bench","object":"text_completion","created":1700000000,'
    b'"model":"' + MODEL.encode() + b'","choices":[{"index":0,"text":" w0 w1 w2 w3 w4 w5 w6 w7",'
    b'"logprobs":null,"finish_reason":"length","stop_reason":null}],'
    b'"usage":{"prompt_tokens":8,"total_tokens":16,"completion_tokens":8}}'
)


def _response(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-length: %d\r\ncontent-type: %s\r\n\r\n%s" % (len(body), content_type, body)
    )


ANSWER = _response(_JSON_ANSWER)
HEALTH = _response(b"")
MODELS = _response(
    b'{"object":"list","data":[{"id":"' + MODEL.encode() + b'","object":"model",'
    b'"created":1700000000,"owned_by":"vllm","root":"' + MODEL.encode() + b'"}]}'
)
METRICS = _response(
    b'vllm:num_requests_running{model_name="bench-model"} 0.0\n'
    b'vllm:num_requests_waiting{model_name="bench-model"} 0.0\n'
    b'vllm:kv_cache_usage_perc{model_name="bench-model"} 0.0\n',
    b"text/plain; version=0.0.4",
)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
)
_EVENT = (
    b'data: {"id":"cmpl-bench","object":"text_completion","created":1700000000,'
    b'"model":"bench-model","choices":[{"index":0,"text":" w%d","logprobs":null,'
    b'"finish_reason":null,"stop_reason":null}],"t":%.6f}\n\n'
)
_DONE = b"data: [DONE]\n\n"
STREAM_END = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_DONE), _DONE)


class Streams:
    """Every open SSE stream, advanced one event per tick."""

    def __init__(self, chunks: int, pace: float, pad: int) -> None:
        self.chunks = chunks
        self.pace = pace
        self.pad = b" " * pad  # extra bytes per event (bigger events), before the blank line
        self.open: dict[asyncio.Transport, int] = {}

    def start(self, transport: asyncio.Transport) -> None:
        transport.write(STREAM_HEAD)
        self.open[transport] = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            next_tick += self.pace
            await asyncio.sleep(max(0.0, next_tick - loop.time()))
            t = time.monotonic()
            finished = []
            for transport, sent in self.open.items():
                if transport.is_closing():
                    finished.append(transport)
                    continue
                event = (_EVENT % (sent, t))[:-2] + self.pad + b"\n\n"
                chunk = b"%x\r\n%s\r\n" % (len(event), event)
                sent += 1
                if sent >= self.chunks:
                    transport.write(chunk + STREAM_END)
                    finished.append(transport)
                else:
                    transport.write(chunk)
                    self.open[transport] = sent
            for transport in finished:
                self.open.pop(transport, None)


class BackendProtocol(asyncio.Protocol):
    __slots__ = ("body", "parser", "streams", "transport", "url")

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.streams.open.pop(self.transport, None)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()  # type: ignore[union-attr]

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, self.url = self.url, b""
        body = b"".join(self.body)
        self.body.clear()
        t = self.transport
        assert t is not None
        if self.parser.get_method() == b"POST":
            if b'"stream":true' in body or b'"stream": true' in body:
                self.streams.start(t)
            else:
                t.write(ANSWER)
        elif url == b"/health":
            t.write(HEALTH)
        elif url == b"/v1/models":
            t.write(MODELS)
        elif url == b"/metrics":
            t.write(METRICS)
        else:
            t.write(NOT_FOUND)
        if not self.parser.should_keep_alive():
            t.close()


def raise_fd_limit(want: int = 100_000) -> int:
    """Raise the open-file limit (to `want` where allowed, e.g. as root; else to the hard
    limit); children inherit it. Return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(want, soft), max(want, hard)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def main(args: argparse.Namespace) -> None:
    raise_fd_limit()
    loop = asyncio.get_running_loop()
    streams = Streams(args.chunks, args.pace_ms / 1000, args.pad)
    server = await loop.create_server(
        lambda: BackendProtocol(streams), "127.0.0.1", args.port, backlog=65535
    )
    port = server.sockets[0].getsockname()[1]
    print(f"listening {port}", flush=True)
    ticker = asyncio.create_task(streams.run())
    try:
        await asyncio.sleep(args.lifetime)  # never outlive the benchmark that started us
    finally:
        ticker.cancel()
        server.close()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--chunks", type=int, default=64, help="SSE events per stream")
    p.add_argument("--pace-ms", type=float, default=20.0, help="time between two events")
    p.add_argument("--pad", type=int, default=0, help="extra bytes in every event")
    p.add_argument("--lifetime", type=float, default=3600.0, help="exit after this many s")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    uvloop.run(main(parse_args(sys.argv[1:])))

"""A built-in HTTP/1.1 load generator for the benchmarks (used when wrk is not installed).

Raw asyncio protocols on uvloop with httptools' parser: each connection sends the same
prebuilt request again as soon as the previous answer is complete (closed loop, keep-alive).

    requests mode:  --connections C --duration S   -> requests, errors, latency percentiles
    streams mode:   --streams N                    -> N concurrent SSE streams read to the end;
                    each event's delivery delay (now - the "t" the backend stamped on it)
    hold mode:      --streams N --hold             -> same, opened gradually; says when all are open

It prints `open N` once every stream has its first event (the caller samples the relay's
memory then), and one JSON line of results at the end. Bounded: every run stops after
--duration (requests) or --timeout (streams) seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import sys
import time
from urllib.parse import urlsplit

import httptools
import uvloop

from benchmarks.backend import MODEL, raise_fd_limit

_T = re.compile(rb'"t":([0-9.]+)')


def build_request(host: str, path: str, stream: bool) -> bytes:
    body = b'{"model":"%s","prompt":"Say something","max_tokens":8,"stream":%s}' % (
        MODEL.encode(),
        b"true" if stream else b"false",
    )
    return (
        b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer sk-bench\r\nUser-Agent: bench/1\r\nAccept: */*\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), host.encode(), len(body), body)
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Client(asyncio.Protocol):
    """One keep-alive connection; `on_done(self)` is called after each complete answer."""

    def __init__(self, request: bytes, stats: Stats, stream: bool) -> None:
        self.request = request
        self.stats = stats
        self.stream = stream
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sent_at = 0.0
        self.buf = b""
        self.got_event = False
        self.saw_done = False
        self.finished: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self) -> None:
        self.sent_at = time.monotonic()
        self.transport.write(self.request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._end(False)

    def on_body(self, body: bytes) -> None:
        if not self.stream:
            return
        if self.parser.get_status_code() != 200:
            self.stats.why[body[:160].decode(errors="replace")] += 1
            return
        now = time.monotonic()
        buf = self.buf + body
        end = buf.rfind(b"\n\n")
        if end < 0:
            self.buf = buf
            return
        events, self.buf = buf[: end + 2], buf[end + 2 :]
        delays = self.stats.delays
        for m in _T.finditer(events):
            delays.append(now - float(m.group(1)))
            self.stats.events += 1
        if b"[DONE]" in events:
            self.saw_done = True
        if not self.got_event:
            self.got_event = True
            self.stats.first_events += 1
            self.stats.settle()

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        ok = status == 200 and (self.saw_done or not self.stream)
        if not ok:
            self.stats.why[f"status {status}" if status != 200 else "no [DONE]"] += 1
        if not self.stream:
            self.stats.latencies.append(time.monotonic() - self.sent_at)
        self._end(ok)

    def _end(self, ok: bool) -> None:
        if self.stream and not self.got_event:
            self.got_event = True
            self.stats.expected_open -= 1  # failed before its first event
            self.stats.settle()
        if ok:
            self.stats.ok += 1
        else:
            self.stats.errors += 1
        if not self.finished.done():
            self.finished.set_result(ok)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.finished.done():
            self.stats.why[f"closed ({exc})"] += 1
            self._end(False)
            self.finished.set_result(False)


class Stats:
    def __init__(self, expected_open: int = 0) -> None:
        self.ok = 0
        self.errors = 0
        self.events = 0
        self.first_events = 0
        self.expected_open = expected_open
        self.latencies: list[float] = []
        self.delays: list[float] = []
        self.why: collections.Counter[str] = collections.Counter()  # errors, by kind

    def settle(self) -> None:
        """Say `open N` once every stream has its first event or has failed."""
        if self.first_events == self.expected_open:
            print(f"open {self.first_events}", flush=True)


async def run_requests(url: str, connections: int, duration: float) -> dict:
    parts = urlsplit(url)
    request = build_request(parts.netloc, parts.path, stream=False)
    stats = Stats()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration

    async def worker() -> None:
        while loop.time() < deadline:
            _, proto = await loop.create_connection(
                lambda: Client(request, stats, False), parts.hostname, parts.port
            )
            while loop.time() < deadline:
                proto.finished = loop.create_future()
                proto.send()
                if not await proto.finished:
                    break
            proto.transport.close()

    started = time.monotonic()
    await asyncio.wait_for(
        asyncio.gather(*(worker() for _ in range(connections)), return_exceptions=True),
        duration + 30,
    )
    elapsed = time.monotonic() - started
    lat = stats.latencies
    return {
        "requests": stats.ok,
        "errors": stats.errors,
        "seconds": elapsed,
        "rps": stats.ok / elapsed,
        "p50_ms": percentile(lat, 0.5) * 1000,
        "p99_ms": percentile(lat, 0.99) * 1000,
    }


async def run_streams(url: str, streams: int, timeout: float, ramp: float) -> dict:
    """Open `streams` concurrent streams (spread over `ramp` s), read each to its end."""
    parts = urlsplit(url)
    request = build_request(parts.netloc, parts.path, stream=True)
    stats = Stats(expected_open=streams)
    loop = asyncio.get_running_loop()
    opened = 0

    async def one(i: int) -> None:
        nonlocal opened
        await asyncio.sleep(ramp * i / streams)
        try:
            _, proto = await loop.create_connection(
                lambda: Client(request, stats, True), parts.hostname, parts.port
            )
        except OSError as e:
            stats.errors += 1
            stats.why[f"connect: {e.strerror or e}"] += 1
            stats.expected_open -= 1
            stats.settle()
            return
        opened += 1
        proto.send()
        await proto.finished
        proto.transport.close()

    started = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(streams))), timeout)
        timed_out = False
    except TimeoutError:
        timed_out = True
    delays = stats.delays
    return {
        "streams": streams,
        "completed": stats.ok,
        "errors": stats.errors + (streams - stats.ok - stats.errors),
        "timed_out": timed_out,
        "error_kinds": dict(stats.why),
        "events": stats.events,
        "seconds": time.monotonic() - started,
        "delay_p50_ms": percentile(delays, 0.5) * 1000,
        "delay_p99_ms": percentile(delays, 0.99) * 1000,
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--streams", type=int, default=0, help="streams mode: this many at once")
    p.add_argument("--ramp", type=float, default=0.5, help="open the streams over this many s")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    raise_fd_limit()
    if args.streams:
        result = uvloop.run(run_streams(args.url, args.streams, args.timeout, args.ramp))
    else:
        result = uvloop.run(run_requests(args.url, args.connections, args.duration))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

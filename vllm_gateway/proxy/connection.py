"""One keep-alive HTTP/1.1 connection to a worker, carrying one exchange at a time.

This is the relay's upstream client, built on an asyncio protocol instead of aiohttp's
client: a relay does not need a `ClientResponse`, a payload `StreamReader` or a task
wake-up per chunk. The worker's bytes go through httptools' parser (llhttp, the C parser
uvloop and uvicorn use; callbacks carry plain bytes and it tells where a message ends) and,
once the client's response is committed, straight from `data_received` to the client's
exchange (`exchange.BodySink`): everything that arrived in one read becomes one write,
framed by the exchange as its answer needs. The relay's task sleeps until the exchange ends, fails,
times out or must wait for a slow client; it is not woken per chunk.

    conn.send(head, body)                 the request bytes, written at once
    await conn.wait_head(limit)           status, reason, headers; body bytes may follow
    conn.attach(sink)                     from now on body bytes go to the client
    await conn.wait_body(idle, total_at)  True at the end; False: paused for backpressure

Backpressure: when the client's transport buffers more than its high-water mark (the
sink's `write` says so), reading
from the worker pauses (the kernel's socket buffers then push back on the worker) until
the relay has drained the client; memory per stream stays bounded by that mark.

Errors are kept on `error` (`BROKEN` or `TIMEOUT` with a message); the relay maps them.
A connection may go back to the pool only when its exchange was read to its end and the
worker did not ask to close it (`reusable`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httptools

from vllm_gateway.proxy.exchange import BodySink

# Why an exchange failed (also the lease outcomes they become).
BROKEN = "broken"
TIMEOUT = "timeout"

# Before the client's response is committed, body bytes wait here; past this many bytes
# reading from the worker pauses until the relay commits (bytes; 1 MiB).
PENDING_LIMIT = 1 << 20
# The body's last bytes are kept (`tail`) to see how a stream ended: "data: [DONE]" and its
# line endings, with room to spare (bytes).
TAIL = 32
# A request body at least this big is written beside the head rather than copied onto it.
_COPY_LIMIT = 16 * 1024
# A worker's status line and headers together may not pass this (bytes; 64 KiB, eight
# times vLLM's longest): the parser holds them until the head ends, so without a bound a
# worker sending header lines without end would grow the gateway until `first_byte`.
HEAD_LIMIT = 64 * 1024


class UpstreamConnection(asyncio.Protocol):
    """An HTTP/1.1 connection to one worker; see the module docstring for the protocol."""

    __slots__ = (
        "_held",
        "_idle",
        "_loop",
        "_timer",
        "_total_at",
        "_waiter",
        "body_bytes",
        "busy",
        "complete",
        "content_length",
        "content_type",
        "error",
        "first_body_at",
        "head_bytes",
        "headers",
        "idle_since",
        "keep_alive",
        "key",
        "last_data",
        "on_first_body",
        "out",
        "out_size",
        "parser",
        "paused",
        "pool_idle",
        "reason",
        "reusable",
        "sink",
        "status",
        "tail",
        "transport",
    )

    def __init__(self, key: str, loop: asyncio.AbstractEventLoop) -> None:
        self.key = key  # the pool this connection belongs to (the worker's base URL)
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.reusable = False
        self.busy = False  # an exchange is under way (sent, not finished)
        # The pool's idle set for this worker while the connection sits in it.
        self.pool_idle: dict[UpstreamConnection, None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._idle = 0.0  # the body phase's limits (seconds; loop time), see wait_body
        self._total_at: float | None = None
        self._waiter: asyncio.Future[None] | None = None
        # One parser for the connection's life: llhttp resets itself between messages, and
        # a connection whose parser failed is closed, never reused.
        self.parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self.content_type = b""
        self.keep_alive = False
        self.complete = False
        self.error: tuple[str, str] | None = None
        self.out: list[bytes] = []
        self.out_size = 0
        self.tail = b""  # the last body bytes relayed (to end an event stream cleanly)
        self.body_bytes = 0  # body bytes received so far (telemetry, access log)
        self.first_body_at = 0.0  # time.monotonic() of the first body byte; 0.0: none yet
        # Called once at the first body byte, with the answer's status and the time
        # (dispatch's prefill backlog and rate; None: nobody).
        self.on_first_body: Callable[[int, float], None] | None = None
        self.sink: BodySink | None = None
        self.paused = False  # reading paused until the client drains
        self._held = False  # reading paused until the response is committed
        self.last_data = 0.0
        self.head_bytes = 0  # bytes received while the head was not complete

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.reusable = False
        self._cancel_timer()
        if self.pool_idle is not None:
            self.pool_idle.pop(self, None)
            self.pool_idle = None
        if self.busy and not self.complete and self.error is None:
            what = "" if self.status else " before answering"
            reason = f" ({exc})" if exc else ""
            self.error = (BROKEN, f"closed the connection{what}{reason}")
        self._wake()

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes nobody asked for: this connection cannot be trusted
            self.close()
            return
        self.last_data = self._loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if self.error is None:
                self.error = (BROKEN, f"sent a malformed answer ({e})")
            self.close()
            self._wake()
            return
        if not self.status:  # the head is not complete yet: bound what it may cost
            self.head_bytes += len(data)
            if self.head_bytes > HEAD_LIMIT:
                if self.error is None:
                    self.error = (BROKEN, f"sent a head over {HEAD_LIMIT} bytes")
                self.close()
                self._wake()
                return
        if self.out:
            if self.sink is not None:
                self._flush()
            elif self.out_size > PENDING_LIMIT and self.transport is not None:
                self._held = True
                self.transport.pause_reading()  # resumed by attach()

    def eof_received(self) -> bool:
        return False  # close our side too

    # --- httptools callbacks ---------------------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length":
            self.content_length = int(value)
        elif lower == b"content-type":
            self.content_type = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        if not self.body_bytes:
            self.first_body_at = time.monotonic()
            if self.on_first_body is not None:
                self.on_first_body(self.status, self.first_body_at)
                self.on_first_body = None
        self.body_bytes += len(body)
        self.out.append(body)
        self.out_size += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.keep_alive and self.parser.should_keep_alive()
        self._cancel_timer()
        self._wake()

    # --- the exchange ----------------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> None:
        """Start an exchange: write the request. The connection must be idle and open."""
        self._reset()
        self.reusable = False
        self.busy = True
        transport = self.transport
        assert transport is not None
        if len(body) <= _COPY_LIMIT:
            transport.write(head + body)
        else:
            transport.writelines((head, body))

    async def wait_head(self, limit: float | None) -> None:
        """Wait for the status line and headers (or an error), at most `limit` seconds."""
        if self.status or self.error:
            return
        if limit is not None:
            self._timer = self._loop.call_later(limit, self._head_timeout)
        try:
            while not self.status and self.error is None:
                await self._wait()
        finally:
            self._cancel_timer()

    def body_so_far(self) -> bytes:
        """Take the body bytes that arrived before the client's response was committed."""
        out = self.out
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self.out_size = 0
        if data:
            self._keep_tail(data)
        return data

    def attach(self, sink: BodySink) -> None:
        """Send body bytes from now on straight to `sink` (the client's answer)."""
        self.sink = sink
        if self.out:
            self._flush()
        if self._held and not self.paused and self.transport is not None:
            self._held = False
            self.transport.resume_reading()

    async def wait_body(self, idle: float, total_at: float | None) -> bool:
        """Wait until the body ended (True), or the client needs draining (False).

        `idle` (seconds, 0: none) bounds the silence between two reads from the worker,
        `total_at` (loop time) the whole exchange; an expiry sets `error`.
        """
        if self.complete or self.error:
            return True
        if idle or total_at is not None:
            self._arm_body_timer(idle, total_at)
        try:
            while not self.complete and self.error is None and not self.paused:
                await self._wait()
        finally:
            self._cancel_timer()
        return not self.paused

    def resume(self) -> None:
        """The client drained: read from the worker again."""
        self.paused = False
        self.last_data = self._loop.time()  # time spent waiting for the client is not idle
        if self.transport is not None:
            self.transport.resume_reading()

    def finish(self) -> None:
        """The exchange is over: the connection may be reused if it ended cleanly."""
        self.sink = None
        self.on_first_body = None  # (an answer without a body never called it)
        self.busy = False
        self.reusable = (
            self.complete
            and self.keep_alive
            and self.error is None
            and self.transport is not None
            and not self.transport.is_closing()
        )
        if not self.reusable:
            self.close()
        elif not self.transport.is_reading():  # type: ignore[union-attr]
            # Reading was paused for this exchange (a slow client, or one that left just
            # as the last bytes came); an idle connection must be read again, or the next
            # request on it waits for an answer nobody reads, and a close by the worker
            # goes unseen. Found by the soak (benchmarks/soak.py).
            self.paused = self._held = False
            self.transport.resume_reading()  # type: ignore[union-attr]

    def close(self) -> None:
        """Close the connection (the worker sees its client go away and aborts)."""
        self.reusable = False
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()

    # --- internals -------------------------------------------------------------------------

    def _flush(self) -> None:
        out = self.out
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self.out_size = 0
        # _keep_tail, inlined: this runs once per read from the worker (and the sink's write
        # is a call of its own).
        self.tail = data if len(data) >= TAIL else (self.tail + data)[-TAIL:]
        sink = self.sink
        assert sink is not None
        if sink.write(data) and not self.complete:
            # The client's buffer is over its high-water mark (or the client is gone): stop
            # reading the worker; the relay drains the client, then `resume`s.
            self.paused = True
            if self.transport is not None:
                self.transport.pause_reading()
            self._wake()

    def _keep_tail(self, data: bytes) -> None:
        # The last piece itself, or for tiny pieces (a drip) the last TAIL bytes joined.
        self.tail = data if len(data) >= TAIL else (self.tail + data)[-TAIL:]

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timeout(self) -> None:
        self._timer = None
        if not self.status and self.error is None:
            self.error = (TIMEOUT, "head")
            self._wake()

    def _arm_body_timer(self, idle: float, total_at: float | None) -> None:
        # One timer for the whole body, not one per chunk: when it fires, it checks how
        # long the worker has really been silent and re-arms for what is left. A bound
        # method and two slots, not a closure: this lives as long as the stream.
        self._idle = idle
        self._total_at = total_at
        at = (self.last_data or self._loop.time()) + idle if idle else None
        if total_at is not None:
            at = total_at if at is None else min(at, total_at)
        if at is not None:
            self._timer = self._loop.call_at(at, self._body_timer_fired)

    def _body_timer_fired(self) -> None:
        self._timer = None
        if self.complete or self.error is not None:
            return
        idle, total_at = self._idle, self._total_at
        now = self._loop.time()
        if total_at is not None and now >= total_at:
            self.error = (TIMEOUT, "total")
        elif idle and now >= self.last_data + idle:
            self.error = (TIMEOUT, "idle")
        else:
            at = self.last_data + idle if idle else now + 3600.0
            if total_at is not None:
                at = min(at, total_at)
            self._timer = self._loop.call_at(at, self._body_timer_fired)
            return
        self._wake()

"""One request of a front path connection and its answer: `FrontExchange`, the
`exchange.Exchange` the connection (front.py) makes for each request it serves.

It holds what the relay handler reads of the request (path, headers, the body as the
connection's reader delivers it) and writes the answer on the client's transport as aiohttp
would frame it (wire.py): whole (`answer`), or a head and then body bytes, re-framed as
chunks when the worker gave no length (`start_response`, which gives a `FrontSink`).
Backpressure is the transport's own flow control, which the connection passes on through a
`FlowControl` shared by its exchanges; the sink's `drain` waits on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from multidict import CIMultiDict

from vllm_gateway.errors import GatewayError
from vllm_gateway.http.wire import (
    COPY_LIMIT,
    NO_BODY,
    DateHeader,
    TransportSink,
    chunk,
    render_head,
)
from vllm_gateway.proxy.exchange import Headers

# A request body is kept as the pieces the parser gives, up to this many (the common body
# comes in one or a few); later pieces are appended to one buffer.
_MAX_PARTS = 64
_NO_HEADERS: Headers = []


class FlowControl:
    """A connection's write side: paused while the client's transport buffers more than
    its high-water mark (`pause_writing` / `resume_writing`), and who waits for it."""

    __slots__ = ("_waiter", "loop", "paused")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.paused = False
        self._waiter: asyncio.Future[None] | None = None

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def lost(self) -> None:
        """The client went away: whoever waits gets ConnectionResetError."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client went away"))

    async def wait(self) -> None:
        """Return once writing is not paused."""
        if not self.paused:
            return
        waiter = self._waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None


class FrontExchange:
    """One request a front connection serves, and its answer (module docstring)."""

    __slots__ = (
        "_body_waiter",
        "_headers",
        "answer_done",
        "answer_started",
        "body_error",
        "body_parts",
        "close_after",
        "content_length",
        "date",
        "extra_headers",
        "flow",
        "keep_alive",
        "message_done",
        "path",
        "path_qs",
        "raw_headers",
        "request_id",
        "transport",
    )

    method = "POST"  # the only method served on the front path

    def __init__(
        self,
        transport: asyncio.Transport,
        flow: FlowControl,
        date: DateHeader,
        path: str,
        path_qs: str,
        raw_headers: Headers,
        content_length: int | None,
        keep_alive: bool,
    ) -> None:
        self.transport = transport
        self.flow = flow
        self.date = date
        self.path = path
        self.path_qs = path_qs
        self.raw_headers = raw_headers
        self.content_length = content_length
        self.keep_alive = keep_alive
        self._headers: CIMultiDict[str] | None = None
        self.request_id: str | None = None
        self.extra_headers = _NO_HEADERS
        self.message_done = False  # the whole request (its body) has been read
        self.body_parts: list[bytes | bytearray] = []  # one buffer last if many (on_body)
        self.body_error: GatewayError | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self.close_after = False  # the connection closes once this answer is out
        self.answer_started = False
        self.answer_done = False

    # --- the body, as the connection's reader delivers it ----------------------------------

    def on_body(self, body: bytes) -> None:
        parts = self.body_parts
        if len(parts) < _MAX_PARTS:
            parts.append(body)
            return
        # A body in many pieces (tiny chunks): the rest goes into one buffer, not an object
        # per piece (about 35 bytes each, however small the piece).
        if type(parts[-1]) is not bytearray:
            parts.append(bytearray())
        parts[-1] += body

    def body_done(self, error: GatewayError | None = None) -> None:
        """The request's body ended (or failed with `error`: nothing more is read, and the
        connection closes after the answer)."""
        if error is not None:
            self.body_error = error
            self.body_parts = []
            self.close_after = True
        self.message_done = True
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def connection_lost(self) -> None:
        """The client went away: a wait for the body ends with ConnectionResetError."""
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client went away"))

    # --- the Exchange: the request ---------------------------------------------------------

    @property
    def headers(self) -> Mapping[str, str]:
        headers = self._headers
        if headers is None:
            headers = self._headers = CIMultiDict(
                [
                    (n.decode("latin-1"), v.decode("utf-8", "surrogateescape"))
                    for n, v in self.raw_headers
                ]
            )
        return headers

    @property
    def remote(self) -> str | None:
        peer = self.transport.get_extra_info("peername")
        return str(peer[0]) if isinstance(peer, tuple) and peer else None

    def body_ready(self) -> bool:
        return self.message_done

    async def read_body(self, limit: int) -> bytes:
        # `limit` is the reader's (front.py gives it max_body_bytes): a body over it ended
        # with BodyTooLarge as it arrived.
        if not self.message_done:
            waiter = self._body_waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._body_waiter = None
        if self.body_error is not None:
            raise self.body_error
        parts, self.body_parts = self.body_parts, []  # the caller holds the body now
        first = parts[0] if parts else b""
        if len(parts) <= 1 and type(first) is bytes:
            return first  # the parser's own bytes, not a copy (the common case)
        return b"".join(parts)

    def release_body(self) -> None:
        pass  # read_body kept no copy

    # --- the Exchange: the answer ----------------------------------------------------------

    def _head(
        self, status: int, reason: bytes, headers: Headers, length: int | None, chunked: bool
    ) -> bytes:
        return render_head(
            status,
            reason,
            headers + self.extra_headers if self.extra_headers else headers,
            date=self.date,
            request_id=self.request_id,
            length=length,
            chunked=chunked,
            close=self.close_after or not self.keep_alive or not self.message_done,
        )

    def _send(self, data: bytes, body: bytes = b"") -> None:
        transport = self.transport
        if transport.is_closing():
            raise ConnectionResetError("the client went away")
        if len(body) < COPY_LIMIT:
            transport.write(data + body if body else data)
        else:
            transport.writelines((data, body))

    async def answer(
        self, status: int, reason: bytes, headers: Headers, body: bytes, *, close: bool = False
    ) -> None:
        if close:
            self.close_after = True
        if status in NO_BODY or status < 200:
            body = b""
            head = self._head(status, reason, headers, None, False)
        else:
            head = self._head(status, reason, headers, len(body), False)
        self.answer_started = True
        self._send(head, body)
        self.answer_done = True

    async def start_response(
        self, status: int, reason: bytes, headers: Headers, length: int | None, first: bytes
    ) -> FrontSink:
        no_body = status in NO_BODY or status < 200
        chunked = length is None and not no_body
        head = self._head(status, reason, headers, None if no_body else length, chunked)
        self.answer_started = True
        self._send(head, chunk(first) if first and chunked else first)
        return FrontSink(self, chunked)

    def cut(self) -> None:
        self.close_after = True
        self.transport.close()


class FrontSink(TransportSink):
    """The body of a streamed answer on the front path: framed by `TransportSink`,
    drained by the connection's flow control, ended by its exchange."""

    __slots__ = ("exchange",)

    def __init__(self, exchange: FrontExchange, chunked: bool) -> None:
        super().__init__(exchange.transport, chunked)
        self.exchange = exchange

    async def drain(self) -> None:
        if not self.transport.is_closing():
            await self.exchange.flow.wait()
        if self.transport.is_closing():
            raise ConnectionResetError("the client went away")

    async def end(self) -> None:
        if self.chunked:
            self.exchange._send(b"0\r\n\r\n")
        self.exchange.answer_done = True

    def abort(self) -> None:
        self.exchange.close_after = True
        self.transport.abort()

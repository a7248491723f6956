"""The front path's answers: `FrontExchange`, the `exchange.Exchange` of the request a
`front.FrontConnection` is serving.

It holds what the relay handler reads of that request (path, headers, the body as it
arrives) and writes the answer on the client's transport as aiohttp would frame it: the
status line, the worker's end-to-end headers, `X-Request-Id`, `Content-Length` or chunked,
`Date`, `Server` and a default `Content-Type` as aiohttp sets them, and `Connection: close`
when the connection ends after this answer. Error answers are `errors.error_parts` written
the same way. Backpressure is the transport's own flow control (`pause_writing`,
`resume_writing`), which `drain` waits on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING

from aiohttp.http import SERVER_SOFTWARE
from multidict import CIMultiDict

from vllm_gateway.errors import BodyTooLarge, GatewayError, error_parts
from vllm_gateway.proxy.exchange import Headers

if TYPE_CHECKING:
    from vllm_gateway.http.front import Front

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_SERVER = SERVER_SOFTWARE.encode()
# Answers with these statuses have no body, so no framing headers (RFC 9110 6.4.1).
_NO_BODY = frozenset({204, 304})
# Body bytes at least this long are written beside the head rather than copied onto it.
_COPY_LIMIT = 16 * 1024
# A request body is kept as the pieces the parser gives, up to this many (the common body
# comes in one or a few); later pieces are appended to one buffer.
_MAX_PARTS = 64


class DateHeader:
    """The Date header's value, formatted once a second (as aiohttp does)."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = 0
        self._value = b""

    def __call__(self, now: float) -> bytes:
        second = int(now)
        if second != self._second:
            self._second = second
            self._value = formatdate(second, usegmt=True).encode()
        return self._value


class FrontExchange(asyncio.Protocol):
    """The request a front connection serves, and its answer (module docstring)."""

    __slots__ = (
        "_body_waiter",
        "_drain_waiter",
        "_headers",
        "answer_chunked",
        "answer_done",
        "answer_started",
        "body_error",
        "body_parts",
        "body_size",
        "closing",
        "content_length",
        "front",
        "keep_alive",
        "loop",
        "message_done",
        "path",
        "path_qs",
        "raw_headers",
        "request_id",
        "transport",
        "write_paused",
    )

    method = "POST"  # the only method served on the front path

    def __init__(self, front: Front) -> None:
        self.front = front
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closing = False  # close once the current answer is out
        self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._new_request()

    def _new_request(self) -> None:
        """Forget the previous request's state."""
        self.raw_headers: Headers = []
        self._headers: CIMultiDict[str] | None = None
        self.keep_alive = True
        self.message_done = False  # the whole request (its body) has been read
        self.path = ""
        self.path_qs = ""
        self.content_length: int | None = None
        self.body_parts: list[bytes | bytearray] = []  # one buffer last if many (on_body)
        self.body_size = 0
        self.body_error: GatewayError | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self.request_id: str | None = None
        self.answer_started = False
        self.answer_chunked = False
        self.answer_done = False

    # --- flow control and the body, as the connection feeds it -----------------------------

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        size = self.body_size = self.body_size + len(body)
        if self.body_error is not None:
            return
        limit = self.front.routes.max_body_bytes
        if size > limit:
            self.body_done(BodyTooLarge(f"The request body is too large: more than {limit} bytes."))
            return
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
            self.closing = True
        self.message_done = True
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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
        transport = self.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        return str(peer[0]) if isinstance(peer, tuple) and peer else None

    def body_ready(self) -> bool:
        return self.message_done

    async def read_body(self, limit: int) -> bytes:
        if not self.message_done:
            waiter = self._body_waiter = self.loop.create_future()
            try:
                await waiter
            finally:
                self._body_waiter = None
        if self.body_error is not None:
            raise self.body_error
        parts, self.body_parts = self.body_parts, []  # the caller holds the body now
        # One piece is the parser's own bytes (a buffer comes only after _MAX_PARTS pieces).
        return parts[0] if len(parts) == 1 else b"".join(parts)  # type: ignore[return-value]

    def release_body(self) -> None:
        pass  # read_body kept no copy

    # --- the Exchange: the answer ----------------------------------------------------------

    def _head(
        self, status: int, reason: bytes, headers: Headers, length: int | None, chunked: bool
    ) -> bytes:
        """Status line and headers, framed as aiohttp frames a relayed answer."""
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, reason or _REASONS.get(status, b""))]
        date = server = ctype = False
        for name, value in headers:
            parts.append(b"%s: %s\r\n" % (name, value))
            lower = name.lower()
            if lower == b"date":
                date = True
            elif lower == b"server":
                server = True
            elif lower == b"content-type":
                ctype = True
        if self.request_id:
            parts.append(b"X-Request-Id: %s\r\n" % self.request_id.encode())
        # CORS for a browser's request (the headers are parsed already: the relay read them).
        if (cors := self.front.cors) is not None and (origin := self.headers.get("Origin")):
            parts.append(cors.answer_bytes(origin, "Cookie" in self.headers))
        if chunked:
            parts.append(b"Transfer-Encoding: chunked\r\n")
        elif length is not None:
            parts.append(b"Content-Length: %d\r\n" % length)
        if not ctype and length != 0 and status not in _NO_BODY:
            parts.append(b"Content-Type: application/octet-stream\r\n")
        if not date:
            parts.append(b"Date: %s\r\n" % self.front.date(time.time()))
        if not server:
            parts.append(b"Server: %s\r\n" % _SERVER)
        if self.closing or not self.keep_alive or self.front.closing or not self.message_done:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _send(self, data: bytes, body: bytes = b"") -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        if len(body) < _COPY_LIMIT:
            transport.write(data + body if body else data)
        else:
            transport.writelines((data, body))

    async def answer(self, status: int, reason: bytes, headers: Headers, body: bytes) -> None:
        if status in _NO_BODY or status < 200:
            body = b""
            head = self._head(status, reason, headers, None, False)
        else:
            head = self._head(status, reason, headers, len(body), False)
        self.answer_started = True
        self._send(head, body)
        self.answer_done = True

    async def begin(
        self, status: int, reason: bytes, headers: Headers, length: int | None, first: bytes
    ) -> bool:
        no_body = status in _NO_BODY or status < 200
        chunked = self.answer_chunked = length is None and not no_body
        head = self._head(status, reason, headers, None if no_body else length, chunked)
        self.answer_started = True
        if first and chunked:
            self._send(head, b"%x\r\n%b\r\n" % (len(first), first))
        else:
            self._send(head, first)
        return chunked

    async def write(self, data: bytes) -> None:
        if self.answer_chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        self._send(data)

    async def end(self) -> None:
        if self.answer_chunked:
            self._send(b"0\r\n\r\n")
        self.answer_done = True

    async def drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client went away")
        if not self.write_paused:
            return
        waiter = self._drain_waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._drain_waiter = None

    def cut(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def _answer_error(self, error: GatewayError) -> None:
        """Answer with an OpenAI error body (errors.error_parts), unless an answer began."""
        transport = self.transport
        if transport is None:
            return
        if self.answer_started:
            transport.close()  # as aiohttp: too late for an error answer
            return
        if error.closes_connection:
            self.closing = True
        status, extra, body = error_parts(error, self.request_id)
        headers = [(b"Content-Type", b"application/json")]
        headers += [(k.encode(), v.encode()) for k, v in extra.items() if k != "X-Request-Id"]
        self.answer_started = True
        self._send(self._head(status, b"", headers, len(body), False), body)
        self.answer_done = True

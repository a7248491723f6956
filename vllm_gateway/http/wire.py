"""HTTP/1.1 answers as bytes, as aiohttp's server frames them: the front path's exchanges
(front_exchange.py) and the refusals written before any request exists (guard.py).

`render_head` writes the status line and headers: the given ones, then `X-Request-Id`,
the framing (`Transfer-Encoding: chunked` or `Content-Length`), and the defaults aiohttp's
`StreamResponse` adds (`Content-Type: application/octet-stream` for a body, `Date`,
`Server`), and `Connection: close` when the connection ends after this answer.
`TransportSink` (the base of both exchanges' `BodySink`s) is the one place a body is
framed as chunks (`chunk` for a piece sent with the head).
"""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate
from http import HTTPStatus

from aiohttp.http import SERVER_SOFTWARE

from vllm_gateway.errors import GatewayError, error_parts
from vllm_gateway.proxy.exchange import Headers

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_SERVER = SERVER_SOFTWARE.encode()
# Answers with these statuses have no body, so no framing headers (RFC 9110 6.4.1).
NO_BODY = frozenset({204, 304})
# Body bytes at least this long are written beside what precedes them rather than copied.
COPY_LIMIT = 16 * 1024


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


def render_head(
    status: int,
    reason: bytes,
    headers: Headers,
    *,
    date: DateHeader,
    request_id: str | None,
    length: int | None,
    chunked: bool,
    close: bool,
) -> bytes:
    """Status line and headers, framed as aiohttp frames an answer (module docstring)."""
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, reason or _REASONS.get(status, b""))]
    has_date = has_server = has_ctype = False
    for name, value in headers:
        parts.append(b"%s: %s\r\n" % (name, value))
        lower = name.lower()
        if lower == b"date":
            has_date = True
        elif lower == b"server":
            has_server = True
        elif lower == b"content-type":
            has_ctype = True
    if request_id:
        parts.append(b"X-Request-Id: %s\r\n" % request_id.encode())
    if chunked:
        parts.append(b"Transfer-Encoding: chunked\r\n")
    elif length is not None:
        parts.append(b"Content-Length: %d\r\n" % length)
    if not has_ctype and length != 0 and status not in NO_BODY:
        parts.append(b"Content-Type: application/octet-stream\r\n")
    if not has_date:
        parts.append(b"Date: %s\r\n" % date(time.time()))
    if not has_server:
        parts.append(b"Server: %s\r\n" % _SERVER)
    if close:
        parts.append(b"Connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def error_headers(error: GatewayError) -> tuple[int, Headers, bytes]:
    """The status, headers (X-Request-Id aside: the exchange adds it, with the gateway's
    headers for every answer) and body of an OpenAI error answer (`errors.error_parts`)."""
    status, more, body = error_parts(error)
    headers = [(b"Content-Type", b"application/json")]
    headers += [(k.encode(), v.encode()) for k, v in more.items()]
    return status, headers, body


def error_answer(error: GatewayError, date: DateHeader) -> bytes:
    """A whole error answer that closes the connection (a refusal before any request)."""
    status, headers, body = error_headers(error)
    head = render_head(
        status,
        b"",
        headers,
        date=date,
        request_id=None,
        length=len(body),
        chunked=False,
        close=True,
    )
    return head + body


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class TransportSink:
    """Body bytes of a streamed answer, written to the client's transport: as they are, or
    as one chunk per write when `chunked`. Subclasses say how to drain and end."""

    __slots__ = ("chunked", "high_water", "transport")

    def __init__(self, transport: asyncio.Transport, chunked: bool) -> None:
        self.transport = transport
        self.chunked = chunked
        self.high_water = transport.get_write_buffer_limits()[1]

    def write(self, data: bytes) -> bool:
        """One write per call (the relay's one per read from the worker); True when the
        client's transport buffers more than its high-water mark, or is closing."""
        transport = self.transport
        if transport.is_closing():
            return True  # the client is gone: drain says so
        if not self.chunked:
            transport.write(data)
        elif len(data) < COPY_LIMIT:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            transport.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        return transport.get_write_buffer_size() > self.high_water

    def abort(self) -> None:
        self.transport.abort()

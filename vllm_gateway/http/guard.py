"""Bounds on what a client connection costs before it is anyone's: the connection limit,
and the head guard in front of aiohttp's protocol.

`ConnectionLimit` counts a process's open client connections (the front path's and
aiohttp's alike). Past `client.max_connections` a new one is refused cleanly: accepted,
answered `503` with an OpenAI error body and `Connection: close`, and closed. Accepting and
closing rather than not accepting: a listening socket that stops accepting leaves new
clients in the kernel's backlog with no answer until they time out (and with
`--processes N` and SO_REUSEPORT the kernel would keep sending them to this process); a
refusal tells the client at once, costs no memory past the accept, and can be retried.

`HeadGuard` sits between the transport and aiohttp's `RequestHandler`: it feeds every byte
to an httptools parser of its own as well, only to count the bytes of each request head
(request line and header lines). aiohttp bounds a head's lines (`max_field_size`) and
their number (`max_headers`), not their total: 128 lines of 8 KiB each is a megabyte held
per connection before any key is checked. Past `client.max_head_bytes` the guard answers
431 and closes the connection. The front path bounds the heads it reads itself
(front_reader.py); it puts this guard in front of aiohttp when it hands a connection over.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, cast

import httptools

from vllm_gateway.errors import GatewayError, MalformedRequest
from vllm_gateway.http.wire import DateHeader, error_answer
from vllm_gateway.log import get_logger

log = get_logger("vllm_gateway.guard")

# The bytes a header line costs besides its name and value (": " and CRLF).
_LINE = 4


class Reporter(Protocol):
    """Who hears of a refusal (`gate.Gate`: the error hooks count and log it)."""

    def fire(self, error: GatewayError, method: str, path: str, request_id: str | None) -> None: ...


def head_too_large(limit: int) -> MalformedRequest:
    """The 431 for a head over `client.max_head_bytes`."""
    error = MalformedRequest(
        f"The request line and headers are too large: more than {limit} bytes in all."
    )
    error.status = 431
    return error


def too_many_connections(limit: int) -> GatewayError:
    """The 503 for a connection past `client.max_connections`."""
    error = GatewayError(
        f"Too many open connections to this gateway process (limit {limit}); retry later."
    )
    error.status = 503
    error.type = "server_error"
    error.code = "too_many_connections"  # counted apart in /metrics' errors by code
    error.retry_after = 1.0
    error.closes_connection = True
    return error


class ConnectionLimit:
    """A process's open client connections, and the bound on them (module docstring)."""

    __slots__ = ("date", "maximum", "open", "refused", "reporter")

    def __init__(self, maximum: int, reporter: Reporter | None = None) -> None:
        self.maximum = maximum  # 0: no limit
        self.open = 0
        self.refused = 0  # connections refused for the limit, since the start
        self.reporter = reporter
        self.date = DateHeader()

    def admit(self, transport: asyncio.Transport) -> bool:
        """Count a new connection, or refuse it (answer 503, close) and return False."""
        maximum = self.maximum
        if maximum and self.open >= maximum:
            self.refused += 1
            error = too_many_connections(maximum)
            if self.refused == 1 or not self.refused % 1000:
                log.warning("connection refused", reason=error.message, refused=self.refused)
            if self.reporter is not None:
                self.reporter.fire(error, "", "", None)
            transport.write(error_answer(error, self.date))
            transport.close()
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1


class HeadGuard(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind a bound on each head's total size."""

    __slots__ = (
        "counted",
        "date",
        "head_bytes",
        "in_head",
        "inner",
        "limit",
        "max_head_bytes",
        "parser",
        "reporter",
        "transport",
        "url",
    )

    def __init__(
        self,
        inner: asyncio.Protocol,
        limit: ConnectionLimit,
        max_head_bytes: int,
        date: DateHeader,
        reporter: Reporter | None,
        *,
        counted: bool,
    ) -> None:
        self.inner = inner
        self.limit = limit
        self.max_head_bytes = max_head_bytes
        self.date = date
        self.reporter = reporter
        self.counted = counted  # this connection counts against the limit (release it)
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.in_head = False
        self.head_bytes = 0
        self.url = b""

    # --- asyncio.Protocol, passed on to aiohttp's --------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is none of asyncio's classes
        self.transport = transport
        if not self.counted:
            if not self.limit.admit(transport):
                self.parser = None
                return
            self.counted = True
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.parser = None  # it holds our callbacks: let the cycle go
        if not self.counted:
            return  # refused: aiohttp never saw it
        self.counted = False
        self.limit.release()
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is not None:
            try:
                parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self.parser = None  # not HTTP/1.1 from here on: aiohttp's to judge
            except httptools.HttpParserError:
                self.parser = None  # aiohttp's parser refuses it too, and says why
            if self.head_bytes > self.max_head_bytes:
                self._refuse()
                return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # --- httptools callbacks: counting a head's bytes --------------------------------------

    def on_message_begin(self) -> None:
        self.in_head = True
        self.head_bytes = 0
        self.url = b""

    def on_url(self, url: bytes) -> None:
        if self.in_head:
            self.head_bytes += len(url) + 16  # method, version, spaces, CRLF: about
            if len(self.url) < 200:
                self.url += url[:200]

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:
            self.head_bytes += len(name) + len(value) + _LINE

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_bytes = 0

    def _refuse(self) -> None:
        """A head over the bound: answer 431 (as aiohttp answers a line too long) and close."""
        self.parser = None
        error = head_too_large(self.max_head_bytes)
        log.debug("request head too large", error=error.message)
        if self.reporter is not None:
            path = self.url.partition(b"?")[0].decode("latin-1")
            self.reporter.fire(error, "", path, None)
        transport = self.transport
        if transport is not None:
            transport.write(error_answer(error, self.date))
            transport.close()

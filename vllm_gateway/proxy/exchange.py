"""The client's side of one relayed request: what the relay handler reads, how it answers.

`routes.Routes.relay` and `relay.Relay` are written once against `Exchange`. It has two
implementations:

- `front.FrontConnection`, the gateway's own HTTP/1.1 protocol, serves the common relay
  request without building aiohttp's request and response objects (front.py says which);
- `AiohttpExchange` (below) wraps aiohttp's `web.Request` for the relay requests aiohttp's
  server parsed: the ones the front path handed over (`Expect`, `Content-Encoding`,
  HTTP/1.0, ...), and every request of an app served without the front path.

An answer is committed once, either whole (`answer`: status, headers and body in one write)
or as a stream (`begin`, then the body goes straight to `transport`, `write` for the
gateway's own last words, `end`); `cut` closes the connection so the client sees an
unfinished answer. Headers are the worker's end-to-end ones as raw bytes; each exchange adds
`X-Request-Id` and its own framing (Content-Length or chunked).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDict

from vllm_gateway.errors import BadRequest

Headers = list[tuple[bytes, bytes]]

# The request id, on aiohttp's request (error_middleware reads it for error answers).
REQUEST_ID = web.RequestKey("request_id", str)


class Exchange(Protocol):
    """One request from a client and its answer (see the module docstring)."""

    method: str
    path: str  # the path without the query: routing, errors, client keys
    path_qs: str  # path and query, sent on to the worker
    raw_headers: Sequence[tuple[bytes, bytes]]  # as the client sent them, in order
    request_id: str | None  # set by the handler; the answer carries it
    content_length: int | None

    @property
    def headers(self) -> Mapping[str, str]:
        """The request headers, looked up case-insensitively."""
        ...

    @property
    def remote(self) -> str | None:
        """The client's address, for log lines."""
        ...

    @property
    def transport(self) -> asyncio.Transport | None:
        """The client's transport; None once the client went away."""
        ...

    def body_ready(self) -> bool:
        """Has the whole body arrived (so reading it needs no timer)?"""
        ...

    async def read_body(self, limit: int) -> bytes:
        """The whole body; BodyTooLarge past `limit` bytes, BadRequest when unreadable."""
        ...

    def release_body(self) -> None:
        """Drop any copy of the body kept for a second read (it is not needed any more)."""
        ...

    async def answer(self, status: int, reason: bytes, headers: Headers, body: bytes) -> None:
        """Send a whole answer at once."""
        ...

    async def begin(
        self, status: int, reason: bytes, headers: Headers, length: int | None, first: bytes
    ) -> bool:
        """Send the status, headers and the body's first bytes; True when the body that
        follows must be framed as chunks (no length known)."""
        ...

    async def write(self, data: bytes) -> None:
        """Send more body bytes (after `begin`), framed as the answer is."""
        ...

    async def end(self) -> None:
        """End the answer properly."""
        ...

    async def drain(self) -> None:
        """Wait until the client's transport buffers less than its high-water mark."""
        ...

    def cut(self) -> None:
        """Close the connection: an answer already begun is visibly incomplete."""
        ...


class RelayResponse(web.StreamResponse):
    """A StreamResponse whose headers wait for the first body bytes, so a whole answer
    leaves in one write (one syscall, one wake-up of the client) instead of two."""

    _send_headers_immediately = False


class AiohttpExchange:
    """`Exchange` over aiohttp's request; the response it builds is `response`."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def method(self) -> str:
        return self.request.method

    @property
    def path(self) -> str:
        return self.request.path

    @property
    def path_qs(self) -> str:
        return self.request.path_qs

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]:
        return self.request.raw_headers

    @property
    def headers(self) -> Mapping[str, str]:
        return self.request.headers

    @property
    def remote(self) -> str | None:
        return self.request.remote

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.request.transport

    @property
    def content_length(self) -> int | None:
        try:
            return self.request.content_length
        except ValueError:  # more digits (leading zeros) than int() takes; the parser read
            return None  # the body by its value all the same, within client_max_size

    @property
    def request_id(self) -> str | None:
        return self.request.get(REQUEST_ID)

    @request_id.setter
    def request_id(self, value: str) -> None:
        self.request[REQUEST_ID] = value  # error_middleware puts it on error answers

    def body_ready(self) -> bool:
        return self.request.content.is_eof()

    async def read_body(self, limit: int) -> bytes:
        # aiohttp enforces `limit` itself (the app's client_max_size) on bodies without a
        # length or with a coding; error_middleware maps its 413 as for every route.
        try:
            return await self.request.read()
        except web.RequestPayloadError:  # e.g. not in the Content-Encoding it claims
            coding = self.request.headers.get("Content-Encoding", "identity")[:40]
            raise BadRequest(
                f"The request body could not be read (Content-Encoding: {coding})."
            ) from None

    def release_body(self) -> None:
        self.request._read_bytes = None  # aiohttp's copy, kept for a second read()

    def _response(self, status: int, reason: bytes, headers: Headers) -> RelayResponse:
        out: CIMultiDict[str] = CIMultiDict()
        for name, value in headers:
            out.add(name.decode("latin-1"), value.decode("utf-8", "replace"))
        if self.request_id:
            out["X-Request-Id"] = self.request_id
        response = self.response = RelayResponse(
            status=status, reason=reason.decode("latin-1") or None, headers=out
        )
        return response

    async def answer(self, status: int, reason: bytes, headers: Headers, body: bytes) -> None:
        response = self._response(status, reason, headers)
        response.content_length = len(body)
        await response.prepare(self.request)
        await response.write_eof(body)

    async def begin(
        self, status: int, reason: bytes, headers: Headers, length: int | None, first: bytes
    ) -> bool:
        response = self._response(status, reason, headers)
        chunked = False
        if length is not None:
            response.content_length = length
        elif self.request.version >= (1, 1):
            response.enable_chunked_encoding()
            chunked = True
        await response.prepare(self.request)
        await response.write(first)  # the headers, and any body so far
        return chunked

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()

    async def drain(self) -> None:
        await self.request.writer.drain()

    def cut(self) -> None:
        if self.response is not None:
            self.response.force_close()
        if self.request.transport is not None:
            self.request.transport.close()

"""`AiohttpExchange`: the `exchange.Exchange` of a request aiohttp's server parsed.

Those are the relay requests the front path handed over (`Expect`, `Content-Encoding`,
HTTP/1.0, ...) and every request of an app served without the front path. A whole answer is
a `web.Response` (head and body in one write); a streamed one a `web.StreamResponse` whose
framing aiohttp chose at `prepare` (a length, chunks on HTTP/1.1, the connection's end on
HTTP/1.0), after which the exchange is its own `BodySink`: body bytes go to the transport
framed the same way (wire.write_body), and `end` lets aiohttp write the last chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from aiohttp import web
from multidict import CIMultiDict

from vllm_gateway.errors import BadRequest, BodyTooLarge
from vllm_gateway.http.wire import write_body
from vllm_gateway.proxy.exchange import Headers

# The request id, on aiohttp's request (tests find a request's objects by it).
REQUEST_ID = web.RequestKey("request_id", str)
_NO_HEADERS: Headers = []


class AiohttpExchange:
    """`Exchange` over aiohttp's request (module docstring); its answer is `response`."""

    __slots__ = ("chunked", "extra_headers", "high_water", "request", "response", "transport")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.extra_headers = _NO_HEADERS
        self.transport: asyncio.Transport | None = None  # the client's, once streaming
        self.chunked = False
        self.high_water = 0

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
    def content_length(self) -> int | None:
        try:
            return self.request.content_length
        except ValueError:  # more digits (leading zeros) than int() takes; the parser read
            return None  # the body by its value all the same

    @property
    def request_id(self) -> str | None:
        return self.request.get(REQUEST_ID)

    @request_id.setter
    def request_id(self, value: str | None) -> None:
        if value is not None:
            self.request[REQUEST_ID] = value

    @property
    def answer_started(self) -> bool:
        return self.response is not None and self.response.prepared

    def body_ready(self) -> bool:
        return self.request.content.is_eof()

    async def read_body(self, limit: int) -> bytes:
        # Read from the payload stream rather than `request.read()`, which keeps a copy on
        # the request for a second read; the limit is enforced here, as on the front path.
        content = self.request.content
        parts: list[bytes] = []
        size = 0
        try:
            while chunk := await content.readany():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"The request body is too large: more than {limit} bytes.")
                parts.append(chunk)
        except web.RequestPayloadError:  # e.g. not in the Content-Encoding it claims
            coding = self.request.headers.get("Content-Encoding", "identity")[:40]
            raise BadRequest(
                f"The request body could not be read (Content-Encoding: {coding})."
            ) from None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release_body(self) -> None:
        pass  # read_body kept no copy

    def _headers(self, headers: Headers) -> CIMultiDict[str]:
        out: CIMultiDict[str] = CIMultiDict()
        for name, value in headers + self.extra_headers if self.extra_headers else headers:
            out.add(name.decode("latin-1"), value.decode("utf-8", "replace"))
        if self.request_id:
            out["X-Request-Id"] = self.request_id
        return out

    async def answer(
        self, status: int, reason: bytes, headers: Headers, body: bytes, *, close: bool = False
    ) -> None:
        response = self.response = web.Response(
            status=status,
            reason=reason.decode("latin-1") or None,
            headers=self._headers(headers),
            body=body,
        )
        if close:
            response.force_close()
        await response.prepare(self.request)
        await response.write_eof()

    async def start_response(
        self, status: int, reason: bytes, headers: Headers, length: int | None, first: bytes
    ) -> AiohttpExchange:
        response = self.response = web.StreamResponse(
            status=status, reason=reason.decode("latin-1") or None, headers=self._headers(headers)
        )
        if length is not None:
            response.content_length = length
        elif self.request.version >= (1, 1):
            response.enable_chunked_encoding()
            self.chunked = True
        await response.prepare(self.request)  # the head, framed by aiohttp
        transport = self.transport = self.request.transport
        if transport is None:
            raise ConnectionResetError("the client went away")
        self.high_water = transport.get_write_buffer_limits()[1]
        if first:
            write_body(transport, first, self.chunked)
        return self

    def cut(self) -> None:
        if self.response is not None:
            self.response.force_close()
        if self.request.transport is not None:
            self.request.transport.close()

    # --- the BodySink of a streamed answer -------------------------------------------------

    def write(self, data: bytes) -> bool:
        transport = self.transport
        if transport is None or transport.is_closing():
            return True  # the client is gone: drain says so
        write_body(transport, data, self.chunked)
        return transport.get_write_buffer_size() > self.high_water

    async def drain(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            await self.request.writer.drain()
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


# The exchange of a request, set by the gate's middleware for the relay handler.
EXCHANGE = web.RequestKey("exchange", AiohttpExchange)

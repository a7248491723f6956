"""`AiohttpExchange`: the `exchange.Exchange` of a request aiohttp's server parsed.

Those are the relay requests the front path handed over (`Expect`, `Content-Encoding`,
HTTP/1.0, ...) and every request of an app served without the front path. A whole answer is
a `web.Response` (head and body in one write); a streamed one a `web.StreamResponse` whose
framing aiohttp chose at `prepare` (a length, chunks on HTTP/1.1, the connection's end on
HTTP/1.0), after which an `AiohttpSink` takes the body: bytes go to the transport framed
the same way (wire.TransportSink), and `end` lets aiohttp write the last chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from aiohttp import web
from multidict import CIMultiDict

from vllm_gateway.errors import BadRequest, BodyTooLarge
from vllm_gateway.http.wire import TransportSink
from vllm_gateway.proxy.exchange import Headers

# The request id, on aiohttp's request (tests find a request's objects by it).
REQUEST_ID = web.RequestKey("request_id", str)
_NO_HEADERS: Headers = []


class AiohttpExchange:
    """`Exchange` over aiohttp's request (module docstring); its answer is `response`."""

    __slots__ = ("extra_headers", "request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.extra_headers = _NO_HEADERS

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
    ) -> AiohttpSink:
        response = self.response = web.StreamResponse(
            status=status, reason=reason.decode("latin-1") or None, headers=self._headers(headers)
        )
        chunked = False
        if length is not None:
            response.content_length = length
        elif self.request.version >= (1, 1):
            response.enable_chunked_encoding()
            chunked = True
        await response.prepare(self.request)  # the head, framed by aiohttp
        transport = self.request.transport
        if transport is None:
            raise ConnectionResetError("the client went away")
        sink = AiohttpSink(transport, chunked, self.request, response)
        if first:
            sink.write(first)
        return sink

    def cut(self) -> None:
        if self.response is not None:
            self.response.force_close()
        if self.request.transport is not None:
            self.request.transport.close()


class AiohttpSink(TransportSink):
    """The body of a streamed answer on aiohttp's path (module docstring)."""

    __slots__ = ("request", "response")

    def __init__(
        self,
        transport: asyncio.Transport,
        chunked: bool,
        request: web.Request,
        response: web.StreamResponse,
    ) -> None:
        super().__init__(transport, chunked)
        self.request = request
        self.response = response

    async def drain(self) -> None:
        if not self.transport.is_closing():
            await self.request.writer.drain()
        if self.transport.is_closing():
            raise ConnectionResetError("the client went away")

    async def end(self) -> None:
        await self.response.write_eof()  # aiohttp's writer writes the last chunk


# The exchange of a request, set by the gate's middleware for the relay handler.
EXCHANGE = web.RequestKey("exchange", AiohttpExchange)

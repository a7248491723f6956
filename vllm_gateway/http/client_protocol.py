"""The gateway's side of a client connection: aiohttp's HTTP/1.1 server protocol, answering
requests that are not valid HTTP with OpenAI error bodies instead of plain text.

aiohttp's parser already refuses what a gateway must refuse: a request with both
`Content-Length` and `Transfer-Encoding`, two different lengths, an unknown transfer coding,
obsolete line folding, bare CR or LF, header lines over `max_field_size`, more than
`max_headers` headers. It answers those with a plain-text 400 and logs each one at ERROR
with a traceback, before any middleware runs. `ClientProtocol.handle_error` keeps the refusal
and the closed connection but answers like every other gateway error
(`{"error": {...}}`, 431 for oversized headers) and logs a client's mistake at DEBUG, so a
scanner cannot flood the log; a bug in a handler (a 500) is still logged with its traceback.

aiohttp builds its protocol objects in `web.Server.__call__`; `ClientRunner` makes the
application's server a `ClientServer`, which builds the gateway's instead: the front path's
connection (front.py) when the app has one, which hands what it does not serve to a
`ClientProtocol`; every `ClientProtocol` sits behind a `guard.HeadGuard` (a bound on a
head's total size, and the connection limit).

aiohttp internals this relies on, each pinned by tests/unit/test_aiohttp_seams.py so an
aiohttp upgrade that changes one fails loudly: `AppRunner._make_server` (the one private
hook: the server it builds is rebuilt as a `ClientServer` from its public attributes
`request_handler`, `request_factory`, `handler_cancellation`) and
`RequestHandler.handle_error`'s signature.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from vllm_gateway.errors import GatewayError, MalformedRequest, error_response
from vllm_gateway.http.gate import Gate
from vllm_gateway.http.guard import ConnectionLimit, HeadGuard
from vllm_gateway.http.wire import DateHeader
from vllm_gateway.log import get_logger

log = get_logger("vllm_gateway.client")


class ClientProtocol(RequestHandler):
    """One client connection, as aiohttp serves it, with the gateway's error answers."""

    gate: Gate | None = None  # set by ClientServer: the error hooks

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            # Part of an answer went out already; as aiohttp does, give up on the connection.
            raise ConnectionError("an answer was already started; cannot send an error")
        error: GatewayError
        if status >= 500:
            if exc is not None:
                self.log_exception("Error handling request", exc_info=exc)
            error = GatewayError("The gateway failed to handle this request.")
            error.status = status
        else:
            error = malformed(exc, message, status)
            log.debug("malformed request", peer=request.remote, error=error.message)
        # Counted and logged like every error the gateway answers itself (metrics, access log).
        if self.gate is not None:
            self.gate.fire(error, request.method, request.path, None)
        response = error_response(error)
        response.force_close()  # the connection's framing can no longer be trusted
        return response


def malformed(exc: BaseException | None, message: str | None, status: int) -> MalformedRequest:
    """The error a client gets for a request aiohttp's parser refused."""
    if isinstance(exc, LineTooLong) or (message and "Too many headers" in message):
        error = MalformedRequest("The request line or headers are too large or too many.")
        error.status = 431
        return error
    # aiohttp's message is a first line and then the offending bytes with a caret under
    # them; the first line says what is wrong without echoing the client's bytes back.
    first = (message or str(exc or "") or "Bad Request").strip().splitlines()[0]
    error = MalformedRequest(f"Malformed HTTP request: {first.rstrip(':.').strip()}.")
    error.status = status if 400 <= status < 500 else 400
    return error


class FrontServer(Protocol):
    """What `ClientServer` needs of the front path (front.Front)."""

    def connection(self, server: ClientServer) -> asyncio.Protocol: ...

    def pre_shutdown(self) -> None: ...

    async def shutdown(self, timeout: float | None) -> None: ...


class ClientServer(web.Server):
    """aiohttp's low-level server, building the gateway's protocol for each connection: the
    front path's (front.py) when the app has one, which hands the connections it does not
    serve to aiohttp's; else aiohttp's (a `ClientProtocol` behind a `HeadGuard`) straight
    away."""

    def __init__(
        self,
        handler: Any,
        *,
        request_factory: Any,
        handler_cancellation: bool,
        front: FrontServer | None,
        gate: Gate | None,
        limit: ConnectionLimit,
        max_head_bytes: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            handler,
            request_factory=request_factory,
            handler_cancellation=handler_cancellation,
            **kwargs,
        )
        self.front = front
        self.gate = gate
        self.limit = limit
        self.max_head_bytes = max_head_bytes
        self.date = DateHeader()
        self.loop = asyncio.get_running_loop()
        # What aiohttp's RequestHandler takes (the limits and settings start_server gave).
        self.protocol_kwargs = kwargs

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]  # a guard, not a RequestHandler
        if self.front is not None:
            return self.front.connection(self)
        return self.aiohttp_protocol(counted=False)

    def aiohttp_protocol(self, *, counted: bool) -> HeadGuard:
        """What aiohttp serves a connection with (the same limits and settings), behind the
        head guard; `counted`: the connection already counts against the limit (a
        connection the front path hands over)."""
        protocol = ClientProtocol(self, loop=self.loop, **self.protocol_kwargs)
        protocol.gate = self.gate
        return HeadGuard(
            protocol, self.limit, self.max_head_bytes, self.date, self.gate, counted=counted
        )

    def pre_shutdown(self) -> None:
        super().pre_shutdown()
        if self.front is not None:
            self.front.pre_shutdown()

    async def shutdown(self, timeout: float | None = None) -> None:
        if self.front is None:
            await super().shutdown(timeout)
            return
        await asyncio.gather(super().shutdown(timeout), self.front.shutdown(timeout))


class ClientRunner(web.AppRunner):
    """`web.AppRunner` whose connections are served by the gateway's protocols."""

    def __init__(
        self,
        app: web.Application,
        *,
        front: FrontServer | None = None,
        gate: Gate | None = None,
        limit: ConnectionLimit | None = None,
        max_head_bytes: int = 64 * 1024,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self.front = front
        self.gate = gate
        self.limit = limit or ConnectionLimit(0)
        self.max_head_bytes = max_head_bytes
        self.server_kwargs = kwargs

    async def _make_server(self) -> web.Server:
        built = await super()._make_server()  # aiohttp's: the app started, the handler bound
        kwargs = {
            k: v
            for k, v in self.server_kwargs.items()
            if k not in ("handle_signals", "shutdown_timeout", "handler_cancellation")
        }
        return ClientServer(
            built.request_handler,
            request_factory=built.request_factory,
            handler_cancellation=built.handler_cancellation,
            front=self.front,
            gate=self.gate,
            limit=self.limit,
            max_head_bytes=self.max_head_bytes,
            **kwargs,
        )

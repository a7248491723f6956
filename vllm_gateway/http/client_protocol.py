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
application's server build the gateway's instead: the front path's connection (front.py)
when the app has one, which hands what it does not serve to a `ClientProtocol`
(tests/e2e/test_bad_input.py and tests/e2e/test_front.py pin the behaviour, so an aiohttp upgrade
that changes these internals fails loudly).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from vllm_gateway.errors import GatewayError, MalformedRequest, error_response
from vllm_gateway.log import get_logger

if TYPE_CHECKING:
    from vllm_gateway.http.front import Front
    from vllm_gateway.http.routes import ErrorHook

log = get_logger("vllm_gateway.client")


class ClientProtocol(RequestHandler):
    """One client connection, as aiohttp serves it, with the gateway's error answers."""

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
        for hook in self._manager.error_hooks:  # type: ignore[union-attr]
            hook(error, request.method, request.path, None)
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


class ClientServer(web.Server):
    """aiohttp's low-level server, building the gateway's protocol for each connection: the
    front path's (front.py) when the app has one, which hands the connections it does not
    serve to a `ClientProtocol`; else a `ClientProtocol` straight away."""

    front: Front | None = None
    error_hooks: Sequence[ErrorHook] = ()  # routes.ERROR_HOOKS: counters, access log

    def __call__(self) -> asyncio.Protocol:
        if self.front is not None:
            return self.front.connection(self)
        return self.client_protocol()

    def client_protocol(self) -> ClientProtocol:
        """What aiohttp serves a connection with (the same limits and settings)."""
        return ClientProtocol(self, loop=self._loop, **self._kwargs)

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
        front: Front | None = None,
        error_hooks: Sequence[ErrorHook] = (),
        **kwargs,
    ) -> None:
        super().__init__(app, **kwargs)
        self._front = front
        self._error_hooks = error_hooks

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Same server, same state; only the protocol factory differs.
        server.__class__ = ClientServer
        server.front = self._front  # type: ignore[attr-defined]
        server.error_hooks = self._error_hooks  # type: ignore[attr-defined]
        return server

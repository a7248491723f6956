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
application's server build `ClientProtocol`s instead (tests/test_bad_input.py pins the
behaviour, so an aiohttp upgrade that changes these internals fails loudly).
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from vllm_gateway.errors import GatewayError, MalformedRequest, error_response
from vllm_gateway.log import get_logger

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


class _ClientServer(web.Server):
    """aiohttp's low-level server, building a `ClientProtocol` for each connection."""

    def __call__(self) -> RequestHandler:
        return ClientProtocol(self, loop=self._loop, **self._kwargs)


class ClientRunner(web.AppRunner):
    """`web.AppRunner` whose connections are `ClientProtocol`s."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Same server, same state; only the protocol factory differs.
        server.__class__ = _ClientServer
        return server

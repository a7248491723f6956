"""The gate: what every client request passes through, on either server.

`Gate.serve(ex, handle)` is the one function both servers call: the front path for the
relay requests it serves (front.py), aiohttp's server for every request it parses (through
`Gate.middleware`). It

1. sets the headers the gateway adds to every answer (`answer_headers`: the seam for
   CORS and the like; each provider maps a request to headers, written on its answer,
   error answers included);
2. admits the request by its client key (`keys.ClientKeys.admit`, for the guarded paths)
   and holds the key's limits while it is handled;
3. runs the handler (the relay handler, or aiohttp's routed one);
4. answers a `GatewayError` (or a bug: a 500 that closes the connection, logged with its
   traceback) with an OpenAI error body, and fires the error hooks (`ERROR_HOOKS`:
   telemetry counts it, the access log writes it).

Errors aiohttp's parser refuses before any request exists (client_protocol.py) and heads
refused by the head guard (guard.py) fire the same hooks through `fire`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from vllm_gateway.errors import BodyTooLarge, GatewayError, RouteNotFound
from vllm_gateway.http.aiohttp_exchange import EXCHANGE, AiohttpExchange
from vllm_gateway.http.keys import ClientKeys
from vllm_gateway.http.routes import ErrorHook
from vllm_gateway.http.wire import error_headers
from vllm_gateway.log import get_logger
from vllm_gateway.proxy.exchange import Exchange, Headers

log = get_logger("vllm_gateway.gate")

# Headers the gateway adds to every answer of a request (e.g. CORS, issue 13).
AnswerHeaders = Callable[[Exchange], Headers]
Handle = Callable[[Exchange], Awaitable[None]]


class Gate:
    """Admit, handle, answer errors, fire the hooks: see the module docstring."""

    def __init__(self, keys: ClientKeys | None, error_hooks: list[ErrorHook]) -> None:
        self.keys = keys
        self.error_hooks = error_hooks  # the app's list: hooks added later count too
        self.answer_headers: list[AnswerHeaders] = []

    async def serve(self, ex: Exchange, handle: Handle) -> None:
        """Handle one request on `ex`; every error becomes its answer (module docstring)."""
        providers = self.answer_headers
        if providers:
            # One provider (CORS) is the common case; a request without an Origin gets none.
            extra = (
                providers[0](ex)
                if len(providers) == 1
                else [h for provider in providers for h in provider(ex)]
            )
            if extra:
                ex.extra_headers = extra
        keys = self.keys
        try:
            # A browser's CORS preflight carries no credentials: no key is asked of it.
            key = keys.admit(ex) if keys is not None and not _preflight(ex) else None
            try:
                await handle(ex)
            finally:
                ClientKeys.release(key)
        except GatewayError as e:
            await self.answer_error(ex, e)
        except ConnectionError:
            raise  # the client went away while its answer was being written
        except Exception as e:
            log.exception("Error handling request", exc_info=e)
            error = GatewayError("The gateway failed to handle this request.")
            error.closes_connection = True
            await self.answer_error(ex, error)

    async def answer_error(self, ex: Exchange, error: GatewayError) -> None:
        """Fire the hooks, then answer with an OpenAI error body, unless an answer began
        (then the connection is cut: the client sees an incomplete answer)."""
        self.fire(error, ex.method, ex.path, ex.request_id)
        if ex.answer_started:
            ex.cut()
            return
        status, headers, body = error_headers(error)  # the exchange adds extra_headers
        await ex.answer(status, b"", headers, body, close=error.closes_connection)

    def fire(self, error: GatewayError, method: str, path: str, request_id: str | None) -> None:
        """Tell the error hooks about an error the gateway answered itself."""
        for hook in self.error_hooks:
            hook(error, method, path, request_id)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """aiohttp's side: every routed request goes through `serve` (its handler as the
        one to run; aiohttp's own 404/405/413 become gateway errors)."""
        ex = AiohttpExchange(request)
        request[EXCHANGE] = ex
        redirect: web.HTTPException | None = None

        async def handle(_: Exchange) -> None:
            nonlocal redirect
            try:
                response = await handler(request)
            except web.HTTPException as e:
                if e.status < 400:
                    redirect = e
                    return
                raise as_gateway_error(e, request) from None
            if ex.response is None:
                ex.response = response

        await self.serve(ex, handle)
        if redirect is not None:
            raise redirect
        response = ex.response
        assert response is not None  # the handler answered, or serve answered the error
        if ex.extra_headers and not response.prepared:
            headers = response.headers
            for name, value in ex.extra_headers:
                key = name.decode("latin-1")
                if key not in headers:  # a handler's own (e.g. a preflight's) stand
                    headers.add(key, value.decode("latin-1"))
        return response


def as_gateway_error(e: web.HTTPException, request: web.Request) -> GatewayError:
    """aiohttp's own refusals as the gateway's errors."""
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return BodyTooLarge(f"The request body is too large: {e.text}")
    if e.status == 405:
        allow = e.headers.get("Allow", "")
        return RouteNotFound(
            f"{request.method} {request.path} is not served here; it answers {allow}.",
            405,
            allow=allow,
        )
    if e.status == 404:
        return RouteNotFound(f"{request.method} {request.path} is not served here.")
    err = GatewayError(e.reason)
    err.status = e.status
    return err


def _preflight(ex: Exchange) -> bool:
    """Is this a CORS preflight (http/cors.py; answered by routes.cors_preflight)?"""
    if ex.method != "OPTIONS":
        return False  # the front path's POSTs: one comparison
    headers = ex.headers
    return "Origin" in headers and "Access-Control-Request-Method" in headers


GATE = web.AppKey("gate", Gate)

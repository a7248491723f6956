"""The front path: the gateway's own HTTP/1.1 server protocol for the relay requests.

aiohttp's server builds, for every request, a parsed message, a `Request` with its URL and
headers, a payload reader, a `StreamResponse` and its writer, and runs routing and the
middlewares: most of the gateway's CPU per request above the system calls, and most of its
memory per open stream (docs/benchmarks.md). A relay needs none of that. `FrontConnection`
reads requests with httptools (llhttp, the parser aiohttp's own C parser wraps) and serves
the common relay request itself: a POST to a model path (`routes.is_model_path`), HTTP/1.1,
plainly framed. For that request it is the `exchange.Exchange`, so the relay handler
(`Routes.relay_exchange`), the client keys (`ClientKeys.admit`) and the errors
(`errors.error_parts`, `routes.ERROR_HOOKS`) are the same code on both paths.

Anything else goes to aiohttp, for the rest of the connection (`_hand_off`): the connection
builds the `ClientProtocol` aiohttp would have built, makes it the transport's protocol and
feeds it every byte read of the request so far, so aiohttp serves it as if it had owned the
connection from that request on. Handed over: another method or path, HTTP/1.0, `Expect`,
`Upgrade`, `Content-Encoding`, `Sec-WebSocket-Key1`, a transfer coding other than `chunked`,
a target with a percent-escape, `+`, a dot segment or an empty segment, a header aiohttp
allows once given twice, a NUL in a value, no `Host`, a head longer than
`client.max_header_bytes` or with more than `client.max_headers` lines, and whatever the
parser refuses. aiohttp then answers as it always did (the refusals as OpenAI errors:
client_protocol.py).

A connection's parts: `front_exchange.FrontExchange` is the request being served and its
answer, `front_reader.RequestReader` reads requests and decides which are served here, and
`FrontConnection` (this module) is the connection's life: a task per request, the
hand-over, the idle timer, shutdown.

What the front path does itself, as aiohttp does it:
- requests on a connection are served one at a time, in order; later (pipelined) ones wait
  in a buffer, and reading pauses while more than READ_LIMIT bytes wait;
- `client.header_timeout`: a connection without a whole request head this long after it
  opened or after its last answer is closed (a slow-loris guard; the keep-alive limit);
- the body, by Content-Length or chunked, within `max_body_bytes` (413) and
  `client.body_timeout` (408) as `Routes._read_body` rules; bad chunk framing is a 400;
  trailers are dropped, within the limits on headers (431);
- a client that goes away cancels its request's task (the relay then aborts the worker's
  request); a slow reader holds the relay back (`drain`, the transport's flow control);
- an error answered before the request's body was whole, or that says so
  (`GatewayError.closes_connection`), closes the connection after the answer; in the first
  case only after reading and dropping the rest of the body for up to `client.body_timeout`
  (a lingering close, as aiohttp's: a socket closed with unread bytes sends a reset, which
  can destroy the answer before a client still sending its body reads it);
- graceful shutdown (`Front.pre_shutdown`, `Front.shutdown`, called with aiohttp's own):
  idle connections close, busy ones close after their answer.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.tcp_helpers import tcp_keepalive

from vllm_gateway.config.gateway import ClientConfig
from vllm_gateway.errors import GatewayError
from vllm_gateway.http.cors import Cors
from vllm_gateway.http.front_exchange import DateHeader
from vllm_gateway.http.front_reader import RequestReader
from vllm_gateway.http.keys import ClientKeys
from vllm_gateway.http.routes import ErrorHook, Routes
from vllm_gateway.log import get_logger

if TYPE_CHECKING:
    from vllm_gateway.http.client_protocol import ClientServer

log = get_logger("vllm_gateway.front")

# Reading pauses while this many bytes of later (pipelined) requests wait (bytes; 64 KiB).
READ_LIMIT = 1 << 16


class Front:
    """The front path of one app: its handler, limits and connections (for shutdown).

    Counters for telemetry: `served` (requests answered on the front path), `handed_off`
    (connections given to aiohttp).
    """

    def __init__(
        self, routes: Routes, keys: ClientKeys | None, error_hooks: list[ErrorHook]
    ) -> None:
        self.routes = routes
        self.keys = keys
        self.error_hooks = error_hooks
        self.limits = ClientConfig()  # server.start_server sets the ones it serves with
        self.connections: set[FrontConnection] = set()
        self.closing = False
        self.served = 0
        self.handed_off = 0
        self.date = DateHeader()
        self.cors: Cors | None = routes.cors  # the CORS headers of each answer head

    def connection(self, server: ClientServer) -> FrontConnection:
        """A protocol for a new client connection (the listening socket's factory)."""
        return FrontConnection(self, server)

    async def handle(self, ex: FrontConnection) -> None:
        """What aiohttp's middlewares and handler do for a relay request: client keys,
        then the relay handler. Errors are the caller's to answer."""
        keys = self.keys
        if keys is None:
            await self.routes.relay_exchange(ex)
            return
        key = keys.admit(ex)
        try:
            await self.routes.relay_exchange(ex)
        finally:
            keys.release(key)

    def pre_shutdown(self) -> None:
        """Stop serving new requests: idle connections close, busy ones after their answer."""
        self.closing = True
        for conn in list(self.connections):
            conn.close_when_idle()

    async def shutdown(self, timeout: float | None) -> None:
        """Wait up to `timeout` for the requests in progress, then end them and close."""
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        left = [c.task for c in self.connections if c.task is not None]
        for task in left:
            task.cancel()  # as aiohttp ends the handlers still running
        if left:
            await asyncio.wait(left, timeout=timeout)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        self.connections.clear()


FRONT = web.AppKey("front", Front)


class FrontConnection(RequestReader):
    """One client connection on the front path (module docstring): the request it serves
    (`FrontExchange`), read by `RequestReader`, and the connection's life here."""

    __slots__ = (
        "_timer",
        "handed_off",
        "idle_until",
        "lingering",
        "read_paused",
        "server",
        "task",
    )

    def __init__(self, front: Front, server: ClientServer) -> None:
        super().__init__(front)
        self.server = server
        self.task: asyncio.Task[None] | None = None
        self.handed_off = False
        self.lingering = False
        self.read_paused = False
        self._timer: asyncio.TimerHandle | None = None
        self.idle_until = 0.0

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        front = self.front
        if front.closing:
            transport.close()
            return
        front.connections.add(self)
        tcp_keepalive(transport)  # as aiohttp: a peer that vanished is found in time
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.front.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.task is not None:
            self.task.cancel()  # the client went away: the relay aborts the worker's request
        for waiter in (self._drain_waiter, self._body_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(ConnectionResetError("the client went away"))
        self.parser = None  # the parser holds our callbacks: let the cycle go at once

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a body that was refused (_linger)
        if self.task is None:
            self._read_head(data)
        elif not self.message_done:
            self._read_body(data)
        elif not self.closing:  # a later request: it waits for this one's answer
            self.buf += data
            if len(self.buf) > READ_LIMIT and not self.read_paused and self.transport:
                self.read_paused = True
                self.transport.pause_reading()

    def eof_received(self) -> None:
        return None  # close, as aiohttp does: a half-closed client is a gone client

    # --- serving one request ---------------------------------------------------------------

    def _start_request(self) -> None:
        self.task = self.loop.create_task(self._serve())

    async def _serve(self) -> None:
        front = self.front
        try:
            await front.handle(self)
        except GatewayError as e:
            for hook in front.error_hooks:
                hook(e, self.method, self.path, self.request_id)
            self._answer_error(e)
        except ConnectionError:
            pass  # the client went away while its answer was being written
        except Exception as e:
            log.exception("Error handling request", exc_info=e)
            error = GatewayError("The gateway failed to handle this request.")
            error.closes_connection = True
            self._answer_error(error)
        finally:
            self._served()

    def _served(self) -> None:
        """The request's task ended: go on to the next request, or close."""
        self.task = None
        self.front.served += 1
        transport = self.transport
        if transport is None:
            return
        if not self.answer_done or self.front.closing or transport.is_closing():
            transport.close()
            return
        if not self.message_done or self.body_error is not None:
            self._linger(transport)  # the client may still be sending the body
            return
        if self.closing or not self.keep_alive:
            transport.close()
            return
        self._reset()
        self._arm_idle()
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        if self.buf:
            self._read_head(b"")

    def _linger(self, transport: asyncio.Transport) -> None:
        """The answer is out (it said `Connection: close`) before the body was whole: end our
        side, then read and drop what still comes until the client closes or
        `client.body_timeout` passes (module docstring)."""
        self.lingering = True
        self.parser = None
        self.buf.clear()
        if transport.can_write_eof():
            transport.write_eof()
        if self._timer is not None:  # set for a later time (the head's): the linger is shorter
            self._timer.cancel()
            self._timer = None
        self._arm_idle(self.front.limits.body_timeout)
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()

    def close_when_idle(self) -> None:
        """Shutdown: close now if no request is being served, else after its answer."""
        self.closing = True
        if self.task is None and self.transport is not None:
            self.transport.close()

    def _hand_off(self) -> None:
        """Give this connection to aiohttp from the current request on (module docstring)."""
        transport = self.transport
        if transport is None:
            return
        self.handed_off = True
        front = self.front
        front.handed_off += 1
        front.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        protocol = self.server.client_protocol()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self.write_paused:
            protocol.pause_writing()
        data, self.pending = self.pending, b""
        self.parser = None
        if data:
            protocol.data_received(data)
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()

    def _arm_idle(self, seconds: float | None = None) -> None:
        # One timer re-armed lazily (as aiohttp's keep-alive timer): when it fires early,
        # it sets itself for the time left, so a request costs a clock read, not a timer.
        # `seconds`: header_timeout unless given (the linger's limit).
        loop = self.loop
        if seconds is None:
            seconds = self.front.limits.header_timeout
        self.idle_until = loop.time() + seconds
        if self._timer is None:
            self._timer = loop.call_at(self.idle_until, self._idle_check)

    def _idle_check(self) -> None:
        self._timer = None
        transport = self.transport
        if transport is None or self.task is not None or self.handed_off:
            return  # a request is being served: the timer starts again after its answer
        if self.loop.time() < self.idle_until:
            self._timer = self.loop.call_at(self.idle_until, self._idle_check)
            return
        # No whole request head in time (a slow loris, an idle keep-alive connection), or the
        # linger's time is up.
        transport.close()

"""The front path: the gateway's own HTTP/1.1 server protocol for the relay requests.

aiohttp's server builds, for every request, a parsed message, a `Request` with its URL and
headers, a payload reader, a `StreamResponse` and its writer, and runs routing and the
middlewares: most of the gateway's CPU per request above the system calls, and most of its
memory per open stream (docs/benchmarks.md). A relay needs none of that. `FrontConnection`
reads requests with httptools (llhttp, the parser aiohttp's own C parser wraps) and serves
the common relay request itself: a POST to a model path (`routes.is_model_path`), HTTP/1.1,
plainly framed. For that request it makes a `front_exchange.FrontExchange` and passes it to the same
function aiohttp's middleware calls (`gate.Gate.serve`: client keys, the relay handler,
error answers and their hooks), so nothing is mirrored between the paths.

Anything else goes to aiohttp, for the rest of the connection (`_hand_off`): the connection
builds the `ClientProtocol` aiohttp would have built (behind the head guard, guard.py)
through the factory it was given, makes it the transport's protocol and feeds it every byte
read of the request so far, so aiohttp serves it as if it had owned the connection from
that request on. Handed over: another method or path, HTTP/1.0, `Expect`,
`Upgrade`, `Content-Encoding`, `Sec-WebSocket-Key1`, a transfer coding other than `chunked`,
a target with a percent-escape, `+`, a dot segment or an empty segment, a header aiohttp
allows once given twice, a NUL in a value, no `Host`, a whole head with a line longer than
`client.max_header_bytes` or with more than `client.max_headers` lines, and whatever the
parser refuses; aiohttp then answers as it always did (the refusals as OpenAI errors:
client_protocol.py). A head still not whole past `client.max_head_bytes` is refused here
(431, the connection closed): aiohttp has no bound on a head's total size.

A connection's parts, by composition: `FrontConnection` (this module) is the connection's
life (a task per request, the hand-over, the idle timer, shutdown); it has a
`front_reader.RequestReader`, which parses and says what to do with each request, and it
makes one `front_exchange.FrontExchange` per request served. It is given its limits, the
Date header and the function that serves a request; `Front` holds what the connections
share (the set of open ones for shutdown, counters).

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
from collections.abc import Awaitable, Callable
from typing import cast

from aiohttp import web
from aiohttp.tcp_helpers import tcp_keepalive

from vllm_gateway.http.client_protocol import ClientServer
from vllm_gateway.http.front_exchange import FlowControl, FrontExchange
from vllm_gateway.http.front_reader import HAND_OFF, MORE, SERVE, FrontLimits, RequestReader
from vllm_gateway.http.guard import ConnectionLimit, head_too_large
from vllm_gateway.http.wire import DateHeader, error_answer
from vllm_gateway.log import get_logger

log = get_logger("vllm_gateway.front")

# Reading pauses while this many bytes of later (pipelined) requests wait (bytes; 64 KiB).
READ_LIMIT = 1 << 16

# Serves one request on its exchange, answering every error itself (gate.Gate.serve with
# the relay handler).
Serve = Callable[[FrontExchange], Awaitable[None]]


class Connections(set["FrontConnection"]):
    """A front path's open connections (for shutdown) and its counters for telemetry:
    `served` (requests answered on the front path), `handed_off` (connections given to
    aiohttp); `closing` once shutdown began."""

    def __init__(self) -> None:
        super().__init__()
        self.served = 0
        self.handed_off = 0
        self.closing = False


class Front:
    """The front path of one app: the function that serves a request, the limits and the
    Date header its connections are given, and the open connections, for shutdown."""

    def __init__(self, serve: Serve, limits: FrontLimits) -> None:
        self.serve = serve
        self.limits = limits  # server.start_server sets the ones it serves with
        self.date = DateHeader()
        self.connections = Connections()

    @property
    def served(self) -> int:
        return self.connections.served

    @property
    def handed_off(self) -> int:
        return self.connections.handed_off

    def connection(self, server: ClientServer) -> FrontConnection:
        """A protocol for a new client connection (the listening socket's factory)."""
        return FrontConnection(
            self.serve,
            self.limits,
            self.date,
            self.connections,
            server.limit,
            server,
        )

    def pre_shutdown(self) -> None:
        """Stop serving new requests: idle connections close, busy ones after their answer."""
        self.connections.closing = True
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
            conn.close()
        self.connections.clear()


FRONT = web.AppKey("front", Front)


class FrontConnection(asyncio.Protocol):
    """One client connection on the front path (module docstring): it has a reader, makes
    an exchange per request it serves, and owns the connection's life."""

    __slots__ = (
        "_timer",
        "closing",
        "connections",
        "counted",
        "date",
        "exchange",
        "flow",
        "handed_off",
        "idle_until",
        "limit",
        "limits",
        "lingering",
        "loop",
        "read_paused",
        "reader",
        "serve",
        "server",
        "task",
        "transport",
    )

    def __init__(
        self,
        serve: Serve,
        limits: FrontLimits,
        date: DateHeader,
        connections: Connections,
        limit: ConnectionLimit,
        server: ClientServer,
    ) -> None:
        self.serve = serve
        self.limits = limits
        self.date = date
        self.connections = connections  # the front path's open ones, with its counters
        self.limit = limit  # the process's connection limit
        self.server = server  # builds aiohttp's protocol for a hand-over (shared by all)
        self.loop = asyncio.get_running_loop()
        self.reader = RequestReader(self.limits)
        self.flow = FlowControl(self.loop)
        self.transport: asyncio.Transport | None = None
        self.exchange: FrontExchange | None = None
        self.task: asyncio.Task[None] | None = None
        self.counted = False
        self.closing = False  # close once the current answer is out
        self.handed_off = False
        self.lingering = False
        self.read_paused = False
        self._timer: asyncio.TimerHandle | None = None
        self.idle_until = 0.0

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is none of asyncio's classes
        connections = self.connections
        if connections.closing:
            transport.close()
            return
        if not self.limit.admit(transport):
            return
        self.counted = True
        self.transport = transport
        connections.add(self)
        tcp_keepalive(transport)  # as aiohttp: a peer that vanished is found in time
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.counted and not self.handed_off:
            self.counted = False
            self.limit.release()
        self.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.task is not None:
            self.task.cancel()  # the client went away: the relay aborts the worker's request
        if self.exchange is not None:
            self.exchange.connection_lost()
        self.flow.lost()
        self.reader.close()  # the parser holds the reader's callbacks: let them go at once

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a body that was refused (_linger)
        reader = self.reader
        if self.exchange is None:
            self._read_head(data)
        elif not reader.message_done:
            rest = reader.read_body(data)
            if rest:
                self._wait_in_buffer(rest)
        else:
            self._wait_in_buffer(data)

    def eof_received(self) -> None:
        return None  # close, as aiohttp does: a half-closed client is a gone client

    def pause_writing(self) -> None:
        self.flow.pause()

    def resume_writing(self) -> None:
        self.flow.resume()

    # --- serving one request ---------------------------------------------------------------

    def _read_head(self, data: bytes) -> None:
        """Read a head; serve its request, hand the connection over or refuse it."""
        reader = self.reader
        verdict = reader.read_head(data)
        if verdict == MORE:
            return
        transport = self.transport
        if transport is None:
            return
        if verdict == SERVE:
            ex = self.exchange = FrontExchange(
                transport,
                self.flow,
                self.date,
                reader.path,
                reader.path_qs,
                reader.raw_headers,
                reader.content_length,
                reader.keep_alive,
            )
            if self.closing:
                ex.close_after = True
            self.task = self.loop.create_task(self._serve(ex))
            rest = reader.start_body(ex)
            if rest:
                self._wait_in_buffer(rest)
        elif verdict == HAND_OFF:
            self._hand_off(transport)
        else:  # TOO_LARGE: aiohttp has no bound on a head's total (guard.py)
            self._refuse(transport)

    def _wait_in_buffer(self, data: bytes) -> None:
        """Bytes of a later request: they wait for this one's answer (reading pauses past
        READ_LIMIT of them)."""
        if self.closing:
            return
        buf = self.reader.buf
        buf += data
        if len(buf) > READ_LIMIT and not self.read_paused and self.transport:
            self.read_paused = True
            self.transport.pause_reading()

    async def _serve(self, ex: FrontExchange) -> None:
        try:
            await self.serve(ex)
        except ConnectionError:
            pass  # the client went away while its answer was being written
        finally:
            self._served(ex)

    def _served(self, ex: FrontExchange) -> None:
        """The request's task ended: go on to the next request, or close."""
        self.task = None
        self.exchange = None
        self.connections.served += 1
        transport = self.transport
        if transport is None:
            return
        if not ex.answer_done or self.connections.closing or transport.is_closing():
            transport.close()
            return
        if not ex.message_done or ex.body_error is not None:
            self._linger(transport)  # the client may still be sending the body
            return
        if self.closing or ex.close_after or not ex.keep_alive:
            transport.close()
            return
        reader = self.reader
        reader.reset()
        self._arm_idle()
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        if reader.buf:
            self._read_head(b"")

    def _refuse(self, transport: asyncio.Transport) -> None:
        """A head over client.max_head_bytes: 431, and the connection closes (no linger:
        what follows is more of the same head, not a body)."""
        error = head_too_large(self.limits.max_head_bytes)
        log.debug("request head too large", peer=_peer(transport), error=error.message)
        self.closing = True
        self.reader.close()
        transport.write(error_answer(error, self.date))
        transport.close()

    def _linger(self, transport: asyncio.Transport) -> None:
        """The answer is out (it said `Connection: close`) before the body was whole: end our
        side, then read and drop what still comes until the client closes or
        `client.body_timeout` passes (module docstring)."""
        self.lingering = True
        self.reader.close()
        if transport.can_write_eof():
            transport.write_eof()
        if self._timer is not None:  # set for a later time (the head's): the linger is shorter
            self._timer.cancel()
            self._timer = None
        self._arm_idle(self.limits.body_timeout)
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()

    def close_when_idle(self) -> None:
        """Shutdown: close now if no request is being served, else after its answer."""
        self.closing = True
        if self.exchange is not None:
            self.exchange.close_after = True
        if self.task is None and self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _hand_off(self, transport: asyncio.Transport) -> None:
        """Give this connection to aiohttp from the current request on (module docstring)."""
        self.handed_off = True
        self.connections.handed_off += 1
        self.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # Counted already: aiohttp's protocol (its guard) releases the count when it ends.
        protocol = self.server.aiohttp_protocol(counted=True)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self.flow.paused:
            protocol.pause_writing()
        data = self.reader.take_pending()
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
            seconds = self.limits.header_timeout
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


def _peer(transport: asyncio.BaseTransport) -> str | None:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else None

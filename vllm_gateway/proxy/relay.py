"""Relay: one attempt of one request against one worker, its answer streamed back as is.

The request body goes out as the same bytes the client sent. The answer comes back as the
worker writes it: status, content type and end-to-end headers kept, hop-by-hop headers
dropped, body bytes copied from the worker's socket to the client's as they arrive (see
connection.py), never re-parsed. Timeouts: connect (in the pool), first byte (until the
worker's headers), idle (between two reads of the body), total.

An attempt has two steps, so a caller can judge the worker's answer before the client
sees any of it:

    conn = await relay.start(request, lease)     # request sent, worker's status known
    return await relay.respond(request, lease, conn)   # commit headers, stream the body
    (or relay.abandon(conn) to drop that answer, e.g. to retry elsewhere)

`forward` does both. Failure rules: before the response headers reach the client, a
failure raises a `GatewayError` (the handler answers with an OpenAI error body;
`WorkerUnreachable` may be retried elsewhere). After that, an event stream is ended with an
SSE error event and a proper end of stream; any other body is cut by closing the connection,
so the client can tell it was cut short. A client that goes away cancels the handler;
leaving this module then closes the worker connection, which makes vLLM abort the
generation. When the gateway's shutdown grace runs out (`closing` set, handlers cancelled),
the answer is ended cleanly instead: a 503 before the worker answered, an SSE error event in
a stream, a closed connection for any other body.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Sequence

from vllm_gateway.config.gateway import TimeoutConfig
from vllm_gateway.dispatch import dispatcher as dispatch
from vllm_gateway.dispatch.dispatcher import Lease
from vllm_gateway.errors import (
    GatewayStopping,
    UpstreamError,
    UpstreamTimeout,
    WorkerRefused,
    WorkerUnreachable,
    sse_error_event,
)
from vllm_gateway.log import get_logger
from vllm_gateway.proxy import connection
from vllm_gateway.proxy.connection import UpstreamConnection
from vllm_gateway.proxy.exchange import BodySink, Exchange, Headers
from vllm_gateway.proxy.pool import UpstreamPool

log = get_logger("vllm_gateway.relay")

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the HTTP layers on each side set.
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Proxy-Connection",
        "Host",
        "Content-Length",
    )
)
_HOP_BY_HOP_B = frozenset(h.encode() for h in HOP_BY_HOP)
# Worker headers not passed to the client: hop-by-hop, the request id (the exchange adds
# the gateway's own), and CORS: the gateway answers it by its own [cors] rules (http/cors.py);
# a worker's `Access-Control-Allow-Origin: *` would let any page read what [cors] refuses,
# or double the gateway's header (a browser refuses two).
_CORS_ANSWER = frozenset(
    b"access-control-" + name
    for name in (
        b"allow-origin",
        b"allow-credentials",
        b"allow-methods",
        b"allow-headers",
        b"allow-private-network",
        b"expose-headers",
        b"max-age",
    )
)
_NOT_RETURNED = _HOP_BY_HOP_B | {b"x-request-id"} | _CORS_ANSWER
# Request headers describing what the gateway replaced: the request id (ours goes out), the
# body's coding (aiohttp's server decodes a gzip/deflate body; it goes out decoded), and an
# `Expect: 100-continue` the gateway already met (it has the whole body; a worker's
# interim 100 answer must not reach the client as the answer), and `Origin`: the gateway
# answers CORS itself (http/cors.py); a worker that saw it would add its own headers too,
# and a browser refuses an answer with two Access-Control-Allow-Origin.
_NOT_FORWARDED = _HOP_BY_HOP_B | {b"x-request-id", b"content-encoding", b"expect", b"origin"}
_NOT_FORWARDED_NO_AUTH = _NOT_FORWARDED | {b"authorization"}


def request_head(
    method: str,
    target: str,
    host: bytes,
    client_headers: Sequence[tuple[bytes, bytes]],
    request_id: str,
    body_length: int,
    *,
    forward_authorization: bool,
    worker_api_key: str | None,
) -> bytes:
    """The request line and headers for the worker: the client's end-to-end headers as
    they came (bytes, order kept), our Host, Content-Length and X-Request-Id.

    The client's `Authorization` is the client's credential for the gateway; it is passed on
    only when configured. A worker's own key (vLLM --api-key) replaces it when set.
    """
    skip = (
        _NOT_FORWARDED if forward_authorization and not worker_api_key else (_NOT_FORWARDED_NO_AUTH)
    )
    parts = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method.encode(), target.encode(), host)]
    for name, value in client_headers:
        if name.lower() not in skip:
            parts.append(b"%s: %s\r\n" % (name, value))
    if worker_api_key:
        parts.append(b"Authorization: Bearer %s\r\n" % worker_api_key.encode())
    parts.append(
        b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n"
        % (request_id.encode("utf-8", "surrogateescape"), body_length)
    )
    return b"".join(parts)


def end_to_end(worker_headers: Headers) -> Headers:
    """The worker's headers the client gets: the end-to-end ones, as they came."""
    return [(n, v) for n, v in worker_headers if n.lower() not in _NOT_RETURNED]


class Relay:
    """Sends one attempt to a worker over the shared pool and streams the answer back."""

    def __init__(
        self,
        pool: UpstreamPool,
        timeouts: TimeoutConfig,
        *,
        forward_authorization: bool = False,
        worker_api_key: str | None = None,
    ) -> None:
        self.pool = pool
        self.timeouts = timeouts
        self.forward_authorization = forward_authorization
        self.worker_api_key = worker_api_key
        # Set when shutdown cancels the relays still running: a cancel then means "the
        # gateway is stopping" rather than "the client went away".
        self.closing = False

    async def forward(self, ex: Exchange, lease: Lease) -> None:
        """Relay `lease.info` to `lease.worker` and its answer to the client on `ex`."""
        try:
            conn = await self.start(ex, lease)
        except asyncio.CancelledError:
            if not self.closing:
                raise
            lease.outcome = dispatch.SHUTDOWN
            raise GatewayStopping("The gateway is shutting down; retry the request.") from None
        await self.respond(ex, lease, conn)

    async def start(self, ex: Exchange, lease: Lease) -> UpstreamConnection:
        """Send the request to the worker and wait for its status line and headers.

        Nothing has reached the client yet: the caller may still answer it otherwise (then
        it must `abandon` the connection). Raises WorkerUnreachable (no byte reached the
        worker), UpstreamTimeout (no answer within the first-byte limit) or UpstreamError.
        """
        info = lease.info
        url = lease.worker.url
        t = self.timeouts
        try:
            conn = await self.pool.acquire(url)
        except TimeoutError:
            # The TCP handshake never completed: no byte reached the worker.
            unreachable = WorkerUnreachable(
                "The worker serving this request could not be reached: "
                f"connect timed out after {t.connect:g} s."
            )
            unreachable.timed_out = True
            raise unreachable from None
        except OSError as e:
            # The client sees what happened, not the fleet's addresses (the log lines of
            # the request are bound to its worker, so they keep the URL).
            raise WorkerUnreachable(
                f"The worker serving this request could not be reached ({_errno_name(e)})."
            ) from None
        try:
            conn.send(
                request_head(
                    ex.method,
                    info.path,
                    self.pool.origin(url).host_header,
                    ex.raw_headers,
                    info.request_id,
                    len(info.body),
                    forward_authorization=self.forward_authorization,
                    worker_api_key=self.worker_api_key,
                ),
                info.body,
            )
            if lease.pending:  # (send reset the connection's exchange state)
                conn.on_first_body = lease.first_body
            limit = _within(t.first_byte, t.total, lease.started)
            await conn.wait_head(limit)
        except BaseException:
            conn.close()
            raise
        if conn.error is not None:
            conn.close()
            kind, what = conn.error
            if kind == connection.TIMEOUT:
                raise UpstreamTimeout(
                    f"The worker serving this request sent no answer within {limit:g} s."
                )
            raise UpstreamError(f"The worker serving this request failed: it {what}.")
        lease.status = conn.status
        if conn.status in dispatch.RETRY_STATUSES and lease.can_retry:
            self.abandon(conn)  # a busy worker's short answer; nothing of it reaches the client
            raise WorkerRefused(f"The worker serving this request answered {conn.status}.")
        return conn

    def abandon(self, conn: UpstreamConnection) -> None:
        """Drop an answer that will not be relayed; the connection is kept only if that
        answer was already read to its end."""
        self.pool.release(conn)

    async def respond(self, ex: Exchange, lease: Lease, conn: UpstreamConnection) -> None:
        """Commit the worker's status and headers to the client and relay the body."""
        # No retry can follow now: the request body and its JSON are not needed any more.
        lease.info.release_body()
        ex.release_body()
        try:
            headers = end_to_end(conn.headers)
            conn.headers.clear()  # copied: do not hold them for the stream's life
            if conn.complete and _ended_well(lease, conn):
                # The whole answer is here: one write for head and body.
                await ex.answer(conn.status, conn.reason, headers, conn.body_so_far())
                return
            sink = await ex.start_response(
                conn.status, conn.reason, headers, conn.content_length, conn.body_so_far()
            )
            del headers
            conn.attach(sink)
            try:
                await self._relay_body(sink, conn, lease)
            except asyncio.CancelledError:
                if not self.closing:
                    raise
                lease.outcome = dispatch.SHUTDOWN
                message = "The gateway is shutting down; the answer was cut short."
                await self._end_early(ex, sink, conn, message)
                return
            if conn.error is None and _ended_well(lease, conn):
                await sink.end()
            else:
                await self._cut_short(ex, sink, conn, lease)
        finally:
            lease.first_byte = conn.first_body_at  # for telemetry and the access log
            lease.bytes = conn.body_bytes
            # Not read to the end (client gone, timeout, error): the connection is closed
            # rather than returned to the pool, so the worker sees the abort.
            self.pool.release(conn)

    async def _relay_body(self, sink: BodySink, conn: UpstreamConnection, lease: Lease) -> None:
        t = self.timeouts
        total_at = None
        if t.total:
            remaining = lease.started + t.total - time.monotonic()
            total_at = asyncio.get_running_loop().time() + remaining
        while not await conn.wait_body(t.idle, total_at):
            # The client reads slower than the worker writes: wait until it drained, within
            # the idle limit. A client that stops reading is let go (abort: a close would
            # wait to flush to a reader that is gone), and the worker's request aborted.
            # A client that went away: drain raises ConnectionResetError.
            limit = _within(t.idle, t.total, lease.started)
            try:
                async with asyncio.timeout(limit):
                    await sink.drain()
            except TimeoutError:
                sink.abort()
                raise ConnectionResetError(f"The client read nothing for {limit:g} s.") from None
            conn.resume()

    async def _cut_short(
        self, ex: Exchange, sink: BodySink, conn: UpstreamConnection, lease: Lease
    ) -> None:
        """End a response whose headers already went out, so the client sees it failed.

        An event stream gets an SSE error event and a proper end (OpenAI clients raise on
        it); when the worker stopped mid-event, a blank line first ends that partial event
        so the error event is read on its own. Any other body is cut by closing the
        connection, which every HTTP client reports as an incomplete answer.
        """
        t = self.timeouts
        url = lease.worker.url
        kind, what = conn.error or (connection.BROKEN, "")
        if conn.error is None:
            # The worker closed the stream cleanly but early: say so, as for a reset.
            lease.outcome = dispatch.BROKEN
            message = "The worker serving this request ended the stream without [DONE]."
        elif kind == connection.TIMEOUT:
            lease.outcome = dispatch.TIMEOUT
            if what == "total":
                message = f"The request took longer than the {t.total:g} s limit."
            else:
                message = f"The worker serving this request sent nothing for {t.idle:g} s."
        else:
            lease.outcome = dispatch.BROKEN
            message = f"The worker serving this request failed mid-answer: it {what}."
        await self._end_early(ex, sink, conn, message, url)

    @staticmethod
    async def _end_early(
        ex: Exchange, sink: BodySink, conn: UpstreamConnection, message: str, worker: str = ""
    ) -> None:
        log.warning("relay cut short", reason=message, worker=worker)
        if conn.content_length is None and conn.content_type.startswith(b"text/event-stream"):
            # A stream without a length ends where the exchange says (its last chunk, or
            # the connection's end): an SSE error event first, as a new event even if the
            # worker stopped in the middle of one.
            event = sse_error_event(message)
            tail = conn.tail
            if tail and not tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
                event = b"\n\n" + event
            sink.write(event)
            await sink.end()
            return
        ex.cut()


# Streams vLLM always ends with `data: [DONE]` (its Responses API does not, so no check).
DONE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
DONE = b"data: [DONE]"


def _ended_well(lease: Lease, conn: UpstreamConnection) -> bool:
    """False for a completions event stream whose last bytes are not `data: [DONE]`."""
    if conn.status != 200 or not conn.content_type.startswith(b"text/event-stream"):
        return True
    if lease.info.path.partition("?")[0] not in DONE_PATHS:
        return True
    tail = conn.tail if conn.tail or not conn.out else b"".join(conn.out)[-connection.TAIL :]
    return tail.rstrip().endswith(DONE)


def _errno_name(e: OSError) -> str:
    """A connect error as a client may read it: its kind, never the address."""
    if e.errno is not None and e.errno in errno.errorcode:
        return errno.errorcode[e.errno]
    return type(e).__name__


def _within(limit: float, total: float, started: float) -> float | None:
    """The tighter of a limit and what remains of the total budget; None when neither."""
    if not total:
        return limit or None
    remaining = max(0.001, started + total - time.monotonic())
    return min(limit, remaining) if limit else remaining

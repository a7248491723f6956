"""Relay: one attempt of one request against one worker, its answer streamed back as is.

The request body goes out as the same bytes the client sent. The answer comes back chunk by
chunk as the worker writes it: status, content type and end-to-end headers kept, hop-by-hop
headers dropped, SSE events never buffered or re-parsed. Timeouts: connect (in the pool),
first byte (until the worker's headers), idle (between two body chunks), total.

Failure rules: before the response headers reach the client, a failure raises a
`GatewayError` (the handler answers with an OpenAI error body; `WorkerUnreachable` may be
retried elsewhere). After that, the stream is ended with an SSE error event (for event
streams) and the connection is closed, so the client can tell it was cut short.
A client that goes away cancels the handler; leaving this function then closes the worker
connection, which makes vLLM abort the generation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from vllm_gateway import dispatch
from vllm_gateway.config import TimeoutConfig
from vllm_gateway.dispatch import Lease
from vllm_gateway.errors import (
    UpstreamError,
    UpstreamTimeout,
    WorkerRefused,
    WorkerUnreachable,
    sse_error_event,
)
from vllm_gateway.log import get_logger
from vllm_gateway.upstream import UpstreamPool

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


def upstream_headers(
    client_headers: Mapping[str, str],
    request_id: str,
    *,
    forward_authorization: bool,
    worker_api_key: str | None,
) -> CIMultiDict[str]:
    """The headers to send the worker: the client's end-to-end ones, and our request id.

    The client's `Authorization` is the client's credential for the gateway; it is passed on
    only when configured. A worker's own key (vLLM --api-key) replaces it when set.
    """
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in client_headers.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower == "x-request-id":
            continue
        if lower == "authorization" and not forward_authorization:
            continue
        out.add(name, value)
    if worker_api_key:
        out["Authorization"] = f"Bearer {worker_api_key}"
    out["X-Request-Id"] = request_id
    return out


def client_headers(worker_headers: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    """The headers to send the client: the worker's end-to-end ones, and the request id."""
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in worker_headers.items():
        if name.lower() not in HOP_BY_HOP:
            out.add(name, value)
    out["X-Request-Id"] = request_id
    return out


def _within(limit: float, total: float, started: float) -> float | None:
    """The tighter of a limit and what remains of the total budget; None when neither."""
    if not total:
        return limit or None
    remaining = max(0.001, started + total - time.monotonic())
    return min(limit, remaining) if limit else remaining


# Streams vLLM always ends with `data: [DONE]` (its Responses API does not, so no check).
DONE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
DONE = b"data: [DONE]"
TAIL = 32  # bytes: "data: [DONE]" and its line endings, with room to spare


def _ended_well(lease: Lease, upstream: aiohttp.ClientResponse, tail: bytes) -> bool:
    """False for a completions event stream whose last bytes are not `data: [DONE]`."""
    if upstream.status != 200 or upstream.content_type != "text/event-stream":
        return True
    if lease.info.path.partition("?")[0] not in DONE_PATHS:
        return True
    return tail.rstrip().endswith(DONE)


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

    async def forward(self, request: web.Request, lease: Lease) -> web.StreamResponse:
        """Relay `lease.info` to `lease.worker`; return the (finished) client response."""
        info = lease.info
        headers = upstream_headers(
            request.headers,
            info.request_id,
            forward_authorization=self.forward_authorization,
            worker_api_key=self.worker_api_key,
        )
        t = self.timeouts
        first_byte = _within(t.first_byte, t.total, lease.started)
        try:
            async with asyncio.timeout(first_byte):
                upstream = await self.pool.session.request(
                    "POST",
                    lease.worker.url + info.path,
                    data=info.body,
                    headers=headers,
                    allow_redirects=False,
                )
        except aiohttp.ClientConnectorError as e:
            raise WorkerUnreachable(
                f"Worker {lease.worker.url} could not be reached: {e.os_error or e}"
            ) from None
        except aiohttp.ConnectionTimeoutError:
            # The TCP handshake never completed: no byte reached the worker.
            raise WorkerUnreachable(
                f"Worker {lease.worker.url} could not be reached: "
                f"connect timed out after {t.connect:g} s"
            ) from None
        except TimeoutError:
            raise UpstreamTimeout(
                f"Worker {lease.worker.url} sent no answer within {first_byte:g} s."
            ) from None
        except aiohttp.ClientError as e:
            raise UpstreamError(f"Worker {lease.worker.url} failed: {e}") from None

        lease.status = upstream.status
        if upstream.status in dispatch.RETRY_STATUSES and lease.can_retry:
            upstream.close()  # a busy worker's short answer; nothing of it reaches the client
            raise WorkerRefused(f"Worker {lease.worker.url} answered {upstream.status}.")
        try:
            response = web.StreamResponse(
                status=upstream.status,
                reason=upstream.reason,
                headers=client_headers(upstream.headers, info.request_id),
            )
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            await self._copy_body(request, upstream, response, lease)
            return response
        finally:
            # Not read to the end (client gone, timeout, error): close the connection
            # rather than return it to the pool, so the worker sees the abort.
            upstream.close() if not upstream.content.at_eof() else upstream.release()

    async def _copy_body(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        response: web.StreamResponse,
        lease: Lease,
    ) -> None:
        t = self.timeouts
        content = upstream.content
        idle: float | None = None
        # The body's last bytes, to see whether a completions stream ended with [DONE]:
        # the last chunk itself, or (for tiny chunks) the last TAIL bytes pieced together.
        tail = b""
        try:
            while True:
                idle = _within(t.idle, t.total, lease.started)
                async with asyncio.timeout(idle):
                    chunk = await content.readany()
                if not chunk:
                    break
                tail = chunk if len(chunk) >= TAIL else (tail + chunk)[-TAIL:]
                await response.write(chunk)
        except TimeoutError:
            lease.outcome = dispatch.TIMEOUT
            if t.total and time.monotonic() >= lease.started + t.total - 0.01:
                message = f"The request took longer than the {t.total:g} s limit."
            else:
                message = f"Worker {lease.worker.url} sent nothing for {idle:g} s."
        except (
            aiohttp.ClientPayloadError,
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
        ) as e:
            lease.outcome = dispatch.BROKEN
            message = f"Worker {lease.worker.url} failed mid-answer: {e}"
        else:
            if not _ended_well(lease, upstream, tail):
                # The worker closed the stream cleanly but early: say so, as for a reset.
                lease.outcome = dispatch.BROKEN
                message = f"Worker {lease.worker.url} ended the stream without [DONE]."
            else:
                await response.write_eof()
                return
        await self._cut_short(request, response, upstream, message, tail)

    @staticmethod
    async def _cut_short(
        request: web.Request,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        message: str,
        tail: bytes,
    ) -> None:
        """End a response whose headers already went out, so the client sees it failed.

        An event stream gets an SSE error event and a proper end (OpenAI clients raise on
        it); when the worker stopped mid-event, a blank line first ends that partial event
        so the error event is read on its own. Any other body is cut by closing the
        connection, which every HTTP client reports as an incomplete answer.
        """
        log.warning("relay cut short", reason=message)
        if upstream.content_type == "text/event-stream":
            event = sse_error_event(message)
            if tail and not tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
                event = b"\n\n" + event
            await response.write(event)
            await response.write_eof()
            return
        response.force_close()
        if request.transport is not None:
            request.transport.close()

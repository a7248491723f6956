"""Writing a response body while applying a fault (stalls, resets, drips, cut-offs).

The handlers decide *what* to send; this module decides *how the bytes leave*, so
every endpoint misbehaves the same way for the same fault.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable
from contextlib import suppress

from aiohttp import web

from vllm_gateway.fake_worker.config import Fault
from vllm_gateway.fake_worker.protocol import ApiError

# Bytes per write under `drip`: "a few bytes at a time".
DRIP_BYTES = 4
# After the last byte before a reset has left, give the peer this long to read it: a
# RST that overtakes unread data can make the peer's kernel drop that data, and the
# fault promises K whole events first.
RESET_GRACE_S = 0.02

MIDSTREAM = frozenset({"stall_midstream", "reset_midstream", "close_midstream"})


class StreamEnded(Exception):
    """The fault ended the response early; the handler returns what it has."""


async def forever() -> None:
    """Wait until cancelled (the client goes away, or the worker is paused/stopped)."""
    await asyncio.get_running_loop().create_future()


async def before_headers(fault: Fault | None) -> None:
    """Faults that act before the status line: hang, stall_headers, status."""
    if fault is None:
        return
    if fault.name == "hang" or (fault.name == "stall_headers" and fault.param is None):
        await forever()
    elif fault.name == "stall_headers":
        await asyncio.sleep(float(fault.param or 0))
    elif fault.name == "status":
        code = int(fault.param or 500)
        raise ApiError(code, f"fake worker fault: status {code}")


async def _reset(request: web.BaseRequest) -> None:
    """Abort the TCP connection with a RST, after what was written has left."""
    transport = request.transport
    if transport is None:
        return
    for _ in range(1000):  # bounded: at most ~1 s waiting for the buffer to drain
        if transport.is_closing() or not transport.get_write_buffer_size():
            break
        await asyncio.sleep(0.001)
    await asyncio.sleep(RESET_GRACE_S)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Linger 0: close() sends RST instead of FIN, like a crashed peer under load.
        with suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class BodyWriter:
    """Writes one response's pieces (SSE events, or one JSON body) under a fault.

    `on_fault` is called when the fault itself ends the response (reset, close), so
    the caller can count it as "faulted" rather than as a client abort.
    """

    def __init__(
        self, request: web.BaseRequest, fault: Fault | None, on_fault: Callable[[], None]
    ) -> None:
        self.request = request
        self.fault = fault
        self.on_fault = on_fault
        self.sent = 0
        name = fault.name if fault else None
        self.cut_after = int(fault.param or 0) if fault and name in MIDSTREAM else None
        self.drip_s = float(fault.param or 0) / 1000 if fault and name == "drip" else None

    async def event(self, resp: web.StreamResponse, data: bytes) -> None:
        """Send one SSE event; after `cut_after` events, the midstream fault acts."""
        if self.cut_after is not None and self.sent >= self.cut_after:
            await self._cut(resp)
        await self._write(resp, data)
        self.sent += 1

    async def body(self, resp: web.StreamResponse, body: bytes) -> None:
        """Send a whole non-streamed body (resp already has its Content-Length).

        A midstream fault sends the first half, then acts: a JSON body has no events
        to count, and half a body is what a client would see from a dying worker.
        """
        if self.cut_after is not None:
            await self._write(resp, body[: len(body) // 2])
            await self._cut(resp)
        await self._write(resp, body)

    async def _write(self, resp: web.StreamResponse, data: bytes) -> None:
        if self.drip_s is None:
            await resp.write(data)
            return
        for i in range(0, len(data), DRIP_BYTES):
            await resp.write(data[i : i + DRIP_BYTES])
            await asyncio.sleep(self.drip_s)

    async def _cut(self, resp: web.StreamResponse) -> None:
        assert self.fault is not None
        if self.fault.name == "stall_midstream":
            await forever()
        self.on_fault()
        if self.fault.name == "reset_midstream":
            await _reset(self.request)
        elif resp.content_length is not None and self.request.transport is not None:
            # A body with a Content-Length cannot end "cleanly" early: close after flushing.
            self.request.transport.close()
        # close_midstream on a chunked stream: returning lets aiohttp write the final
        # zero-length chunk, a clean end of the response without [DONE].
        raise StreamEnded


async def send_body(
    request: web.BaseRequest,
    body: bytes,
    fault: Fault | None,
    on_fault: Callable[[], None],
) -> web.StreamResponse:
    """Answer 200 with a JSON body, shaped by the request's fault."""
    name = fault.name if fault else None
    if name == "malformed_sse":
        body = body[: len(body) // 2]  # not valid JSON any more
    if name not in MIDSTREAM and name != "drip":
        return web.Response(body=body, content_type="application/json")
    resp = web.StreamResponse()
    resp.content_type = "application/json"
    resp.content_length = len(body)
    await resp.prepare(request)
    writer = BodyWriter(request, fault, on_fault)
    with suppress(StreamEnded):
        await writer.body(resp, body)
    return resp

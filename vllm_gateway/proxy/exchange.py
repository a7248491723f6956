"""The exchange seam: the client's side of one relayed request, at request/response level.

The relay handler (`http.routes.Routes.relay_exchange`) and the relay (`relay.Relay`) are
written once against `Exchange`; this module is that seam and nothing else (no server, no
framing). Its implementations live with the servers:

- `http.front_exchange.FrontExchange`: one request of a front path connection (the
  gateway's own HTTP/1.1 protocol, http/front.py);
- `http.aiohttp_exchange.AiohttpExchange`: a request aiohttp's server parsed (the ones the
  front path hands over, and every request of an app served without it).

An answer is committed once, either whole (`answer`: status, headers and body in one
write) or as a stream: `start_response` sends the status, headers and the body's first
bytes and gives a `BodySink` for the rest (`write` once per upstream read, `drain`,
`end`). Framing (Content-Length, chunked, `Connection: close`, `X-Request-Id`) is the
exchange's job; the relay hands it plain body bytes. `cut` closes the connection so the
client sees an unfinished answer. Headers are the worker's end-to-end ones as raw bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

Headers = list[tuple[bytes, bytes]]


class BodySink(Protocol):
    """Where a streamed answer's body goes once its head is out (`Exchange.start_response`).

    `write` is synchronous and cheap: it is called from the upstream connection's
    `data_received`, once per read from the worker.
    """

    def write(self, data: bytes) -> bool:
        """Send body bytes, framed as the answer is. True when the relay must stop reading
        the worker: the client's transport buffers more than its high-water mark, or the
        client is gone (`drain` then says which)."""
        ...

    async def drain(self) -> None:
        """Wait until the client's transport buffers less than its high-water mark;
        ConnectionResetError when the client went away."""
        ...

    async def end(self) -> None:
        """End the answer properly (the last chunk of a chunked body)."""
        ...

    def abort(self) -> None:
        """Drop the connection at once, unsent bytes too (a client that stopped reading)."""
        ...


class Exchange(Protocol):
    """One request from a client and its answer (see the module docstring)."""

    request_id: str | None  # set by the handler; the answer carries it
    # Headers the gateway adds to every answer of this request (http.gate.Gate sets them).
    extra_headers: Headers

    @property
    def method(self) -> str:
        """The request's method."""
        ...

    @property
    def path(self) -> str:
        """The path without the query: routing, errors, client keys."""
        ...

    @property
    def path_qs(self) -> str:
        """Path and query, sent on to the worker."""
        ...

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]:
        """The request headers as the client sent them, in order."""
        ...

    @property
    def content_length(self) -> int | None:
        """The request's Content-Length, None when it has none (or chunked)."""
        ...

    @property
    def headers(self) -> Mapping[str, str]:
        """The request headers, looked up case-insensitively."""
        ...

    @property
    def remote(self) -> str | None:
        """The client's address, for log lines."""
        ...

    @property
    def answer_started(self) -> bool:
        """Has any byte of the answer gone out (an error answer is too late then)?"""
        ...

    def body_ready(self) -> bool:
        """Has the whole body arrived (so reading it needs no timer)?"""
        ...

    async def read_body(self, limit: int) -> bytes:
        """The whole body; BodyTooLarge past `limit` bytes, BadRequest when unreadable."""
        ...

    def release_body(self) -> None:
        """Drop any copy of the body kept for a second read (it is not needed any more)."""
        ...

    async def answer(
        self, status: int, reason: bytes, headers: Headers, body: bytes, *, close: bool = False
    ) -> None:
        """Send a whole answer at once; `close`: the connection ends after it."""
        ...

    async def start_response(
        self, status: int, reason: bytes, headers: Headers, length: int | None, first: bytes
    ) -> BodySink:
        """Send the status, headers and the body's first bytes; the rest goes to the sink.
        `length`: the body's length when known, else it is framed as the exchange must."""
        ...

    def cut(self) -> None:
        """Close the connection: an answer already begun is visibly incomplete."""
        ...

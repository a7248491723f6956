"""Reading requests for the front path (front.py): `RequestReader` turns a client
connection's bytes into one request at a time, and says whether the front path serves it.

httptools' parser (llhttp) is fed exactly one request's bytes: the head up to its blank line,
then the body by its Content-Length, or for a chunked body up to each CRLF CRLF in turn (the
only places such a body can end), so no byte of a later request is parsed with an earlier
one. The bytes of a request that the front path does not serve are kept from its first
byte on (`pending`), so they can be handed to aiohttp as they came.

The front path serves (`_servable`) a POST to a model path over HTTP/1.1 with a plain
origin-form target and plain framing; everything else (front.py lists it) is handed over.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import httptools
from aiohttp.http_exceptions import LineTooLong

from vllm_gateway.errors import MalformedRequest
from vllm_gateway.http.client_protocol import malformed
from vllm_gateway.http.front_exchange import FrontExchange
from vllm_gateway.http.routes import is_model_path
from vllm_gateway.log import get_logger

if TYPE_CHECKING:
    from vllm_gateway.http.front import Front

log = get_logger("vllm_gateway.front")

# A plain origin-form target: no percent-escape and no `+` (aiohttp's `path_qs` decodes
# both), no fragment. For such a target aiohttp's path and path_qs are the bytes as sent.
_PLAIN_TARGET = re.compile(
    rb"/[A-Za-z0-9\-._~!$&'()*,;=:@/]*(?:\?[A-Za-z0-9\-._~!$&'()*,;=:@/?]*)?"
)
# Headers aiohttp's parser allows once only (a repeat is refused there, so handed over).
_SINGLETONS = frozenset(
    {
        b"content-length",
        b"content-location",
        b"content-range",
        b"content-type",
        b"etag",
        b"host",
        b"max-forwards",
        b"server",
        b"transfer-encoding",
        b"user-agent",
    }
)
# Headers whose meaning aiohttp's server implements: a request with one is handed over
# (and Sec-WebSocket-Key1, of the old websocket handshake, which aiohttp refuses).
_HANDED_OVER = frozenset({b"expect", b"upgrade", b"content-encoding", b"sec-websocket-key1"})
_NOTABLE = _SINGLETONS | _HANDED_OVER
_CRLF2 = b"\r\n\r\n"


class RequestReader(FrontExchange):
    """The request-reading half of a front connection (module docstring). The connection
    (front.FrontConnection) starts serving a request with `_start_request` and gives the
    connection to aiohttp with `_hand_off`."""

    __slots__ = (
        "_seen",
        "_tail",
        "body_left",
        "buf",
        "chunked",
        "fed",
        "has_host",
        "head_done",
        "parser",
        "pending",
        "quiet",
        "target",
        "trailers",
        "unusual",
    )

    def __init__(self, front: Front) -> None:
        super().__init__(front)
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.pending = b""  # the current request's bytes not yet taken (head, or all of it)
        self.fed = 0  # how many of `pending` the parser has seen
        self.buf = bytearray()  # bytes of later requests, read while one is being served
        self._reset()

    def _reset(self) -> None:
        """Forget the previous request; ready for the next head."""
        self._new_request()
        self.target = b""
        self._seen: list[bytes] | None = None
        self.unusual = False
        self.has_host = False
        self.head_done = False
        self.chunked = False
        self.body_left = 0
        self._tail = b""
        self.trailers = 0  # trailer lines of a chunked body
        self.quiet = 0  # body bytes fed in a row that gave neither body nor a trailer

    def _start_request(self) -> None:
        raise NotImplementedError

    def _hand_off(self) -> None:
        raise NotImplementedError

    # --- httptools callbacks ---------------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            # A trailer of a chunked body: not one of the request's headers, but bounded as
            # they are (aiohttp counts the trailers with the headers).
            self.trailers += 1
            limits = self.front.limits
            if (
                len(name) + len(value) > limits.max_header_bytes
                or len(self.raw_headers) + self.trailers > limits.max_headers
            ):
                self.body_done(_too_large())
            return
        value = value.rstrip(b" \t")  # as aiohttp: llhttp strips the whitespace before only
        self.raw_headers.append((name, value))
        lower = name.lower()
        if lower in _NOTABLE:
            self._notable(lower, value)
        if b"\x00" in value:
            self.unusual = True  # aiohttp refuses a NUL in a value

    def _notable(self, lower: bytes, value: bytes) -> None:
        if lower in _SINGLETONS:
            seen = self._seen
            if seen is None:
                seen = self._seen = []
            elif lower in seen:
                self.unusual = True
            seen.append(lower)
        if lower in _HANDED_OVER:
            self.unusual = True
        elif lower == b"host":
            self.has_host = True
        elif lower == b"content-length":
            self.content_length = int(value) if value.isdigit() else None
            self.unusual = self.unusual or self.content_length is None
        elif lower == b"transfer-encoding":
            self.chunked = True
            self.unusual = self.unusual or value.lower() != b"chunked"

    def on_headers_complete(self) -> None:
        self.head_done = True
        parser = self.parser
        assert parser is not None
        self.keep_alive = parser.should_keep_alive()
        if parser.should_upgrade():
            self.unusual = True

    def on_message_complete(self) -> None:
        self.message_done = True

    # --- reading requests ------------------------------------------------------------------

    def _read_head(self, data: bytes) -> None:
        """Take bytes of a request head; serve the request or hand the connection over."""
        if self.buf:  # bytes that waited while the previous request was served
            data = bytes(self.buf) + data
            self.buf.clear()
        pending = self.pending + data if self.pending else data
        start = self.fed
        if not start:
            while pending.startswith(b"\r\n"):  # blank lines between requests: allowed
                pending = pending[2:]
            if not pending:
                return
        end = pending.find(_CRLF2, max(0, start - 3))
        stop = end + 4 if end >= 0 else len(pending)
        self.pending = pending
        parser = self.parser
        assert parser is not None
        try:
            parser.feed_data(pending[start:stop] if start or stop < len(pending) else pending)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._hand_off()  # aiohttp's parser says what is wrong (or upgrades), as always
            return
        self.fed = stop
        if end < 0:
            if self.head_done or stop > self.front.limits.max_header_bytes:
                self._hand_off()
            return
        if not self._servable(stop):
            self._hand_off()
            return
        self.pending = b""
        self.fed = 0
        self._start_request()
        if self.chunked:
            self._tail = b""
        else:
            self.body_left = self.content_length or 0
        rest = pending[stop:]
        if rest:
            self._read_body(rest)
        elif not self.chunked and not self.body_left:
            self.message_done = True  # no body

    def _servable(self, head_length: int) -> bool:
        """May the front path serve the request whose head was just read?"""
        parser = self.parser
        assert parser is not None
        limits = self.front.limits
        if (
            self.unusual
            or not self.head_done
            or not self.has_host
            or head_length > limits.max_header_bytes
            or len(self.raw_headers) > limits.max_headers
            or parser.get_method() != b"POST"
            or parser.get_http_version() != "1.1"
        ):
            return False
        target = self.target
        if not _PLAIN_TARGET.fullmatch(target) or b"/." in target or b"//" in target:
            return False
        path_qs = target.decode("ascii")
        path = path_qs.partition("?")[0]
        if not is_model_path(path):
            return False
        self.path, self.path_qs = path, path_qs
        return True

    def _read_body(self, data: bytes) -> None:
        """Feed the current request's body; later bytes wait in `buf`."""
        if self.chunked:
            rest = self._feed_chunked(data)
        else:
            left = self.body_left
            if len(data) > left:
                data, rest = data[:left], data[left:]
            else:
                rest = b""
            self.body_left = left - len(data)
            self._feed(data)
            if not self.body_left:
                self.message_done = True
        if self.message_done:
            self.body_done()
            if rest:
                self.data_received(rest)

    def _feed_chunked(self, data: bytes) -> bytes:
        """Feed a chunked body; return the bytes after its end.

        A chunked message can only end right after a CRLF CRLF (the last chunk's line or the
        last trailer, then the empty line), so the data is fed up to each such place in
        turn until the parser says the message is complete: the next request's bytes are
        never fed with this one's.
        """
        tail = self._tail
        scan = tail + data
        shift = len(tail)
        pos = 0
        search = 0
        while not self.message_done:
            i = scan.find(_CRLF2, search)
            if i < 0:
                self._feed(data[pos:])
                pos = len(data)
                break
            cut = i + 4 - shift
            if cut > pos:
                self._feed(data[pos:cut])
                pos = cut
            search = i + 1
        self._tail = scan[-3:]
        return data[pos:]

    def _feed(self, data: bytes) -> None:
        parser = self.parser
        if not data or parser is None or self.body_error is not None:
            return
        size, trailers = self.body_size, self.trailers
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            error = malformed(e, str(e), 400)
            log.debug("malformed request", peer=self.remote, error=error.message)
            self.body_done(error)
            return
        if self.body_size != size or self.trailers != trailers or self.message_done:
            self.quiet = 0
            return
        # Only chunk framing or a trailer line not yet ended, which the parser holds whole
        # until its end: bounded as a header line is (within one read).
        self.quiet += len(data)
        if self.quiet > self.front.limits.max_header_bytes:
            self.body_done(_too_large())


def _too_large() -> MalformedRequest:
    """The 431 aiohttp answers for a header line too long, or too many of them."""
    return malformed(LineTooLong("trailer"), None, 431)

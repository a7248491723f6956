"""Reading requests for the front path (front.py): `RequestReader` turns a client
connection's bytes into one request at a time and says what to do with each (`read_head`:
serve it, hand the connection to aiohttp, refuse a head over `client.max_head_bytes`, or
wait for more). It only parses: the connection acts on its verdicts, and gives it the
exchange (front_exchange.py) that receives the body of a request it serves.

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
from dataclasses import dataclass

import httptools
from aiohttp.http_exceptions import LineTooLong

from vllm_gateway.config.gateway import ClientConfig
from vllm_gateway.errors import BodyTooLarge, GatewayError, MalformedRequest
from vllm_gateway.http.client_protocol import malformed
from vllm_gateway.http.front_exchange import FrontExchange
from vllm_gateway.http.routes import is_model_path
from vllm_gateway.log import get_logger

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

# What `read_head` says to do with the bytes read so far.
MORE = 0  # the head is not whole yet: wait for more
SERVE = 1  # a request the front path serves: make its exchange, then `start_body`
HAND_OFF = 2  # anything else: give the connection to aiohttp (`take_pending`)
TOO_LARGE = 3  # the head is over `max_head_bytes`: refuse it (431) and close


@dataclass(frozen=True, slots=True)
class FrontLimits:
    """What a front path connection may take (config.ClientConfig, max_body_bytes)."""

    header_timeout: float
    body_timeout: float
    max_header_bytes: int
    max_headers: int
    max_head_bytes: int
    max_body_bytes: int

    @classmethod
    def of(cls, client: ClientConfig, max_body_bytes: int) -> FrontLimits:
        return cls(
            client.header_timeout,
            client.body_timeout,
            client.max_header_bytes,
            client.max_headers,
            client.max_head_bytes,
            max_body_bytes,
        )


class RequestReader:
    """A front connection's request reader (module docstring)."""

    __slots__ = (
        "_after",
        "_seen",
        "_tail",
        "body_left",
        "body_size",
        "buf",
        "chunked",
        "content_length",
        "fed",
        "has_host",
        "head_done",
        "keep_alive",
        "limits",
        "message_done",
        "parser",
        "path",
        "path_qs",
        "pending",
        "quiet",
        "raw_headers",
        "receiver",
        "target",
        "trailers",
        "unusual",
    )

    def __init__(self, limits: FrontLimits) -> None:
        self.limits = limits
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        # The current request's bytes not yet taken (head, or all of it): the bytes of one
        # read as they came, a buffer once a head spans reads (bounded by max_head_bytes).
        self.pending: bytes | bytearray = b""
        self.fed = 0  # how many of `pending` the parser has seen
        self.buf = bytearray()  # bytes of later requests, read while one is being served
        self.reset()

    def reset(self) -> None:
        """Forget the previous request; ready for the next head."""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.message_done = False  # the whole request (its body) has been read
        self.path = ""
        self.path_qs = ""
        self.content_length: int | None = None
        self.receiver: FrontExchange | None = None
        self.body_size = 0
        self.target = b""
        self._seen: list[bytes] | None = None
        self._after = b""
        self.unusual = False
        self.has_host = False
        self.head_done = False
        self.chunked = False
        self.body_left = 0
        self._tail = b""
        self.trailers = 0  # trailer lines of a chunked body
        self.quiet = 0  # body bytes fed in a row that gave neither body nor a trailer

    def close(self) -> None:
        """The connection is done with reading: let the parser (and its callbacks) go."""
        self.parser = None
        self.receiver = None
        self.buf.clear()
        self.pending = b""

    def take_pending(self) -> bytes:
        """The current request's bytes read so far, for aiohttp (the hand-over)."""
        data, self.pending = bytes(self.pending), b""
        self.parser = None
        return data

    # --- httptools callbacks ---------------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            # A trailer of a chunked body: not one of the request's headers, but bounded as
            # they are (aiohttp counts the trailers with the headers).
            self.trailers += 1
            limits = self.limits
            if (
                len(name) + len(value) > limits.max_header_bytes
                or len(self.raw_headers) + self.trailers > limits.max_headers
            ):
                self._body_failed(_too_large())
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

    def on_body(self, body: bytes) -> None:
        size = self.body_size = self.body_size + len(body)
        receiver = self.receiver
        if receiver is None or receiver.body_error is not None:
            return
        limit = self.limits.max_body_bytes
        if size > limit:
            receiver.body_done(
                BodyTooLarge(f"The request body is too large: more than {limit} bytes.")
            )
            return
        receiver.on_body(body)

    def on_message_complete(self) -> None:
        self.message_done = True

    # --- reading requests ------------------------------------------------------------------

    def read_head(self, data: bytes) -> int:
        """Take bytes of a request head; say what to do (MORE, SERVE, HAND_OFF, TOO_LARGE)."""
        if self.buf:  # bytes that waited while the previous request was served
            data = bytes(self.buf) + data
            self.buf.clear()
        pending = self.pending
        if pending:
            pending += data  # a bytearray: a slow head costs no copy per read
        else:
            pending = data
            while pending.startswith(b"\r\n"):  # blank lines between requests: allowed
                pending = pending[2:]
            if not pending:
                return MORE
        start = self.fed
        end = pending.find(_CRLF2, max(0, start - 3))
        stop = end + 4 if end >= 0 else len(pending)
        parser = self.parser
        assert parser is not None
        try:
            if start or stop < len(pending):
                parser.feed_data(memoryview(pending)[start:stop])
            else:
                parser.feed_data(pending)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self.pending = pending
            return HAND_OFF  # aiohttp's parser says what is wrong (or upgrades), as always
        self.fed = stop
        if end < 0:
            if self.head_done:
                self.pending = pending
                return HAND_OFF
            if stop > self.limits.max_head_bytes:
                self.pending = b""
                return TOO_LARGE
            self.pending = pending if type(pending) is bytearray else bytearray(pending)
            return MORE
        self.pending = pending
        if not self._servable(stop):
            return HAND_OFF
        self._after = bytes(pending[stop:])
        self.pending = b""
        self.fed = 0
        return SERVE

    def _servable(self, head_length: int) -> bool:
        """May the front path serve the request whose head was just read?"""
        parser = self.parser
        assert parser is not None
        limits = self.limits
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

    def start_body(self, receiver: FrontExchange) -> bytes:
        """Deliver the served request's body to `receiver`; return any bytes after it."""
        self.receiver = receiver
        if self.chunked:
            self._tail = b""
        else:
            self.body_left = self.content_length or 0
        rest, self._after = self._after, b""
        if rest:
            return self.read_body(rest)
        if not self.chunked and not self.body_left:
            self.message_done = True  # no body
            receiver.body_done()
        return b""

    def read_body(self, data: bytes) -> bytes:
        """Feed the current request's body; return the bytes after its end (a later request)."""
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
        if self.message_done and self.receiver is not None:
            self.receiver.body_done()
        return rest

    def _body_failed(self, error: GatewayError) -> None:
        self.message_done = True
        if self.receiver is not None:
            self.receiver.body_done(error)

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
        receiver = self.receiver
        if not data or parser is None or (receiver is not None and receiver.body_error):
            return
        size, trailers = self.body_size, self.trailers
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            error = malformed(e, str(e), 400)
            log.debug("malformed request", error=error.message)
            self._body_failed(error)
            return
        if self.body_size != size or self.trailers != trailers or self.message_done:
            self.quiet = 0
            return
        # Only chunk framing or a trailer line not yet ended, which the parser holds whole
        # until its end: bounded as a header line is (within one read).
        self.quiet += len(data)
        if self.quiet > self.limits.max_header_bytes:
            self._body_failed(_too_large())


def _too_large() -> MalformedRequest:
    """The 431 aiohttp answers for a header line too long, or too many of them."""
    return malformed(LineTooLong("trailer"), None, 431)

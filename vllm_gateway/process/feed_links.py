"""The placement feed's connections: out to each sibling or peer, and in from them.

    Link(endpoint)        this side's connection to one feed socket: made, lost, made again
    Inbound(feed)         one connection to this side's feed socket: lines of placements
    Hello(token, ident)   the peers' handshake: proof of the shared token, and who is who

An endpoint is a unix socket path (sibling processes, in the run's private directory) or
a TCP (host, port) (peer replicas, `[replicas]`). Over TCP anyone who can reach the port
can connect, and anyone may answer at a peer's address (a recycled pod IP, a mistyped
port), so the token never crosses the network: the listening side opens with a fresh
nonce and its replica's id; the connecting side answers with its id and an HMAC-SHA256 of
the nonce and that id under the token, and only then sends placements. Nothing a
connection sends is applied until its answer checks (in constant time); one that does not
answer within `HELLO_SECONDS`, or sends more than `MAX_HELLO` bytes first, is closed, and
a wrong answer is told `refused` (the connecting side logs it). The ids tell a replica it
reached itself (its own address among the peers, as one list for every replica names
them all), or a replica it is linked to already (one replica listed under two names):
that link is dropped. At most `MAX_UNPROVEN` connections wait for their answer at once
(a new one closes the oldest: a peer answers in a round trip, a stranger's flood does
not hold the door), and `MAX_INBOUND` are proven.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import socket
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import orjson

Endpoint = str | tuple[str, int]  # a unix socket path, or a TCP (host, port)

# Longest line read (a batch at its largest is about 360 KB); past it the sender is not a
# feed of this build, and the connection is closed.
MAX_LINE = 1 << 20
# Bytes written to a sibling and not yet taken by it, at most: past this, placements for
# it are dropped until it catches up (a process stalled for seconds at full load).
MAX_BUFFERED = 4 << 20
# A sibling or peer that is away is tried again after this many seconds.
RECONNECT_SECONDS = 1.0
# A connection in must answer the nonce within this many seconds, in at most this many
# bytes (an id and a MAC, a few hundred).
HELLO_SECONDS = 5.0
MAX_HELLO = 4096
# Connections in at once, at most: proven (peers x their processes), and waiting to be.
MAX_INBOUND = 256
MAX_UNPROVEN = 64
# A peer that vanished (no FIN, no RST) is given up after about this many seconds, so it
# holds no connection slot (MAX_INBOUND) nor buffer for good.
KEEPALIVE_SECONDS = 60
SELF = b"self\n"  # the answer to this replica's own connection
REFUSED = b"refused\n"  # the answer to a wrong token


@dataclass(frozen=True)
class Hello:
    """The peers' handshake for a replica with id `ident`, all of them holding `token`."""

    token: str
    ident: str

    def opening(self, nonce: str) -> bytes:
        """What the listening side says first."""
        return orjson.dumps({"nonce": nonce, "id": self.ident}) + b"\n"

    def answer(self, line: bytes) -> tuple[str, str, bytes]:
        """The connecting side's answer to an `opening` line: ('ok', the listener's id,
        the line to send), ('self', ...) when the listener is this replica, ('bad', '',
        b'') when it said nothing a feed says."""
        doc = _object(line)
        nonce, ident = doc.get("nonce"), doc.get("id")
        if not (isinstance(nonce, str) and isinstance(ident, str)) or len(nonce) > 128:
            return "bad", "", b""
        if ident == self.ident:
            return "self", ident, b""
        mac = self._mac(nonce, self.ident)
        return "ok", ident, orjson.dumps({"id": self.ident, "mac": mac}) + b"\n"

    def check(self, nonce: str, line: bytes) -> tuple[str, str]:
        """The listening side's verdict on an answer to `nonce`: ('ok', the peer's id),
        ('self', '') for this replica's own, ('bad', '') otherwise."""
        doc = _object(line)
        ident, mac = doc.get("id"), doc.get("mac")
        if not (isinstance(ident, str) and isinstance(mac, str)) or len(ident) > 512:
            return "bad", ""
        if not hmac.compare_digest(mac.encode(), self._mac(nonce, ident).encode()):
            return "bad", ""
        return ("self", "") if ident == self.ident else ("ok", ident)

    def _mac(self, nonce: str, ident: str) -> str:
        message = orjson.dumps([nonce, ident])
        return hmac.new(self.token.encode(), message, hashlib.sha256).hexdigest()


class Feed(Protocol):
    """What the connections ask of the feed they serve (placement_feed.PlacementFeed)."""

    hello: Hello | None  # the peers' handshake; None between siblings
    inbound: set[Inbound]  # connections in, proven
    unproven: deque[Inbound]  # connections in, waiting for their answer, oldest first
    dropped: int
    refused: int

    def received_line(self, line: bytes) -> None: ...
    def peer_is_up(self) -> None: ...
    def linked_to(self, peer: str, link: Link) -> bool: ...
    def drop_link(self, link: Link, itself: bool) -> None: ...
    def refused_by(self, link: Link) -> None: ...


def keep_alive(transport: asyncio.BaseTransport) -> None:
    """A TCP connection whose other end vanished without a word (a node lost) is noticed
    within about `KEEPALIVE_SECONDS`, not hours later: probed when idle, abandoned when
    written data goes unacknowledged that long. (Unix sockets: nothing to do.)"""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError, AttributeError):  # (options Linux has; others may not)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_SECONDS // 3)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_SECONDS // 6)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, KEEPALIVE_SECONDS * 1000)


def _object(line: bytes) -> dict:
    """A line as a JSON object; {} when it is not one."""
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError:
        return {}
    return doc if isinstance(doc, dict) else {}


class Link(asyncio.Protocol):
    """This side's connection to one sibling's or peer's feed socket: made at open, and
    again `RECONNECT_SECONDS` after each failure or loss while the feed is open; never
    again once it turned out to be this replica's own, or one it reaches already
    (`dropped`). Over TCP it takes placements only once it has answered the opening."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.transport: asyncio.WriteTransport | None = None
        self.feed: Feed | None = None  # set while the feed is open
        self.connecting: asyncio.Task[None] | None = None  # the connect under way
        self.retry: asyncio.TimerHandle | None = None  # the next try, when one is due
        self.ready = False  # may be written to (answered the opening, if there is one)
        self.peer = ""  # the listener's replica id, once it said it
        self.buffer = bytearray()  # what the listener said, before its opening line ends
        self.dropped = False  # this replica's own, or a duplicate: never again

    def start(self, feed: Feed) -> None:
        self.feed = feed
        self.connect_now()

    def connect_now(self) -> None:
        """Connect unless connected or connecting (a sibling that just connected to this
        process is up: its socket is worth trying before the retry is due)."""
        if self.feed is not None and self.transport is None and self.connecting is None:
            if self.dropped:
                return
            if self.retry is not None:
                self.retry.cancel()
                self.retry = None
            self.connecting = asyncio.get_running_loop().create_task(self._connect())

    def write(self, data: bytes) -> bool:
        """Write `data` to the sibling if connected and keeping up (else it is dropped);
        whether it was written."""
        if not self.writable():
            return False
        assert self.transport is not None
        self.transport.write(data)
        return True

    def writable(self) -> bool:
        t = self.transport
        return (
            self.ready
            and t is not None
            and not t.is_closing()
            and t.get_write_buffer_size() <= MAX_BUFFERED
        )

    async def _connect(self) -> None:
        try:
            if self.feed is not None:
                loop, endpoint = asyncio.get_running_loop(), self.endpoint
                if isinstance(endpoint, str):
                    await loop.create_unix_connection(lambda: self, endpoint)
                else:
                    await loop.create_connection(lambda: self, endpoint[0], endpoint[1])
        except OSError:  # not started yet, restarting, gone
            self._again()
        finally:
            self.connecting = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.feed is None:  # closed meanwhile
            transport.abort()  # type: ignore[attr-defined]
            return
        self.transport = transport  # type: ignore[assignment]
        self.ready = self.feed.hello is None  # (siblings: no handshake)
        self.buffer.clear()
        keep_alive(transport)

    def data_received(self, data: bytes) -> None:
        feed = self.feed
        if feed is None or feed.hello is None or self.transport is None:
            return  # (a sibling says nothing)
        if self.ready:
            if data.startswith(REFUSED[:-1]):
                feed.refused_by(self)
            return
        self.buffer += data
        end = self.buffer.find(b"\n")
        if end < 0:
            if len(self.buffer) > MAX_HELLO:
                self.transport.abort()
            return
        line = bytes(self.buffer[:end])
        self.buffer.clear()
        verdict, peer, answer = feed.hello.answer(line)
        if verdict == "self":
            feed.drop_link(self, itself=True)
        elif verdict == "bad":  # not a feed of this build: try again later
            self.transport.abort()
        elif feed.linked_to(peer, self):  # (one replica listed under two addresses)
            feed.drop_link(self, itself=False)
        else:
            self.peer = peer
            self.transport.write(answer)
            self.ready = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.ready = False
        self._again()

    def _again(self) -> None:
        """Try again after `RECONNECT_SECONDS` (one timer per link, however many ask)."""
        if self.feed is not None and self.retry is None and not self.dropped:
            self.retry = asyncio.get_running_loop().call_later(RECONNECT_SECONDS, self._due)

    def _due(self) -> None:
        self.retry = None
        self.connect_now()

    def close(self) -> None:
        """Stop, at once: what waits to be written is dropped (a peer that stopped reading
        must not keep its buffer and socket)."""
        self.feed = None
        self.ready = False
        if self.retry is not None:
            self.retry.cancel()
            self.retry = None
        if self.transport is not None:
            self.transport.abort()
            self.transport = None


class Inbound(asyncio.Protocol):
    """One sibling's or peer's connection to this side's feed socket: lines of
    placements, once its answer to the opening checks where the feed has a hello."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.buffer = bytearray()
        self.transport: asyncio.BaseTransport | None = None
        self.trusted = feed.hello is None
        self.nonce = ""
        self.deadline: asyncio.TimerHandle | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        feed = self.feed
        if self.trusted:  # a sibling
            if len(feed.inbound) >= MAX_INBOUND:
                feed.dropped += 1
                transport.abort()  # type: ignore[attr-defined]
                return
            feed.inbound.add(self)
            feed.peer_is_up()
            return
        keep_alive(transport)
        unproven = feed.unproven
        if len(unproven) >= MAX_UNPROVEN:
            unproven[0].close()  # the oldest waiting: a peer answers in a round trip
        unproven.append(self)
        hello = feed.hello
        assert hello is not None
        self.nonce = secrets.token_hex(16)
        transport.write(hello.opening(self.nonce))  # type: ignore[attr-defined]
        self.deadline = asyncio.get_running_loop().call_later(HELLO_SECONDS, self.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.feed.inbound.discard(self)
        self._forget_unproven()
        self.transport = None

    def _forget_unproven(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if not self.trusted:
            with contextlib.suppress(ValueError):
                self.feed.unproven.remove(self)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        start = 0
        while not self.closed and (end := buffer.find(b"\n", start)) >= 0:
            line = bytes(buffer[start:end])
            start = end + 1
            if self.trusted:
                self.feed.received_line(line)
            elif not self._hello(line):
                return
        del buffer[:start]
        if len(buffer) > (MAX_LINE if self.trusted else MAX_HELLO):
            self.feed.dropped += 1
            self.close()

    def _hello(self, line: bytes) -> bool:
        """Take the first line as the answer to the opening: whether the connection goes
        on (proven, and room for it)."""
        feed = self.feed
        assert feed.hello is not None and self.transport is not None
        verdict, _ = feed.hello.check(self.nonce, line)
        if verdict == "ok" and len(feed.inbound) < MAX_INBOUND:
            self._forget_unproven()
            self.trusted = True
            feed.inbound.add(self)
            feed.peer_is_up()
            return True
        if verdict == "self":
            self.transport.write(SELF)  # type: ignore[attr-defined]
        elif verdict == "bad":
            feed.refused += 1
            self.transport.write(REFUSED)  # type: ignore[attr-defined]
        else:
            feed.dropped += 1  # (proven, but no room: MAX_INBOUND)
        self.close(gently=True)
        return False

    def close(self, gently: bool = False) -> None:
        """Close; `gently`: what was written (`self`, `refused`) still goes."""
        self.closed = True
        if self.transport is not None:
            if gently:
                self.transport.close()
            else:
                self.transport.abort()  # type: ignore[attr-defined]
        self.buffer.clear()

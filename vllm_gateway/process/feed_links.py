"""The placement feed's connections: out to each sibling or peer, and in from them.

    Link(endpoint)        this side's connection to one feed socket: made, lost, made again
    Inbound(feed)         one connection to this side's feed socket: lines of placements

An endpoint is a unix socket path (sibling processes, in the run's private directory) or
a TCP (host, port) (peer replicas, `[replicas]`). Over TCP anyone who can reach the port
can connect, and anyone may answer at a peer's address (a recycled pod IP, a mistyped
port), so both sides prove the shared token before a placement moves, and every line
after is tagged under the connection's own key (feed_handshake.py): nothing a connection
sends is applied until its answer checks, a wrong answer is told `refused` (the refused
side logs it), and a line whose tag is wrong (forged, replayed, reordered) closes the
connection. One that does not answer within `HELLO_SECONDS`, or sends more than
`MAX_HELLO` bytes first, is closed; so is a link whose listener does not prove itself in
that time. The proven ids tell a replica it reached itself (its own address among the
peers, as one list for every replica names them all), or a replica it is linked to
already (one replica listed under two names): that link is dropped. At most
`MAX_UNPROVEN` connections wait for their answer at once (a new one closes the oldest: a
peer answers in a round trip, a stranger's flood does not hold the door), and
`MAX_INBOUND` are proven.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from vllm_gateway.process.feed_handshake import (
    PROTOCOL,
    Hello,
    Pending,
    opening_protocol,
    tag,
    untag,
)

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
REFUSED = b"refused\n"  # the answer to a wrong token


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
    def mismatched(self, where: str, version: object) -> None: ...
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
        self.ready = False  # may be written to (the handshake done, if there is one)
        self.peer = ""  # the listener's replica id, once proven
        self.buffer = bytearray()  # what the listener said, before its line ends
        self.pending: Pending | None = None  # the handshake, once answered
        self.key = b""  # the connection's session key (lines are tagged under it)
        self.seq = 0  # lines written on it
        self.deadline: asyncio.TimerHandle | None = None  # the handshake's
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

    def write(self, lines: Sequence[bytes]) -> bool:
        """Write `lines` (each without its newline; tagged on a peer's connection) if
        connected and keeping up (else they are dropped); whether they were written."""
        if not self.writable():
            return False
        assert self.transport is not None
        if self.key:
            seq, key = self.seq, self.key
            self.seq += len(lines)
            lines = [tag(key, seq + i, line) for i, line in enumerate(lines)]
        self.transport.write(b"\n".join(lines) + b"\n")
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
                async with asyncio.timeout(HELLO_SECONDS):  # (a SYN lost: not 2 minutes)
                    if isinstance(endpoint, str):
                        await loop.create_unix_connection(lambda: self, endpoint)
                    else:
                        await loop.create_connection(lambda: self, endpoint[0], endpoint[1])
        except (OSError, TimeoutError):  # not started yet, restarting, gone
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
        self.pending, self.key, self.seq = None, b"", 0
        keep_alive(transport)
        if not self.ready:  # a listener that says nothing is let go, and tried again
            self.deadline = asyncio.get_running_loop().call_later(HELLO_SECONDS, self._abort)

    def data_received(self, data: bytes) -> None:
        feed = self.feed
        if feed is None or feed.hello is None or self.transport is None or self.ready:
            return  # (a sibling, and a peer after the handshake, say nothing)
        self.buffer += data
        while self.transport is not None and not self.ready:
            end = self.buffer.find(b"\n")
            if end < 0:
                if len(self.buffer) > MAX_HELLO:
                    self._abort()
                return
            line = bytes(self.buffer[:end])
            del self.buffer[: end + 1]
            self._handshake(feed, feed.hello, line)

    def _handshake(self, feed: Feed, hello: Hello, line: bytes) -> None:
        """The listener's opening, then its proof (feed_handshake.py); only a proven
        listener makes this link ready, or drops it as this replica's own or a twin."""
        assert self.transport is not None
        if self.pending is None:
            version = opening_protocol(line)
            if version is not False and version != PROTOCOL:  # another release's feed
                feed.mismatched(_where(self.endpoint), version)
                self._abort()  # (tried again later: the peer may be upgraded by then)
                return
            answered = hello.answer(line)
            if answered is None:  # not a feed of this build: try again later
                self._abort()
                return
            self.pending, out = answered
            self.transport.write(out)
            return
        if line == REFUSED[:-1]:
            feed.refused_by(self)
            self._abort()
            return
        verdict, key = hello.proven(self.pending, line)
        if verdict == "self":
            feed.drop_link(self, itself=True)
        elif verdict == "bad":  # a listener without the token: tell it nothing
            self._abort()
        elif feed.linked_to(self.pending.peer, self):  # (one replica under two addresses)
            feed.drop_link(self, itself=False)
        else:
            self.peer, self.key, self.ready = self.pending.peer, key, True
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.ready = False
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
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
        for timer in (self.retry, self.deadline):
            if timer is not None:
                timer.cancel()
        self.retry = self.deadline = None
        if self.connecting is not None:
            self.connecting.cancel()
            self.connecting = None
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
        self.key = b""  # the session key a peer's lines are tagged under (feed_handshake.py)
        self.seq = 0  # lines taken
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
        if len(unproven) >= MAX_UNPROVEN:  # the oldest waiting: a peer answers in a round trip
            unproven.popleft().close()  # (out of the count now, not at its connection_lost)
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
            if not self.trusted:
                if not self._hello(line):
                    return
            elif not self.key:  # a sibling's
                self.feed.received_line(line)
            elif (told := untag(self.key, self.seq, line)) is not None:
                self.seq += 1
                self.feed.received_line(told)
            else:  # forged, replayed or out of order: not from the peer that proved itself
                self.feed.refused += 1
                self.close()
                return
        del buffer[:start]
        if len(buffer) > (MAX_LINE if self.trusted else MAX_HELLO):
            self.feed.dropped += 1
            self.close()

    def _hello(self, line: bytes) -> bool:
        """Take the first line as the answer to the opening: whether the connection goes
        on (proven, and room for it). Proven, the listener proves itself in return."""
        feed = self.feed
        assert feed.hello is not None and self.transport is not None
        verdict, proof, key = feed.hello.check(self.nonce, line)
        if verdict == "ok" and len(feed.inbound) < MAX_INBOUND:
            self._forget_unproven()
            self.trusted, self.key = True, key
            self.transport.write(proof)  # type: ignore[attr-defined]
            feed.inbound.add(self)
            feed.peer_is_up()
            return True
        if verdict == "self":
            self.transport.write(proof)  # type: ignore[attr-defined]
        elif verdict == "bad":
            feed.refused += 1
            self.transport.write(REFUSED)  # type: ignore[attr-defined]
        elif verdict == "version":  # the token, but another release: no link (logged)
            # Closed without `refused`, which an older release reads as a wrong token: it
            # just tries again later, quietly.
            feed.mismatched(_where(self.transport.get_extra_info("peername")), None)
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


def _where(endpoint: object) -> str:
    """A link's endpoint or a connection's peer address, for a log line."""
    if isinstance(endpoint, tuple) and len(endpoint) >= 2:
        return f"{endpoint[0]}:{endpoint[1]}"
    return str(endpoint)

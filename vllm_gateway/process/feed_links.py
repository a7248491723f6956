"""The placement feed's connections: out to each sibling or peer, and in from them.

    Link(endpoint)        this side's connection to one feed socket: made, lost, made again
    Inbound(feed)         one connection to this side's feed socket: lines of placements

An endpoint is a unix socket path (sibling processes, in the run's private directory) or
a TCP (host, port) (peer replicas, `[replicas]`). Over TCP anyone who can reach the port
can connect, so the feed has a `Hello`: the connecting side first sends one line with the
shared token and its replica's id, and nothing it sends is applied until that line
matches the token (compared in constant time); a connection that sends no good hello
within `HELLO_SECONDS`, or more than `MAX_HELLO` bytes before it, is closed. A hello
carrying this replica's own id is this replica reaching itself (its own address among the
peers, as one config file for every replica lists them all): it is answered `self` and
closed, and the link that made it stops trying.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from vllm_gateway.process.placement_feed import PlacementFeed

Endpoint = str | tuple[str, int]  # a unix socket path, or a TCP (host, port)

# Longest line read (a batch at its largest is about 360 KB); past it the sender is not a
# feed of this build, and the connection is closed.
MAX_LINE = 1 << 20
# Bytes written to a sibling and not yet taken by it, at most: past this, placements for
# it are dropped until it catches up (a process stalled for seconds at full load).
MAX_BUFFERED = 4 << 20
# A sibling or peer that is away is tried again after this many seconds.
RECONNECT_SECONDS = 1.0
# A connection to a feed with a hello must send it within this many seconds, in at most
# this many bytes (a token and an id, a few hundred).
HELLO_SECONDS = 5.0
MAX_HELLO = 4096
# Connections in at once, at most (peers x their processes; more is a stranger's flood).
MAX_INBOUND = 256
SELF = b"self\n"  # the answer to a hello from this replica itself


@dataclass(frozen=True)
class Hello:
    """What a replica's feed connection says first: the shared token, its replica's id."""

    token: str
    ident: str

    def line(self) -> bytes:
        return orjson.dumps({"token": self.token, "id": self.ident}) + b"\n"

    def check(self, line: bytes) -> str:
        """'ok' for a peer's good hello, 'self' for this replica's own, else 'bad'."""
        try:
            doc = orjson.loads(line)
        except orjson.JSONDecodeError:
            return "bad"
        if not isinstance(doc, dict):
            return "bad"
        token, ident = doc.get("token"), doc.get("id")
        if not (isinstance(token, str) and isinstance(ident, str)):
            return "bad"
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            return "bad"
        return "self" if ident == self.ident else "ok"


class Link(asyncio.Protocol):
    """This side's connection to one sibling's or peer's feed socket: made at open, and
    again `RECONNECT_SECONDS` after each failure or loss while the feed is open; never
    again once it turned out to be this replica's own (`itself`)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.transport: asyncio.WriteTransport | None = None
        self.feed: PlacementFeed | None = None  # set while the feed is open
        self.connecting: asyncio.Task[None] | None = None  # the connect under way
        self.retry: asyncio.TimerHandle | None = None  # the next try, when one is due
        self.itself = False  # the endpoint is this replica's own feed

    def start(self, feed: PlacementFeed) -> None:
        self.feed = feed
        self.connect_now()

    def connect_now(self) -> None:
        """Connect unless connected or connecting (a sibling that just connected to this
        process is up: its socket is worth trying before the retry is due)."""
        if self.feed is not None and self.transport is None and self.connecting is None:
            if self.itself:
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
        return t is not None and not t.is_closing() and t.get_write_buffer_size() <= MAX_BUFFERED

    async def _connect(self) -> None:
        try:
            if self.feed is not None:
                loop, endpoint = asyncio.get_running_loop(), self.endpoint
                if isinstance(endpoint, str):
                    await loop.create_unix_connection(lambda: self, endpoint)
                else:
                    await loop.create_connection(lambda: self, endpoint[0], endpoint[1])
        except OSError:  # not started yet, restarting, gone, a name that does not resolve
            self._again()
        finally:
            self.connecting = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.feed is None:  # closed meanwhile
            transport.close()
            return
        self.transport = transport  # type: ignore[assignment]
        if self.feed.hello is not None:
            transport.write(self.feed.hello.line())  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        # The other side says only `self`, then closes (a feed never answers otherwise).
        if data.startswith(SELF[:-1]) and not self.itself:
            self.itself = True
            if self.feed is not None:
                self.feed.found_itself(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._again()

    def _again(self) -> None:
        """Try again after `RECONNECT_SECONDS` (one timer per link, however many ask)."""
        if self.feed is not None and self.retry is None and not self.itself:
            self.retry = asyncio.get_running_loop().call_later(RECONNECT_SECONDS, self._due)

    def _due(self) -> None:
        self.retry = None
        self.connect_now()

    def close(self) -> None:
        self.feed = None
        if self.retry is not None:
            self.retry.cancel()
            self.retry = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class Inbound(asyncio.Protocol):
    """One sibling's or peer's connection to this side's feed socket: lines of
    placements, after a good hello where the feed asks one."""

    def __init__(self, feed: PlacementFeed) -> None:
        self.feed = feed
        self.buffer = bytearray()
        self.transport: asyncio.BaseTransport | None = None
        self.trusted = feed.hello is None
        self.deadline: asyncio.TimerHandle | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        feed = self.feed
        if len(feed._inbound) >= MAX_INBOUND:
            feed.dropped += 1
            transport.close()
            return
        feed._inbound.add(self)
        if not self.trusted:
            self.deadline = asyncio.get_running_loop().call_later(HELLO_SECONDS, self.close)
        for link in feed._peers:  # a sibling or peer is up: connect to it, if not yet
            link.connect_now()

    def connection_lost(self, exc: Exception | None) -> None:
        self.feed._inbound.discard(self)
        self.transport = None
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

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
        """Take the first line as the hello: whether the connection goes on."""
        assert self.feed.hello is not None and self.transport is not None
        verdict = self.feed.hello.check(line)
        if verdict == "ok":
            self.trusted = True
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None
            return True
        if verdict == "self":
            self.transport.write(SELF)  # type: ignore[attr-defined]
        else:
            self.feed.refused += 1
        self.close()
        return False

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()  # (what was written still goes: `self`)
        self.buffer.clear()

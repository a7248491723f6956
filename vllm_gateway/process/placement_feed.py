"""Where each process of a gateway, and each replica, sent which prompt: told to all.

The kernel spreads client connections over the processes of `serve --processes N`, and an
L4 balancer spreads them over replicas, so the turns of one conversation reach them in no
particular order. Each process's cache_aware keeps its own index of what it sent where
(dispatch/prefix_index.py) and its own count of the preambles' shares
(dispatch/preamble_plan.py), so a turn that reaches a process that did not send the turn
before does not know where its history is, and moves it when that process's rendezvous
order, plan or loads differ from the other's (docs/dispatch-rounds.md measured 21 history
re-prefills with two processes against 4 with one, and a TTFT p99 three times one
process's; behind two replicas, each sent the turns it got to its own copy). Here every
placement a process makes (the model, the worker's URL, what the prompt shares with many
as cache_aware counted it, its preamble and block names) goes to its siblings and to the
peer replicas, which count and record it as if they had made it: about one index and one
count of shares (so about one preamble plan), kept in every process. About: a process that
restarts starts empty, and what a stalled sibling or peer could not take is dropped. The
same lines also tell every request sent (a placement, or with no names) and its end, so
each process counts the others' requests on a worker as they run, not only as its last
scrape saw them (process/placement_sharing.py: the capacity gate's blind window).

Between siblings the channel is a unix stream socket per process, in the run's private
directory beside the control sockets (siblings.py); between replicas a TCP port of each
(`[replicas]`, config/replicas.py), whose connections first prove the shared token
(feed_links.py). Each side connects to every other's as it starts. Placements are
batched: a dispatch appends to an outbox, and one write per sibling or peer per
event-loop pass carries all of that pass's placements, one JSON array per line. Nothing
waits on it and nothing is retried: while a sibling or peer is away (not started yet,
restarting) its placements are dropped, and the connection is tried again every
`RECONNECT_SECONDS`; and while it reads too slowly to keep what is written to it under
`MAX_BUFFERED` bytes, so are they. The index they would have fed is a guess anyway; a lost
placement costs at worst a prefill, and a lost end (below) a slot kept out of use until the
next scrape. What arrives is checked (types, sizes) before use: a
malformed line is dropped whole, and a line longer than `MAX_LINE` closes the connection.
A peer's placement reaches the one process of this replica its connection landed on,
which tells its siblings too.

Block names are CRC-32 chains (prefix_hash.py), the same in every interpreter, so a name
told means the same prefix here.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence

import orjson

from vllm_gateway.dispatch.prefix_hash import MAX_BLOCKS
from vllm_gateway.errors import CannotListen
from vllm_gateway.log import get_logger
from vllm_gateway.process.feed_handshake import PROTOCOL, Hello
from vllm_gateway.process.feed_links import Endpoint, Inbound, Link

log = get_logger("vllm_gateway.placement_feed")
_QUIET = contextvars.Context()

# Placements per line: each is at most 2 x MAX_BLOCKS + 2 names of ~20 digits (~1.4 KB as
# JSON) and two texts of at most `MAX_TEXT`.
BATCH = 64
# Names one placement may carry: the key's blocks, the key's own name, the blocks after it,
# and the preamble.
MAX_NAMES = 2 * MAX_BLOCKS + 2
# Placements waiting for the next write, at most (a pass dispatching thousands): the rest
# are not told (each process still records its own).
MAX_OUTBOX = 4096
MAX_TEXT = 2048  # longest model name or URL told or accepted
# Drops are logged at most this often (seconds), with how many since.
LOG_EVERY = 60.0
# Peers' host names are looked up again this often (seconds): a headless Service's pods
# come and go.
RESOLVE_SECONDS = 10.0
MAX_ADDRESSES = 256  # peer addresses linked to, at most, whatever the names resolve to

# model, worker URL, what it shared with many (as counted; -1: a conversation's later
# request, not counted again; below that, a line with no placement to record:
# placement_sharing.py's LOAD and DONE), preamble, block names
Placement = tuple[str, str, int, int, Sequence[int]]
Apply = Callable[[str, str, int, int, Sequence[int]], None]


def feed_path(control_dir: str, index: int) -> str:
    """The feed socket of process `index`."""
    return os.path.join(control_dir, f"process-{index}.feed")


class PlacementFeed:
    """Sends this side's placements to its siblings or peers, and applies theirs (`apply`)."""

    def __init__(
        self,
        listen: Endpoint | None,
        peers: Sequence[Endpoint],
        apply: Apply,
        *,
        hello: Hello | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.listen = listen
        self.hello = hello  # asked of every connection in, said on every one out
        self._reuse_port = reuse_port  # (a TCP port every process of a replica listens on)
        self._apply = apply
        # Unix paths are links as they are; a TCP peer's host name stands for every address
        # it resolves to (a headless Service's pods), looked up at open and every
        # `RESOLVE_SECONDS` (`_resolving`).
        self._peers = [Link(endpoint) for endpoint in peers if isinstance(endpoint, str)]
        self._names = [endpoint for endpoint in peers if not isinstance(endpoint, str)]
        self._resolved: dict[tuple[str, int], list[tuple[str, int]]] = {}  # name -> addresses
        # Addresses found to be this replica's own, or a replica linked at another
        # address: not linked again (the second kind until the names are looked up again).
        self._itself: set[Endpoint] = set()
        self._twins: set[Endpoint] = set()
        self._resolvers: list[asyncio.Task[None]] = []
        self.unproven: deque[Inbound] = deque()  # connections in waiting for their answer
        self._what = "peer replicas" if hello is not None else "sibling processes"
        self._outbox: list[Placement] = []
        self._scheduled = False
        self._server: asyncio.AbstractServer | None = None  # (None: not listening)
        self._open = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.inbound: set[Inbound] = set()
        self.sent = 0  # placements written to siblings or peers (once per each)
        self.received = 0  # placements applied from them
        self.dropped = 0  # placements not told to one (away, too slow), lines not parsed
        self.refused = 0  # connections in whose answer did not prove the token (peers)
        self._refused_at = -LOG_EVERY
        self.mismatches = 0  # handshakes of another feed protocol, either side
        self._mismatch_at = -LOG_EVERY
        self._logged_drops = 0
        self._logged_at = self._failed_at = self._unresolved_at = -LOG_EVERY

    @classmethod
    def siblings(cls, index: int, count: int, control_dir: str, apply: Apply) -> PlacementFeed:
        """Process `index` of `count` (`serve --processes N`): unix sockets in `control_dir`."""
        others = [feed_path(control_dir, i) for i in range(count) if i != index]
        return cls(feed_path(control_dir, index), others, apply)

    async def open(self) -> None:
        """Listen for the siblings' or peers' placements; connect to theirs as they are
        needed. A TCP address that cannot be listened on raises CannotListen."""
        self._loop = loop = asyncio.get_running_loop()
        listen = self.listen
        if listen is None:
            pass  # (a replica that only tells)
        elif isinstance(listen, str):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(listen)  # left by a process that died (it is restarted)
            self._server = await loop.create_unix_server(lambda: Inbound(self), listen)
        else:
            try:
                self._server = await loop.create_server(
                    lambda: Inbound(self),
                    listen[0],
                    listen[1],
                    reuse_port=self._reuse_port or None,
                    family=socket.AF_UNSPEC,
                )
            except OSError as e:
                where = f"{listen[0]}:{listen[1]}"
                raise CannotListen(f"the replicas' feed at {where}: {e.strerror or e}") from e
        self._open = True
        for peer in self._peers:
            peer.start(self)
        # One resolver per name: a name slow to answer holds up no other.
        self._resolvers = [loop.create_task(self._resolving(name)) for name in self._names]

    def connected(self) -> int:
        """Siblings or peers this side is connected to now (answered, for peers)."""
        return sum(1 for link in self._peers if link.writable())

    def peer_is_up(self) -> None:
        """A sibling or peer proved itself on a connection in: connect to every one not
        connected (it may have just restarted), before their retries are due."""
        for link in self._peers:
            link.connect_now()

    def linked_to(self, peer: str, link: Link) -> bool:
        """Whether another link reaches replica `peer` already."""
        return any(x.peer == peer and x is not link and x.ready for x in self._peers)

    def drop_link(self, link: Link, itself: bool) -> None:
        """`link` reached this replica itself, or a replica another link reaches: it is
        dropped, so its placements are neither sent twice nor counted as lost."""
        with contextlib.suppress(ValueError):
            self._peers.remove(link)
        (self._itself if itself else self._twins).add(link.endpoint)
        link.dropped = True
        link.close()

    def refused_by(self, link: Link) -> None:
        """A peer refused this replica's answer: the tokens differ (logged once a minute)."""
        self.refused += 1
        if time.monotonic() - self._refused_at > LOG_EVERY:
            self._refused_at = time.monotonic()
            e = link.endpoint
            peer = e if isinstance(e, str) else f"{e[0]}:{e[1]}"
            log.error(
                "a peer replica refused this one's token",
                peer=peer,
                hint="every replica needs the same VLLM_GATEWAY_REPLICAS_TOKEN (replicas.token)",
            )

    def mismatched(self, where: str, version: object) -> None:
        """A peer at `where` speaks another feed protocol (`version`, as its opening said;
        None: none, a release before versions, or not said: an answer proven with the
        token under another version): no link with it (logged once a minute)."""
        self.mismatches += 1
        if time.monotonic() - self._mismatch_at > LOG_EVERY:
            self._mismatch_at = time.monotonic()
            log.error(
                "a peer replica speaks another placement feed protocol",
                peer=where,
                theirs=version if isinstance(version, int) else None,
                ours=PROTOCOL,
                hint="placements are shared only between replicas of one release: during "
                "a rolling upgrade each places alone until all run the same one",
            )

    async def _resolving(self, name: tuple[str, int]) -> None:
        """Keep one link per address the peers' names resolve to, `name`'s looked up now
        and every `RESOLVE_SECONDS`: new addresses get a link, gone ones lose theirs. A
        name that does not resolve keeps the addresses it had (and none at first)."""
        loop = asyncio.get_running_loop()
        while self._open:
            try:
                async with asyncio.timeout(RESOLVE_SECONDS):
                    found = await loop.getaddrinfo(name[0], name[1], type=socket.SOCK_STREAM)
            except (OSError, UnicodeError, TimeoutError) as e:  # (gaierror; a bad label)
                now = time.monotonic()
                if name not in self._resolved and now - self._unresolved_at > LOG_EVERY:
                    self._unresolved_at = now
                    peer = f"{name[0]}:{name[1]}"
                    log.warning("a peer's name does not resolve", peer=peer, error=repr(e))
            else:
                # The addresses of the family the system prefers (its first answer's): a
                # name with IPv4 and IPv6 addresses for one replica would link it twice.
                family = found[0][0] if found else None
                self._resolved[name] = [
                    (str(a[4][0]), int(a[4][1])) for a in found if a[0] == family
                ][:MAX_ADDRESSES]
                self._twins.clear()  # (each looked at again: the replica behind may differ)
                self._follow({a for addresses in self._resolved.values() for a in addresses})
            await asyncio.sleep(RESOLVE_SECONDS)

    def _follow(self, addresses: set[tuple[str, int]]) -> None:
        """Links to exactly these TCP `addresses` (less this replica's own and twins),
        `MAX_ADDRESSES` at most."""
        if not self._open:
            return
        for link in [x for x in self._peers if not isinstance(x.endpoint, str)]:
            if link.endpoint not in addresses:
                self._peers.remove(link)
                link.close()
        have = {link.endpoint for link in self._peers}
        room = max(0, MAX_ADDRESSES - len(have))
        for address in sorted(addresses - have - self._itself - self._twins)[:room]:
            link = Link(address)
            self._peers.append(link)
            link.start(self)

    async def close(self) -> None:
        if not self._open:
            return
        self._open = False
        for task in self._resolvers:
            task.cancel()
        self._resolvers = []
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for inbound in [*self.inbound, *self.unproven]:
            inbound.close()
        for peer in self._peers:
            peer.close()
        if isinstance(self.listen, str):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.listen)
        if server is not None:
            await server.wait_closed()

    def publish(
        self, model: str, url: str, shared: int, preamble: int, names: Sequence[int]
    ) -> None:
        """This process sent a prompt for `model` with `names` (and `preamble`; sharing
        `shared` with many) to `url`; or, `shared` below -1, a line the wiring gives its own
        meaning (placement_sharing.py: a request with nothing to record, a request's end)."""
        if not self._open or len(model) > MAX_TEXT or len(url) > MAX_TEXT:
            return
        if len(self._outbox) >= MAX_OUTBOX:
            self.dropped += len(self._peers)
            return
        self._outbox.append((model, url, shared, preamble, names))
        if not self._scheduled:
            self._scheduled = True
            assert self._loop is not None
            # In a context of its own: its log lines are no request's.
            self._loop.call_soon(self._flush, context=_QUIET)

    def _flush(self) -> None:
        self._scheduled = False
        outbox, self._outbox = self._outbox, []
        if not self._open or not outbox:
            return
        if not any(peer.writable() for peer in self._peers):
            self.dropped += len(outbox) * len(self._peers)  # (none serialised for nobody)
            self._log_drops()
            return
        lines = [orjson.dumps(outbox[i : i + BATCH]) for i in range(0, len(outbox), BATCH)]
        for peer in self._peers:
            if peer.write(lines):
                self.sent += len(outbox)
            else:
                self.dropped += len(outbox)
        self._log_drops()

    def _log_drops(self) -> None:
        if self.dropped > self._logged_drops and time.monotonic() - self._logged_at > LOG_EVERY:
            self._logged_at = time.monotonic()
            log.warning(
                f"placements not told to {self._what}",
                dropped=self.dropped - self._logged_drops,
                hint="one is away or too slow to read them: it may place a "
                "conversation's next turn without knowing where its history is",
            )
            self._logged_drops = self.dropped

    def received_line(self, line: bytes) -> None:
        placements = _parse(line)
        if placements is None:
            self.dropped += 1
            return
        try:
            for model, url, shared, preamble, names in placements:
                self._apply(model, url, shared, preamble, names)
                self.received += 1
        except Exception as e:  # a defect here: the rest of the line is dropped, not the link
            self.dropped += 1
            if time.monotonic() - self._failed_at > LOG_EVERY:
                self._failed_at = time.monotonic()
                error = f"{type(e).__name__}: {e}"
                log.error(f"a placement from the {self._what} failed to apply", error=error)


def _parse(line: bytes) -> list[tuple[str, str, int, int, list[int]]] | None:
    """A sibling's line as placements; None when anything in it is malformed."""
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, list) or len(doc) > BATCH:
        return None
    out = []
    for item in doc:
        if not (isinstance(item, list) and len(item) == 5):
            return None
        model, url, shared, preamble, names = item
        if not (
            isinstance(model, str)
            and isinstance(url, str)
            and len(model) <= MAX_TEXT
            and len(url) <= MAX_TEXT
            and type(shared) is int
            and type(preamble) is int
            and isinstance(names, list)
            and len(names) <= MAX_NAMES
            and all(type(n) is int for n in names)
        ):
            return None
        out.append((model, url, shared, preamble, names))
    return out

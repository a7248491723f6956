"""Where each process of one gateway (`serve --processes N`) sent which prompt: told to all.

The kernel spreads client connections over the processes, so the turns of one conversation
reach them in no particular order. Each process's cache_aware keeps its own index of what
it sent where (dispatch/prefix_index.py) and its own count of the preambles' shares
(dispatch/preamble_plan.py), so a turn that reaches the process that did not send the turn
before does not know where its history is, and moves it when that process's rendezvous
order, plan or loads differ from the other's (docs/dispatch-rounds.md measured 21 history
re-prefills with two processes against 4 with one, and a TTFT p99 three times one
process's). Here every placement a process makes (the model, the worker's URL, what the
prompt shares with many as cache_aware counted it, its preamble and block names) goes to
its siblings, which count and record it as if they had made it: about one index and one
count of shares (so about one preamble plan), kept in N copies. About: a process that
restarts starts empty, and what a stalled sibling could not take is dropped.

The channel is a unix stream socket per process, in the run's private directory beside
the control sockets (siblings.py); each process connects to every sibling's as it starts. Placements
are batched: a dispatch appends to an outbox, and one write per sibling per event-loop
pass carries all of that pass's placements, one JSON array per line. Nothing waits on it
and nothing is retried: while a sibling is away (not started yet, restarting) its
placements are dropped, and the connection is tried again every `RECONNECT_SECONDS`; and
while it reads too slowly to keep what is written to it under `MAX_BUFFERED` bytes, so are
they. The index they would have fed is a guess anyway; a lost placement costs at worst a
prefill. What arrives is checked (types, sizes) before use: a malformed line is dropped
whole, and a line longer than `MAX_LINE` closes the connection.

Block names past a conversation's key are Python's `hash()`, seeded per interpreter; the
processes are forked from one parent (supervisor.py), so they share the seed and name
blocks alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import time
from collections.abc import Callable, Sequence

import orjson

from vllm_gateway.dispatch.dispatcher import Dispatcher
from vllm_gateway.dispatch.policies import Policy
from vllm_gateway.dispatch.policies.cache_aware import CacheAware
from vllm_gateway.dispatch.prefix_hash import MAX_BLOCKS
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.log import get_logger
from vllm_gateway.workers import Worker, WorkerRegistry

log = get_logger("vllm_gateway.placement_feed")
_QUIET = contextvars.Context()

# Placements per line: each is at most 2 x MAX_BLOCKS + 2 names of ~20 digits (~1.4 KB as
# JSON) and two texts of at most `MAX_TEXT`.
BATCH = 64
# Longest line read (a batch at its largest is about 360 KB); past it the sender is not a
# sibling of this build, and the connection is closed.
MAX_LINE = 1 << 20
# Bytes written to a sibling and not yet taken by it, at most: past this, placements for
# it are dropped until it catches up (a process stalled for seconds at full load).
MAX_BUFFERED = 4 << 20
# A sibling that is away is tried again after this many seconds.
RECONNECT_SECONDS = 1.0
# Names one placement may carry: the key's blocks, the key's own name, the blocks after it,
# and the preamble.
MAX_NAMES = 2 * MAX_BLOCKS + 2
# Placements waiting for the next write, at most (a pass dispatching thousands): the rest
# are not told (each process still records its own).
MAX_OUTBOX = 4096
MAX_TEXT = 2048  # longest model name or URL told or accepted
# Drops are logged at most this often (seconds), with how many since.
LOG_EVERY = 60.0

# model, worker URL, what it shared with many (as counted; -1: a conversation's later
# request, not counted again), preamble, block names
Placement = tuple[str, str, int, int, Sequence[int]]
Apply = Callable[[str, str, int, int, Sequence[int]], None]


def feed_path(control_dir: str, index: int) -> str:
    """The feed socket of process `index`."""
    return os.path.join(control_dir, f"process-{index}.feed")


class PlacementFeed:
    """Sends this process's placements to its siblings, and applies theirs (`apply`)."""

    def __init__(self, index: int, count: int, control_dir: str, apply: Apply) -> None:
        self.path = feed_path(control_dir, index)
        self._apply = apply
        self._peers = [_Peer(feed_path(control_dir, i)) for i in range(count) if i != index]
        self._outbox: list[Placement] = []
        self._scheduled = False
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers: set[_Reader] = set()
        self.sent = 0  # placements written to siblings (once per sibling)
        self.received = 0  # placements applied from siblings
        self.dropped = 0  # placements not told to a sibling (away, too slow), lines not parsed
        self._logged_drops = 0
        self._logged_at = self._failed_at = -LOG_EVERY

    async def open(self) -> None:
        """Listen for the siblings' placements; connect to theirs as they are needed."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # left by a process that died (it is restarted)
        self._loop = loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Reader(self), self.path)
        for peer in self._peers:
            peer.start(self)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for reader in list(self._readers):
            reader.close()
        for peer in self._peers:
            peer.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        await server.wait_closed()

    def publish(
        self, model: str, url: str, shared: int, preamble: int, names: Sequence[int]
    ) -> None:
        """This process sent a prompt for `model` with `names` (and `preamble`; sharing
        `shared` with many) to `url`."""
        if self._server is None or len(model) > MAX_TEXT or len(url) > MAX_TEXT:
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
        if self._server is None or not outbox:
            return
        if not any(peer.writable() for peer in self._peers):
            self.dropped += len(outbox) * len(self._peers)  # (none serialised for nobody)
            self._log_drops()
            return
        lines = b"".join(
            orjson.dumps(outbox[i : i + BATCH]) + b"\n" for i in range(0, len(outbox), BATCH)
        )
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
                "placements not told to sibling processes",
                dropped=self.dropped - self._logged_drops,
                hint="a sibling is away or too slow to read them: it may place a "
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
                log.error("a sibling's placement failed to apply", error=f"{type(e).__name__}: {e}")


class _Peer(asyncio.Protocol):
    """This process's connection to one sibling's feed socket: made at open, and again
    `RECONNECT_SECONDS` after each failure or loss while the feed is open."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.transport: asyncio.WriteTransport | None = None
        self.feed: PlacementFeed | None = None  # set while the feed is open
        self.connecting: asyncio.Task[None] | None = None  # the connect under way
        self.retry: asyncio.TimerHandle | None = None  # the next try, when one is due

    def start(self, feed: PlacementFeed) -> None:
        self.feed = feed
        self.connect_now()

    def connect_now(self) -> None:
        """Connect unless connected or connecting (a sibling that just connected to this
        process is up: its socket is worth trying before the retry is due)."""
        if self.feed is not None and self.transport is None and self.connecting is None:
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
                await asyncio.get_running_loop().create_unix_connection(lambda: self, self.path)
        except OSError:  # not started yet, restarting, gone
            self._again()
        finally:
            self.connecting = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.feed is None:  # closed meanwhile
            transport.close()
        else:
            self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._again()

    def _again(self) -> None:
        """Try again after `RECONNECT_SECONDS` (one timer per sibling, however many ask)."""
        if self.feed is not None and self.retry is None:
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


class _Reader(asyncio.Protocol):
    """One sibling's connection to this process's feed socket: lines of placements."""

    def __init__(self, feed: PlacementFeed) -> None:
        self.feed = feed
        self.buffer = bytearray()
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.feed._readers.add(self)
        for peer in self.feed._peers:  # a sibling is up: connect to it, if not yet
            peer.connect_now()

    def connection_lost(self, exc: Exception | None) -> None:
        self.feed._readers.discard(self)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            self.feed.received_line(bytes(buffer[start:end]))
            start = end + 1
        del buffer[:start]
        if len(buffer) > MAX_LINE:
            self.feed.dropped += 1
            self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.buffer.clear()


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


def share_placements(
    dispatcher: Dispatcher, registry: WorkerRegistry, index: int, count: int, control_dir: str
) -> PlacementFeed:
    """Tell the siblings each placement a cache_aware policy of `dispatcher` makes, and
    record theirs in the same policy's index here (the worker by its URL: each process has
    its own Worker objects for the same workers)."""

    def apply(model: str, url: str, shared: int, preamble: int, names: Sequence[int]) -> None:
        policy = dispatcher.policy_for_model.get(model, dispatcher.policy)
        if isinstance(policy, CacheAware):  # (a worker not known here yet is still counted)
            policy.told(model, registry.get(url), shared, preamble, names)

    feed = PlacementFeed(index, count, control_dir, apply)
    publish = feed.publish

    def placed(policy: Policy, info: RequestInfo, worker: Worker) -> None:
        if isinstance(policy, CacheAware):
            blocks = info.prefix_blocks()  # (computed once, by the policy's select)
            if blocks is not None:
                shared = policy.shared if policy.new else -1  # (-1: not counted again)
                publish(info.model, worker.url, shared, blocks.preamble, blocks.blocks)

    dispatcher.on_placed = placed
    return feed

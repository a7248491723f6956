"""Where each process of one gateway (`serve --processes N`) sent which prompt: told to all.

The kernel spreads client connections over the processes, so the turns of one conversation
reach them in no particular order. Each process's cache_aware keeps its own index of what
it sent where (dispatch/prefix_index.py), so a turn that reaches the process that did not
send the turn before does not know where its history is, and moves it when that process's
rendezvous order and loads differ from the other's (docs/benchmarks.md measured 21 history
re-prefills with two processes against 4 with one, and a TTFT p99 three times one
process's). Here every placement a process makes (the model, the worker's URL, what the
prompt shares with many as cache_aware counted it, its preamble and block names) goes to
its siblings, which count and record it as if they had sent it: one index and one count
of the preambles' shares (so one preamble plan), kept in N copies.

The channel is a unix datagram socket per process, in the run's private directory beside
the control sockets (siblings.py). Placements are batched: a dispatch appends to an outbox,
and one send per sibling per event-loop pass carries all of that pass's placements (at
most `BATCH` per datagram). Nothing waits on it and nothing is retried: a datagram the
kernel cannot take now (a sibling restarting, its buffer full) is dropped, and the index it
would have fed is a guess anyway, which costs at worst a prefill. What arrives is checked
(types, sizes) before use: a malformed datagram is dropped whole.

Block names past a conversation's key are Python's `hash()`, seeded per interpreter; the
processes are forked from one parent, so they share the seed and name blocks alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
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

# Placements per datagram: each is at most 2 x MAX_BLOCKS + 2 names of ~20 digits (~1.4 KB
# as JSON), so a datagram stays well under the kernel's default socket buffer (~208 KB).
BATCH = 32
# Largest datagram read; anything longer is cut by the kernel and fails to parse (dropped).
MAX_DATAGRAM = 256 * 1024
# Names one placement may carry: the key's blocks, the key's own name, the blocks after it,
# and the preamble.
MAX_NAMES = 2 * MAX_BLOCKS + 2
# Placements waiting for the next send, at most: past this (a pass dispatching thousands),
# the rest are not told (each process still records its own).
MAX_OUTBOX = 4096
_MAX_TEXT = 2048  # longest model name or URL accepted from a sibling

# model, worker URL, what it shared with many (as counted), preamble, block names
Apply = Callable[[str, str, int, int, Sequence[int]], None]


def feed_path(control_dir: str, index: int) -> str:
    """The datagram socket of process `index`."""
    return os.path.join(control_dir, f"process-{index}.feed")


class PlacementFeed:
    """Sends this process's placements to its siblings, and applies theirs (`apply`)."""

    def __init__(self, index: int, count: int, control_dir: str, apply: Apply) -> None:
        self.path = feed_path(control_dir, index)
        self._peers = [feed_path(control_dir, i) for i in range(count) if i != index]
        self._apply = apply
        self._outbox: list[tuple[str, str, int, int, Sequence[int]]] = []
        self._scheduled = False
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sent = 0  # placements told to siblings (each counted once, however many)
        self.received = 0  # placements applied from siblings
        self.dropped = 0  # datagrams not sent (buffer full, sibling away) or not parsed

    def open(self) -> None:
        """Bind this process's socket and start reading the siblings' placements."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # left by a process that died (it is restarted)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(self.path)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._read)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._loop is not None:
            self._loop.remove_reader(sock.fileno())
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def publish(
        self, model: str, url: str, shared: int, preamble: int, names: Sequence[int]
    ) -> None:
        """This process sent a prompt for `model` with `names` (and `preamble`; sharing
        `shared` with many) to `url`."""
        if self._sock is None or len(self._outbox) >= MAX_OUTBOX:
            return
        self._outbox.append((model, url, shared, preamble, names))
        if not self._scheduled:
            self._scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        outbox, self._outbox = self._outbox, []
        sock = self._sock
        if sock is None:
            return
        for start in range(0, len(outbox), BATCH):
            data = orjson.dumps(outbox[start : start + BATCH])
            for peer in self._peers:
                try:
                    sock.sendto(data, peer)
                except OSError:  # full (EAGAIN), or the sibling is away (restarting)
                    self.dropped += 1
        self.sent += len(outbox)

    def _read(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                data = sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            placements = _parse(data)
            if placements is None:
                self.dropped += 1
                continue
            for model, url, shared, preamble, names in placements:
                self._apply(model, url, shared, preamble, names)
            self.received += len(placements)


def _parse(data: bytes) -> list[tuple[str, str, int, int, list[int]]] | None:
    """A sibling's datagram as placements; None when anything in it is malformed."""
    try:
        doc = orjson.loads(data)
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
            and len(model) <= _MAX_TEXT
            and len(url) <= _MAX_TEXT
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
        worker = registry.get(url)
        policy = dispatcher.policy_for_model.get(model, dispatcher.policy)
        if worker is not None and isinstance(policy, CacheAware):
            policy.told(model, worker, shared, preamble, names)

    feed = PlacementFeed(index, count, control_dir, apply)
    publish = feed.publish

    def placed(policy: Policy, info: RequestInfo, worker: Worker) -> None:
        if isinstance(policy, CacheAware):
            blocks = info.prefix_blocks()  # (computed once, by the policy's select)
            if blocks is not None:
                publish(info.model, worker.url, policy.shared, blocks.preamble, blocks.blocks)

    dispatcher.on_placed = placed
    return feed

"""The admission queue: requests waiting in the gateway for a worker with room, per model.

Order is by priority (the `X-Priority` header, lower first, default 0), then arrival. A
waiter holds a future that dispatch resolves with a lease when a worker has room (late
binding: the worker is chosen then, with the freshest state, not at arrival), or with an
error when none can ever serve it. A waiter that leaves (client gone, waited too long) is
marked gone and skipped; it no longer counts toward the bound.

A waiter whose policy would rather have a full worker than any with room (the holder of
its conversation's history, or of its document, when that worker's KV cache binds) may be
set aside to wait for it (`ModelQueue.patient`; patience.py says when and how long): the
waiters behind it may then go first, to the workers with room.

Plain counters for telemetry: `depth` (waiting now, all models), `admitted` (left the queue
with a worker), `rejected` (queue full), `timed_out`, `abandoned` (client left), and
`wait_seconds` (total time admitted requests waited) with `max_wait_seen`.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker


class Waiter:
    """One queued request."""

    __slots__ = ("enqueued", "exclude", "future", "gone", "info", "key", "last", "until", "wants")

    def __init__(self, info: RequestInfo, exclude: Sequence[Worker], key: tuple[int, int]) -> None:
        self.info = info
        self.exclude = exclude
        self.key = key  # (priority, arrival number): heap order
        self.enqueued = time.monotonic()
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.gone = False
        self.wants: Sequence[Worker] = ()  # set aside: the full workers it waits for
        self.until = 0.0  # when its patience ends (time.monotonic()); 0: not decided yet
        self.last = 0.0  # past it, when it stops waiting for KV room elsewhere too

    def __lt__(self, other: Waiter) -> bool:
        return self.key < other.key

    @property
    def bound(self) -> bool:
        """Did dispatch give it a lease (its future holds one)?"""
        f = self.future
        return f.done() and not f.cancelled() and f.exception() is None


class ModelQueue:
    """The waiters for one model, best first."""

    __slots__ = ("_heap", "live", "patient")

    def __init__(self) -> None:
        self._heap: list[Waiter] = []
        self.live = 0  # waiters not gone
        self.patient: list[Waiter] = []  # set aside for the workers they want, best first

    def head(self) -> Waiter | None:
        """The next live waiter (gone ones are dropped on the way)."""
        heap = self._heap
        while heap and heap[0].gone:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def set_aside(self, waiter: Waiter) -> None:
        """Move the head, `waiter`, among the patient (it waits for `waiter.wants`)."""
        popped = heapq.heappop(self._heap)
        assert popped is waiter
        bisect.insort(self.patient, waiter)

    def back_in_line(self, waiter: Waiter) -> None:
        """A waiter set aside (no longer among `patient`) waits in line again."""
        heapq.heappush(self._heap, waiter)

    def __iter__(self) -> Iterator[Waiter]:
        return (w for w in sorted([*self._heap, *self.patient]) if not w.gone)


class Admission:
    """Every model's queue, the bounds, and the counters."""

    def __init__(self, max_queued: int, max_wait: float) -> None:
        self.max_queued = max_queued
        self.max_wait = max_wait
        self.queues: dict[str, ModelQueue] = {}
        self._arrivals = itertools.count()
        self.depth = 0
        self.admitted = 0
        self.rejected = 0
        self.timed_out = 0
        self.abandoned = 0
        self.wait_seconds = 0.0
        self.max_wait_seen = 0.0

    def to_json(self) -> dict[str, object]:
        """The queue now and its counters since start (the status page shows this)."""
        return {
            "depth": self.depth,
            "by_model": {model: q.live for model, q in sorted(self.queues.items())},
            "admitted": self.admitted,
            "rejected": self.rejected,
            "timed_out": self.timed_out,
            "abandoned": self.abandoned,
            "wait_seconds": round(self.wait_seconds, 6),
            "max_wait_seen": round(self.max_wait_seen, 6),
        }

    def waiting_for(self, model: str) -> int:
        """Requests queued for `model` now."""
        q = self.queues.get(model)
        return q.live if q is not None else 0

    def has_room(self, model: str) -> bool:
        return self.waiting_for(model) < self.max_queued

    def enqueue(self, info: RequestInfo, exclude: Sequence[Worker]) -> Waiter:
        """Put a request at its place in its model's queue (the caller checked the bound)."""
        q = self.queues.get(info.model)
        if q is None:
            q = self.queues[info.model] = ModelQueue()
        waiter = Waiter(info, exclude, (info.priority, next(self._arrivals)))
        heapq.heappush(q._heap, waiter)
        q.live += 1
        self.depth += 1
        return waiter

    def leave(self, waiter: Waiter, *, admitted: bool) -> None:
        """Take `waiter` out of its queue: it got a worker (`admitted`) or gave up."""
        if waiter.gone:
            return
        waiter.gone = True
        q = self.queues[waiter.info.model]
        q.live -= 1
        self.depth -= 1
        if q.live == 0:
            del self.queues[waiter.info.model]  # no idle queue per model name ever sent
        if admitted:
            waited = time.monotonic() - waiter.enqueued
            self.admitted += 1
            self.wait_seconds += waited
            if waited > self.max_wait_seen:
                self.max_wait_seen = waited

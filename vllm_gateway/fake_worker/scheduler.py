"""Continuous batching slots: at most `max_num_seqs` requests run, the rest wait FIFO.

A request runs once it has a slot and its claim on the KV cache succeeds (the claim
holds the blocks its prompt needs; prefix_cache.py). Like vLLM V1's scheduler, the
oldest waiting request goes first, and when its blocks do not fit nobody behind it is
admitted either (a short prompt does not overtake a long one): it waits until running
requests end and free their blocks.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from vllm_gateway.fake_worker.stats import FakeStats

T = TypeVar("T")


class _Waiter:
    __slots__ = ("claim", "future", "model")

    def __init__(
        self, future: asyncio.Future[object], model: str, claim: Callable[[bool], object | None]
    ) -> None:
        self.future, self.model, self.claim = future, model, claim


def _always(force: bool) -> bool:
    return True


def _nothing(held: bool) -> None:
    return None


class Scheduler:
    """Hands out running slots like vLLM's scheduler, and mirrors its counts into stats.

    A finished or aborted request hands its slot straight to the oldest waiter whose
    claim fits, so the running count never dips between two requests and FIFO order is
    exact.
    """

    def __init__(self, max_num_seqs: int, stats: FakeStats) -> None:
        self.max_num_seqs = max_num_seqs
        self._stats = stats
        self._running: Counter[str] = Counter()  # model name -> running requests
        self._waiting: deque[_Waiter] = deque()

    @property
    def running(self) -> int:
        return self._running.total()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def running_models(self) -> list[str]:
        return sorted(m for m, n in self._running.items() if n > 0)

    def waiting_models(self) -> list[str]:
        return sorted({w.model for w in self._waiting})

    @asynccontextmanager
    async def slot(self, model: str) -> AsyncIterator[None]:
        """Hold a running slot for the body of the `async with`; leaving frees it."""
        async with self.claimed(model, _always, _nothing):
            yield

    @asynccontextmanager
    async def claimed(
        self, model: str, claim: Callable[[bool], T | None], unclaim: Callable[[T], None]
    ) -> AsyncIterator[T]:
        """Hold a running slot and what `claim` took (it returns None when it does not fit;
        called with True when nothing else runs, so the request would wait for good) for
        the body of the `async with`; leaving frees the slot, the body releases the claim.
        `unclaim` gives back a claim granted to a request cancelled before it ran."""
        held = await self._acquire(model, claim, unclaim)
        try:
            yield held
        finally:
            self._release(model)

    async def _acquire(
        self, model: str, claim: Callable[[bool], T | None], unclaim: Callable[[T], None]
    ) -> T:
        if self.running < self.max_num_seqs and not self._waiting:
            held = claim(self.running == 0)
            if held is not None:
                self._running[model] += 1
                self._publish()
                return held
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(fut, model, claim)
        self._waiting.append(waiter)
        self._publish()
        try:
            return await fut  # type: ignore[return-value]  # what `claim` returned
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # Admitted just before the cancel landed: give back its claim and slot.
                unclaim(fut.result())  # type: ignore[arg-type]  # what `claim` returned
                self._release(model)
            else:
                if waiter in self._waiting:  # (`_grant` drops a cancelled head itself)
                    self._waiting.remove(waiter)
                self._grant()  # it may have been the head that did not fit
                self._publish()
            raise

    def _release(self, model: str) -> None:
        self._running[model] -= 1
        self._grant()
        self._publish()

    def _grant(self) -> None:
        """Admit waiters, oldest first, while a slot is free and the oldest's claim fits."""
        waiting = self._waiting
        while waiting and self.running < self.max_num_seqs:
            head = waiting[0]
            if head.future.done():  # cancelled, being removed
                waiting.popleft()
                continue
            held = head.claim(self.running == 0)
            if held is None:
                return  # its blocks do not fit: it waits, and so does everyone behind it
            waiting.popleft()
            self._running[head.model] += 1
            head.future.set_result(held)

    def _publish(self) -> None:
        stats = self._stats
        stats.running = self.running
        stats.waiting = len(self._waiting)
        stats.max_running_seen = max(stats.max_running_seen, stats.running)
        stats.max_waiting_seen = max(stats.max_waiting_seen, stats.waiting)

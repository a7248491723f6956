"""Continuous batching slots: at most `max_num_seqs` requests run, the rest wait FIFO."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from vllm_gateway.fake_worker.stats import FakeStats


class Scheduler:
    """Hands out running slots like vLLM's scheduler, and mirrors its counts into stats.

    A finished or aborted request hands its slot straight to the oldest waiter, so
    the running count never dips between two requests and FIFO order is exact.
    """

    def __init__(self, max_num_seqs: int, stats: FakeStats) -> None:
        self.max_num_seqs = max_num_seqs
        self._stats = stats
        self._running: Counter[str] = Counter()  # model name -> running requests
        self._waiting: deque[tuple[asyncio.Future[None], str]] = deque()

    @property
    def running(self) -> int:
        return self._running.total()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def running_models(self) -> list[str]:
        return sorted(m for m, n in self._running.items() if n > 0)

    def waiting_models(self) -> list[str]:
        return sorted({m for _, m in self._waiting})

    @asynccontextmanager
    async def slot(self, model: str) -> AsyncIterator[None]:
        """Hold a running slot for the body of the `async with`; leaving frees it."""
        await self._acquire(model)
        try:
            yield
        finally:
            self._release(model)

    async def _acquire(self, model: str) -> None:
        if self.running < self.max_num_seqs and not self._waiting:
            self._running[model] += 1
            self._publish()
            return
        entry = (asyncio.get_running_loop().create_future(), model)
        self._waiting.append(entry)
        self._publish()
        try:
            await entry[0]
        except asyncio.CancelledError:
            if entry[0].done() and not entry[0].cancelled():
                # The slot was handed over just before the cancel landed: pass it on.
                self._release(model)
            else:
                self._waiting.remove(entry)
                self._publish()
            raise

    def _release(self, model: str) -> None:
        self._running[model] -= 1
        while self._waiting:
            fut, next_model = self._waiting.popleft()
            if not fut.done():
                self._running[next_model] += 1
                fut.set_result(None)
                break
        self._publish()

    def _publish(self) -> None:
        stats = self._stats
        stats.running = self.running
        stats.waiting = len(self._waiting)
        stats.max_running_seen = max(stats.max_running_seen, stats.running)
        stats.max_waiting_seen = max(stats.max_waiting_seen, stats.waiting)

"""Prefill compute shared within one worker: prefills run one after another, FIFO.

A GPU has one pool of compute; vLLM's scheduler spends a step's token budget on the
prefills in arrival order, so a long uncached prompt delays the first token of every
request that arrives behind it. The fake models that with one lane per worker: each
request holds the lane for `uncached_tokens x ms_per_token`, in arrival order. Decode
steps are not slowed by prefills (vLLM's chunked prefill would slow them a little).

With a cost of 0 per token (the default), nobody waits for the lane.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class PrefillLane:
    """One worker's prefill compute: a FIFO lock held for the prefill's duration.

        async with lane.turn():                 # wait for the lane (FIFO)
            cache.refresh(seq)                  # the prefix cache, looked up again now
            await lane.compute(seq.uncached_tokens)

    The prompt's blocks are claimed when it is admitted to the batch (scheduler.py), and
    looked up again when its prefill starts: one queued behind the prefill of the same
    prefix finds it cached.
    """

    def __init__(self, ms_per_token: float) -> None:
        self.seconds_per_token = ms_per_token / 1000
        # asyncio.Lock wakes waiters in FIFO order, and a cancelled waiter (a client that
        # went away) leaves the line without holding up the ones behind it.
        self._lock = asyncio.Lock()
        self.busy_seconds = 0.0  # prefill time spent, since start

    def cost(self, uncached_tokens: int) -> float:
        """Seconds of compute to prefill this many tokens."""
        return uncached_tokens * self.seconds_per_token

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold the lane (nobody waits when prefill costs nothing)."""
        if self.seconds_per_token <= 0:
            yield
            return
        async with self._lock:
            yield

    async def compute(self, uncached_tokens: int) -> None:
        """Prefill this many tokens, holding the lane (inside `turn()`)."""
        seconds = self.cost(uncached_tokens)
        if seconds > 0:
            await asyncio.sleep(seconds)
            self.busy_seconds += seconds

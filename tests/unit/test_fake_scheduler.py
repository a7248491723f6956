"""The fake worker's scheduler with claims on its KV cache, without sockets: who runs,
who waits, and what a cancelled request gives back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from vllm_gateway.fake_worker.scheduler import Scheduler
from vllm_gateway.fake_worker.stats import FakeStats


class Blocks:
    """A pool of `size` blocks: a claim takes `n` of them when they fit (or when forced)."""

    def __init__(self, size: int) -> None:
        self.size, self.used = size, 0

    def claim(self, n: int) -> Callable[[bool], int | None]:
        def take(force: bool) -> int | None:
            if not force and self.used + n > self.size:
                return None
            self.used += n
            return n

        return take

    def give(self, n: int) -> None:
        self.used -= n


async def hold(s: Scheduler, pool: Blocks, n: int, ran: list[int], until: asyncio.Event) -> None:
    """Run with `n` blocks until `until` is set, noting the order requests started in."""
    async with s.claimed("m", pool.claim(n), pool.give) as held:
        ran.append(n)
        try:
            await until.wait()
        finally:
            pool.give(held)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_nobody_overtakes_a_request_whose_blocks_do_not_fit() -> None:
    stats = FakeStats()
    s, pool = Scheduler(8, stats), Blocks(10)
    ran: list[int] = []
    first, second, rest = asyncio.Event(), asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(hold(s, pool, 6, ran, first))]
    tasks.append(asyncio.create_task(hold(s, pool, 2, ran, second)))
    await settle()
    tasks.append(asyncio.create_task(hold(s, pool, 5, ran, rest)))  # 13 of 10: waits
    await settle()
    tasks.append(asyncio.create_task(hold(s, pool, 1, ran, rest)))  # behind it
    await settle()
    assert ran == [6, 2] and (stats.running, stats.waiting) == (2, 2)
    second.set()  # 6 used: the 1 would fit now, but the 5 at the head does not
    await settle()
    assert ran == [6, 2] and (stats.running, stats.waiting) == (1, 2)
    first.set()
    await settle()
    assert ran == [6, 2, 5, 1] and (stats.running, stats.waiting) == (2, 0)
    rest.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert pool.used == 0 and stats.running == 0


async def test_a_prompt_larger_than_the_cache_runs_once_nothing_else_does() -> None:
    stats = FakeStats()
    s, pool = Scheduler(8, stats), Blocks(10)
    ran: list[int] = []
    first, done = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(hold(s, pool, 3, ran, first))]
    await settle()
    tasks.append(asyncio.create_task(hold(s, pool, 50, ran, done)))  # never fits
    await settle()
    assert ran == [3]
    first.set()  # now nothing runs: it is forced through, past the capacity
    await settle()
    assert ran == [3, 50] and pool.used == 50
    done.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert pool.used == 0


async def test_a_cancelled_waiter_gives_back_its_place_and_its_grant() -> None:
    stats = FakeStats()
    s, pool = Scheduler(8, stats), Blocks(10)
    ran: list[int] = []
    first, rest = asyncio.Event(), asyncio.Event()
    runner = asyncio.create_task(hold(s, pool, 6, ran, first))
    await settle()
    head = asyncio.create_task(hold(s, pool, 5, ran, rest))  # waits for blocks
    await settle()
    behind = asyncio.create_task(hold(s, pool, 1, ran, rest))
    await settle()
    head.cancel()  # the head leaves: the one behind it fits, and runs at once
    await settle()
    assert ran == [6, 1] and stats.waiting == 0
    # Granted, then cancelled before it ran: its blocks and its slot come back.
    late = asyncio.create_task(hold(s, pool, 4, ran, rest))
    await settle()
    assert stats.waiting == 1  # 6 + 1 + 4 > 10
    first.set()
    await asyncio.sleep(0)  # `runner` ends and grants `late`, which has not run yet
    late.cancel()
    await settle()
    assert late.cancelled() and ran == [6, 1] and pool.used == 1
    assert (stats.running, stats.waiting) == (1, 0)
    rest.set()
    await asyncio.wait_for(asyncio.gather(runner, behind, return_exceptions=True), 5)
    assert pool.used == 0 and stats.running == 0

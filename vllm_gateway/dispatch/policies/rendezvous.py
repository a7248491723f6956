"""Weighted rendezvous hashing: each key's own order of the workers, the same in every
process and replica (cache_aware keys conversations and preambles on it)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

from vllm_gateway.workers import Worker

# Keys whose ranks `Ranks` keeps (then it starts over): preambles are few.
MAX_KEYS = 4096

_M64 = (1 << 64) - 1


def rendezvous_rank(key: int, worker: Worker, seed: int) -> float:
    """Lower first: weighted rendezvous (-ln u / weight), `u` in (0, 1) from (key, seed).

    Integer arithmetic (a splitmix64-style finalizer of key ^ seed), the same in every
    process; Python's hash() of a tuple of ints would be too, but orders workers unevenly.
    """
    weight = worker.weight
    if weight <= 0:
        return math.inf
    x = ((key ^ seed) * 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & _M64
    u = ((x >> 11) + 0.5) / (1 << 53)
    return -math.log(u) / weight


class Ranks:
    """Rendezvous ranks with each worker's seed (the CRC of its URL) kept, and the ranks of
    a few keys (preambles) cached, per URL."""

    __slots__ = ("_cached", "seeds")

    def __init__(self) -> None:
        self.seeds: dict[str, int] = {}  # worker URL -> its rendezvous seed
        self._cached: dict[int, dict[str, float]] = {}  # key -> URL -> rank

    def seed(self, worker: Worker) -> int:
        seed = self.seeds.get(worker.url)
        if seed is None:
            seed = self.seeds[worker.url] = zlib.crc32(worker.url.encode())
        return seed

    def rank(self, key: int, worker: Worker) -> float:
        return rendezvous_rank(key, worker, self.seed(worker))

    def cached(self, key: int, workers: Sequence[Worker]) -> list[float]:
        """The workers' ranks for `key`, kept for the next time."""
        ranks = self._cached.get(key)
        if ranks is None:
            if len(self._cached) >= MAX_KEYS:
                self._cached.clear()
            ranks = self._cached[key] = {}
        out = []
        for w in workers:
            r = ranks.get(w.url)
            if r is None:
                r = ranks[w.url] = self.rank(key, w)
            out.append(r)
        return out

    def forget_missing(self, urls: set[str]) -> None:
        """Forget the workers whose URLs are not in `urls` (and every cached rank, if any)."""
        gone = [u for u in self.seeds if u not in urls]
        for url in gone:
            del self.seeds[url]
        if gone:
            self._cached.clear()

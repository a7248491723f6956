"""Weighted rendezvous hashing: each key's own order of the workers, the same in every
process and replica (cache_aware keys conversations and preambles on it)."""

from __future__ import annotations

import math

from vllm_gateway.workers import Worker

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

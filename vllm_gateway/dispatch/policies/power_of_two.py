"""power_of_two: two candidates drawn at random, the less loaded one wins.

The classic "power of two choices": nearly as even as scanning every worker, and it never
sends a burst to the same single least-loaded worker. Load is the load view (load.py)
per unit of weight.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.load import load
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker


def _score(worker: Worker) -> float:
    return load(worker) / worker.weight if worker.weight > 0 else float("inf")


class PowerOfTwo:
    """Of two distinct random candidates, the one with less load per weight."""

    name = "power_of_two"
    load_aware = True

    def __init__(self, rng: random.Random, config: DispatchConfig | None = None) -> None:
        self._rng = rng

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        n = len(candidates)
        if n <= 1:
            return candidates[0] if candidates else None
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        j += j >= i  # a second, different index
        a, b = candidates[i], candidates[j]
        return b if _score(b) < _score(a) else a

"""random: a random candidate, in proportion to its configured weight.

Load-blind like round_robin. FastChat's `lottery` (a random worker weighted by its speed)
is accepted as an alias; here the weight is the operator's `weight`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker


class RandomChoice:
    """Picks at random, weighted by `Worker.weight` (uniform when the weights are equal)."""

    name = "random"
    load_aware = False

    def __init__(self, rng: random.Random, config: DispatchConfig | None = None) -> None:
        self._rng = rng

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        if not candidates:
            return None
        first = candidates[0].weight
        if all(w.weight == first for w in candidates):
            return candidates[self._rng.randrange(len(candidates))]
        total = sum(w.weight for w in candidates)
        if total <= 0:
            return candidates[self._rng.randrange(len(candidates))]
        x = self._rng.random() * total
        for w in candidates:
            x -= w.weight
            if x < 0:
                return w
        return candidates[-1]

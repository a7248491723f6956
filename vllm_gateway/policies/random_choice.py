"""random: a uniformly random candidate."""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_gateway.request_info import RequestInfo
from vllm_gateway.workers import Worker


class RandomChoice:
    """Picks uniformly at random."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        if not candidates:
            return None
        return candidates[self._rng.randrange(len(candidates))]

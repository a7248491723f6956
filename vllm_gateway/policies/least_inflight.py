"""least_inflight: the candidate with the fewest requests the gateway has in flight to it."""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_gateway.request_info import RequestInfo
from vllm_gateway.workers import Worker


class LeastInflight:
    """Fewest in-flight requests per unit of weight; ties broken at random."""

    name = "least_inflight"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        best: list[Worker] = []
        best_score = float("inf")
        for w in candidates:
            score = w.inflight / w.weight if w.weight > 0 else float("inf")
            if score < best_score:
                best, best_score = [w], score
            elif score == best_score:
                best.append(w)
        if not best:
            return None
        return best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]

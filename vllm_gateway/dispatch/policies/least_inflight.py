"""least_inflight: the candidate with the fewest requests the gateway has in flight to it.

Uses only the gateway's own counts (no scrape), per unit of configured weight.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.policies.base import pick_lowest
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker

INF = float("inf")


class LeastInflight:
    """Fewest in-flight requests per unit of weight; ties broken at random."""

    name = "least_inflight"
    load_aware = True

    def __init__(self, rng: random.Random, config: DispatchConfig | None = None) -> None:
        self._rng = rng

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        scores = [w.inflight / w.weight if w.weight > 0 else INF for w in candidates]
        return pick_lowest(candidates, scores, self._rng)

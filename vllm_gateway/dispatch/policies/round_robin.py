"""round_robin: each candidate in turn, whatever its load (the baseline to beat).

Load-blind: it ignores the token buckets and every load signal, as a plain HTTP load
balancer would; it only skips workers that are not available.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker


class RoundRobin:
    """Cycles through the candidates; the counter is shared across models."""

    name = "round_robin"
    load_aware = False

    def __init__(self, rng: random.Random, config: DispatchConfig | None = None) -> None:
        self._next = rng.randrange(1 << 16)  # start anywhere, so replicas do not march in step

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        if not candidates:
            return None
        self._next += 1
        return candidates[self._next % len(candidates)]

"""queue (the default): the candidate with the least expected wait.

Expected wait is the worker's load (load.py: reported running + waiting, corrected by what
the gateway sent and saw finish since) plus this request, divided by how fast the worker
gets through requests: its learned pace (1 / typical request duration; dispatch learns it
from completed leases) times its configured weight. This is "shortest expected delay"
routing: a worker twice as fast may hold twice the requests for the same expected wait.

A worker with no pace yet (no completion seen) is scored with the best pace among the
candidates, so a new worker gets traffic and is measured rather than starved.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.load import load
from vllm_gateway.dispatch.policies.base import pick_lowest
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker

INF = float("inf")


def expected_wait(worker: Worker, default_pace: float) -> float:
    """(load + 1) / (pace x weight): lower is better; infinite for weight 0."""
    rate = (worker.pace or default_pace) * worker.weight
    return (load(worker) + 1.0) / rate if rate > 0 else INF


class QueuePolicy:
    """Least (load + 1) / (pace x weight); ties at random."""

    name = "queue"
    load_aware = True

    def __init__(self, rng: random.Random, config: DispatchConfig | None = None) -> None:
        self._rng = rng

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        default_pace = max(w.pace for w in candidates) or 1.0
        scores = [expected_wait(w, default_pace) for w in candidates]
        return pick_lowest(candidates, scores, self._rng)

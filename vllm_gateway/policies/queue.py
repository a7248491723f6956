"""queue (the default): the candidate with the least expected wait.

A worker's load is what it last reported (vLLM's running + waiting) plus what the gateway
sent it since that report, never less than the gateway's own in-flight count; divided by
its weight. Ties are broken at random so a burst does not herd onto one worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_gateway.request_info import RequestInfo
from vllm_gateway.workers import Worker


def load(worker: Worker) -> float:
    """Requests queued or running on `worker`, as best the gateway knows right now."""
    stats = worker.stats
    if stats is None:
        return worker.inflight
    reported = stats.running + stats.waiting + worker.sent_since_scrape
    return max(reported, worker.inflight)


class QueuePolicy:
    """Least (load + 1) / weight; ties at random."""

    name = "queue"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        best: list[Worker] = []
        best_score = float("inf")
        for w in candidates:
            score = (load(w) + 1) / w.weight if w.weight > 0 else float("inf")
            if score < best_score:
                best, best_score = [w], score
            elif score == best_score:
                best.append(w)
        if not best:
            return None
        return best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]

"""Demand: how much work each model has now, and how many workers it should have (pure).

    demand  = sum over the model's workers of their load (load.py: what vLLM reported
              running + waiting, corrected by what the gateway sent and saw finish since,
              never less than the gateway's own in-flight count), times the model's share
              of it (Worker.share_of: the model's part of the worker's in-flight requests,
              counted by each lease's model; so a worker serving two models does not count
              one model's requests under both)
            + requests queued for the model in the gateway's admission queue
    desired = ceil(demand / target_per_worker), within [min_workers, max_workers]

with hysteresis, so a demand hovering at a boundary does not add and remove a worker in
turn: a worker is added as soon as the demand exceeds what the current workers carry at
the target, but taken away only when the demand fits on one fewer worker at
`scale_down_below` of the target. A request that has waited `queue_wait_up` seconds in the
admission queue asks for one more worker whatever the counts say (the workers are slower
than their numbers suggest). The time-based parts (a window over past desired counts,
cooldown) belong to the autoscaler; this module is arithmetic, testable with tables.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_gateway.dispatch.load import load
from vllm_gateway.workers import Worker, WorkerState

# A worker counts as capacity when it serves now or will soon (still loading).
COUNTED = frozenset({WorkerState.READY, WorkerState.JOINING})
# No model is ever asked more workers than this: a ratio beyond it (a tiny target, a huge
# demand) is capped before `ceil`, which raises OverflowError on an infinite float.
MAX_DESIRED = 1_000_000


def _ceil(ratio: float) -> int:
    """ceil(ratio) within [0, MAX_DESIRED], a hair's tolerance below whole numbers."""
    if not ratio > 0:  # also NaN
        return 0
    return math.ceil(min(ratio, MAX_DESIRED) - 1e-9)


@dataclass(slots=True)
class ModelDemand:
    """One model's demand and desired worker count, as of one evaluation."""

    model: str
    workers: int = 0  # ready or joining workers serving the model
    ready: int = 0
    inflight: int = 0  # requests for the model the gateway has in flight on them
    running: float = 0.0  # the workers last reported (vllm:num_requests_running), its share
    waiting: float = 0.0  # the workers last reported (vllm:num_requests_waiting), its share
    queued: int = 0  # waiting in the gateway's admission queue
    queue_wait: float = 0.0  # seconds the oldest queued request has waited
    demand: float = 0.0
    desired: int = 0  # what this evaluation asks for (before the autoscaler's window)

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "workers": self.workers,
            "ready": self.ready,
            "inflight": self.inflight,
            "running": self.running,
            "waiting": self.waiting,
            "queued": self.queued,
            "queue_wait_seconds": round(self.queue_wait, 3),
            "demand": round(self.demand, 2),
            "desired": self.desired,
        }


def measure(
    model: str, workers: Iterable[Worker], queued: int = 0, queue_wait: float = 0.0
) -> ModelDemand:
    """Add up the model's load from its workers and its admission queue."""
    d = ModelDemand(model, queued=queued, queue_wait=queue_wait)
    total = 0.0
    for w in workers:
        inflight = w.inflight_for(model)
        if w.state not in COUNTED:
            if inflight:  # a draining worker's requests are still demand being served
                total += inflight
                d.inflight += inflight
            continue
        d.workers += 1
        d.ready += w.state is WorkerState.READY
        d.inflight += inflight
        share = w.share_of(model)
        if w.stats is not None:
            d.running += w.stats.running * share
            d.waiting += w.stats.waiting * share
        total += load(w) * share
    d.demand = total + queued
    return d


def desired_workers(
    demand: float,
    current: int,
    *,
    target: float,
    down_fraction: float,
    minimum: int,
    maximum: int | None,
    queue_wait: float = 0.0,
    queue_wait_up: float = 0.0,
) -> int:
    """Workers the model should have, given `current` (with hysteresis; see above)."""
    up = _ceil(demand / target)
    # Down only as far as the demand stays under down_fraction of the target.
    down = min(current, _ceil(demand / (target * down_fraction)))
    want = up if up > current else down
    if queue_wait_up and queue_wait >= queue_wait_up:
        want = max(want, current + 1)
    if demand > 0:
        want = max(want, 1)
    want = max(want, minimum)
    return want if maximum is None else min(want, maximum)

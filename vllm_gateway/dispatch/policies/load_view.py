"""One request's candidates with their loads and speeds: who fits one more (cache_aware)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from vllm_gateway.dispatch.buckets import PROBE_START
from vllm_gateway.dispatch.load import load
from vllm_gateway.workers import Worker


class LoadView:
    """The candidates of one request with their loads and speeds: who fits one more."""

    __slots__ = (
        "candidates",
        "congested",
        "least",
        "loads",
        "owed",
        "per_speed",
        "speeds",
        "stretched",
    )

    @classmethod
    def of(cls, candidates: Sequence[Worker]) -> LoadView | None:
        """The view of `candidates`, in one pass (this runs for every request, 64 workers
        or more); None when their speeds sum to nothing finite (all of weight 0)."""
        loads = []
        speeds = []
        best_pace = 0.0
        owed = 0  # the largest prefill backlog (Worker.backlog), and the least
        least = math.inf
        for w in candidates:
            loads.append(load(w))
            pace = w.pace
            if pace > best_pace:
                best_pace = pace
            speeds.append(pace * w.weight)
            backlog = w.backlog
            if backlog > owed:
                owed = backlog
            if backlog < least:
                least = backlog
        if 0.0 in speeds:  # a worker without a pace yet counts with the best one
            best_pace = best_pace or 1.0
            speeds = [(w.pace or best_pace) * w.weight for w in candidates]
        total_speed = sum(speeds)
        if not 0 < total_speed < math.inf:
            return None
        # The fair load per unit of speed (this request included): a worker's limit is its
        # fair share plus (bound - 1) x that share, or x its capacity when the fleet is
        # lightly loaded (a few requests over an even split matter nothing to a worker
        # with room for many; they matter once it nears its capacity). History gets twice
        # the slack.
        view = cls(candidates, loads, speeds, (sum(loads) + 1.0) / total_speed)
        view.owed, view.least = owed, least
        return view

    def __init__(
        self, candidates: Sequence[Worker], loads: list[float], speeds: list[float], per: float
    ) -> None:
        self.candidates = candidates
        self.loads = loads
        self.speeds = speeds
        self.per_speed = per  # the fair load per unit of speed, this request included
        self.owed = 0  # the largest and the least prefill backlog of the candidates
        self.least = 0.0
        # Indexes of the candidates whose prefill backlog rules them out (backlog.py).
        self.congested: set[int] | None = None
        # The candidates the gate would let past their probing limit as this request's
        # probe (its `RequestInfo.stretched`): each has a batch slot it may take.
        self.stretched: Sequence[Worker] = ()

    def fits(self, j: int, extra: float) -> bool:
        """Whether candidate `j` takes one more within its limit,
        `load + 1 <= ceil(fair + extra x max(fair, capacity))` (never when not finite)."""
        w = self.candidates[j]
        fair = self.per_speed * self.speeds[j]
        # Unknown capacity: what the capacity gate itself assumes a worker runs at once.
        capacity = w.capacity or w.max_num_seqs or PROBE_START
        try:
            return self.loads[j] + 1.0 <= math.ceil(
                fair + extra * (capacity if capacity > fair else fair)
            )
        except (OverflowError, ValueError):  # inf or NaN from a nonsense figure somewhere
            return False

    def has_room(self, j: int) -> bool:
        """Whether candidate `j` has a batch slot free by the capacity gate's own measure:
        the gateway's in-flight requests to it, and what other senders had on it at its
        last scrape (`Worker.others`), below the capacity the gate knows (configured,
        learned or its probing limit), or none in flight (as the gate: `Buckets.is_full`);
        False while none is known. A candidate on the request path has one: the gate let
        it through, or would let this request past its probing limit as the probe
        (`stretched`); FastChat's /get_worker_address may offer full workers too."""
        w = self.candidates[j]
        if w in self.stretched:
            return True
        capacity = w.max_num_seqs or w.capacity
        inflight = w.inflight
        return bool(capacity) and (inflight == 0 or inflight + w.others < capacity)

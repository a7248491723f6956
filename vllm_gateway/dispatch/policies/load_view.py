"""One request's candidates with their loads and speeds: who fits one more (cache_aware).

The load bound (`fits`), per worker: `load + 1 <= ceil(fair + (load_bound - 1) x max(fair,
capacity))`, where `fair` is its share of the total load (this request included) in
proportion to its speed, pace x weight (pace: requests finished per second per running
request, learned; a worker without one yet counts with the best pace), `capacity` what
it runs at once (buckets.py; while unknown, `PROBE_START`, what the gate assumes) and
load the load view (load.py). Near capacity this is the classic bound (`load_bound` x
fair); lightly loaded, a worker may run a quarter of its capacity (for the default 1.25)
above an even split before it sheds new conversations, since a few requests more matter
nothing to a worker with room for many. A worker twice as fast may hold twice the
requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from vllm_gateway.dispatch.buckets import PROBE_START
from vllm_gateway.dispatch.load import load
from vllm_gateway.workers import Worker


class LoadView:
    """The candidates of one request with their loads and speeds: who fits one more. It
    also keeps their least and largest prefill backlog and their fewest free KV tokens."""

    __slots__ = (
        "candidates",
        "congested",
        "kv_least",
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
        loads: list[float] = []
        speeds: list[float] = []
        best_pace = 0.0
        owed = 0.0  # the largest prefill backlog (Worker.backlog), and the least
        least = kv_least = math.inf  # and the fewest free KV tokens (Worker.kv_free)
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
            if w.kv_free < kv_least:
                kv_least = w.kv_free
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
        return cls(
            candidates, loads, speeds, (sum(loads) + 1.0) / total_speed, owed, least, kv_least
        )

    def __init__(
        self,
        candidates: Sequence[Worker],
        loads: list[float],
        speeds: list[float],
        per: float,
        owed: float,
        least: float,
        kv_least: float,
    ) -> None:
        self.candidates = candidates
        self.loads = loads
        self.speeds = speeds
        self.per_speed = per  # the fair load per unit of speed, this request included
        self.owed = owed  # the largest and the least prefill backlog of the candidates
        self.least = least
        self.kv_least = kv_least  # the fewest free KV tokens of the candidates (Worker.kv_free)
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

    def least_loaded_with_room(
        self, among: Sequence[int], rank: Callable[[Worker], float]
    ) -> Worker | None:
        """Of the candidates at indexes `among`, the least loaded per unit of speed with a
        batch slot free (`has_room`), not congested, ties by `rank` (lower first); None
        when none has room. cache_aware sends a later turn whose holders are all past the
        history bound there: it prefills only what it adds, where anywhere else it would
        prefill its whole history again."""
        best: Worker | None = None
        best_at = (math.inf, math.inf)
        congested = self.congested or ()
        for j in among:
            speed = self.speeds[j]
            if speed > 0 and self.has_room(j) and j not in congested:
                w = self.candidates[j]
                at = (self.loads[j] / speed, rank(w))
                if at < best_at:
                    best, best_at = w, at
        return best

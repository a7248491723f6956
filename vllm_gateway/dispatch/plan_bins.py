"""The preamble plan's slots per worker, and the dealing of preambles into them.

    bins = Bins(slots, weights)     each worker's room: its part of `slots` by weight
    bins.take(ranks, had)           the least planned worker with room for one preamble
    bins.make_way(ranks, taken, i)  another preamble moves so preamble i gets a worker

preamble_plan.py deals the popular preambles in rounds through these (`PreamblePlan`).
Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Set


class Bins:
    """How many preambles each worker is planned at most (past it only to spill, `take`),
    and so far: the slots all of them need (their wants summed), shared out by weight
    (`PreamblePlan._slot_weights`: the worker's weight x its KV cache; rounded up, at least
    one for a weight > 0), so each worker caches about its part of
    the popular preambles and none caches two while another has none. Counted in
    preambles, not in their exact shares: measured shares wander, and a plan that
    followed them would move preambles (each move a prefill) for nothing; the load bound
    at dispatch keeps the traffic in check. A worker of weight 0 takes none."""

    def __init__(self, slots: int, weights: list[float]) -> None:
        weights = [x if x > 0 and math.isfinite(x) else 0.0 for x in weights]
        top = max(weights, default=0.0)
        # Relative to the largest (a sum of huge weights would overflow; a tiny one may
        # then read 0, but its worker still gets its one slot below).
        parts = [x / top for x in weights] if top > 0 else weights
        total = sum(parts)
        # At least one for any weight > 0: a worker counted in a preamble's want may take it.
        self.room = [
            max(1, math.ceil(slots * y / total - 1e-9)) if x > 0 else 0
            for x, y in zip(weights, parts, strict=True)
        ]
        self.used = [0] * len(weights)

    def take(self, ranks: list[float], had: Set[int], spill: bool = False) -> list[int]:
        """[the least planned worker with room (for its part: planned / room), by rank
        among equals (the first of the preamble's own order), other than those it `had`]
        (empty: none); `spill`: any of weight > 0, room or not. It is planned one more
        preamble."""
        room, used = self.room, self.used
        free = [j for j in range(len(room))
                if (used[j] < room[j] or (spill and room[j] > 0)) and j not in had]  # fmt: skip
        if not free:
            return []
        j = min(free, key=lambda j: (used[j] / room[j], ranks[j]))
        used[j] += 1
        return [j]

    def make_way(self, ranks: list[list[float]], taken: list[set[int]], i: int) -> list[int]:
        """[a full worker preamble `i` lacks (the least planned first, by its rank)], freed
        for it by another preamble that moves from there to the least planned worker with
        room it lacks (by its own rank); empty when no such move exists. `ranks` and
        `taken`: every preamble's, by index."""
        room, used = self.room, self.used
        mine = taken[i]
        # (Every worker it lacks is full, or `take` would have found it: those with room
        # are among its own, a few.)
        roomy = [z for z in range(len(room)) if used[z] < room[z]]
        full = sorted((x for x in range(len(room)) if room[x] > 0 and x not in mine),
                      key=lambda x: (used[x] / room[x], ranks[i][x]))  # fmt: skip
        for x in full:
            for q, has in enumerate(taken):
                if q == i or x not in has:
                    continue
                free = [z for z in roomy if z not in has]
                if free:
                    z = min(free, key=lambda z: (used[z] / room[z], ranks[q][z]))
                    has.discard(x)
                    has.add(z)
                    used[z] += 1
                    return [x]  # (x stays as used: it is preamble i's now)
        return []

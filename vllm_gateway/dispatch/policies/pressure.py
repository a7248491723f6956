"""Cache pressure in cache_aware's choice: a candidate's rendezvous rank weighed by it.

    weighed_rank(worker, rank) -> float | None   (None: this choice is not weighed)

`Worker.pressure` (workers.py `note_cache`) is the share of its KV cache a worker
overwrites per second, from its own prefix-cache counters. Under a shared preamble,
cache_aware multiplies each candidate's rank by it squared, so a new history goes where
the cache keeps it longest (docs/dispatch.md "Cache pressure"). Not in a choice where a
candidate reports none (the others' figures would not compare with it), nor where one
ran another sender's requests lately: behind replicas a conversation's next turn may
reach one that never saw it, which takes the plain order, the same in every replica,
where a weight read seconds later from its own scrapes would move the home. Pure.
"""

from __future__ import annotations

import math

from vllm_gateway.workers import Worker

# A worker that showed another sender's request (`Worker.others`) within this many seconds
# of its last scrape is shared. Other replicas at light load leave a worker's page without
# their requests for seconds at a time; a minute covers that, and a gateway left alone
# weighs again a minute later.
SHARED_SECONDS = 60.0


def weighed_rank(worker: Worker, rank: float) -> float | None:
    """`rank` times the worker's cache pressure squared: of two workers, one whose cache
    turns over twice as fast is weighed a quarter of the other (0.2 of the choices against
    0.8). None when the choice may not be weighed (shared, or no pressure reported); a
    worker of weight 0 (rank inf) reporting none does not stop it (shared, it does)."""
    stats = worker.stats
    if stats is not None and stats.at - worker.others_at < SHARED_SECONDS:
        return None
    p = worker.pressure
    if p:
        return rank * p * p
    return None if worker.weight > 0 else math.inf

"""Rendezvous hashing with bounded load: the shared core of the session and prefix policies.

Each worker gets a score for the key, `-ln(u) / weight` with `u` a stable hash of
(key, worker URL) in (0, 1): the lowest score wins (weighted rendezvous hashing). A key
keeps its worker while the fleet changes, and only the keys of a removed worker move.
The hash is blake2b, not Python's `hash()`, so every gateway process agrees.

Bounded load (Mirrokni et al., "Consistent Hashing with Bounded Loads"): a worker takes the
key only while its load is under `bound` x the fleet's average load (per unit of weight),
counting this request; otherwise the next worker in the key's order does. So a hot key
spills over to its second choice instead of sinking one worker.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from vllm_gateway.dispatch.load import load
from vllm_gateway.workers import Worker

_SCALE = float(1 << 64)


def _score(key: bytes, worker: Worker) -> float:
    if worker.weight <= 0:
        return math.inf
    digest = hashlib.blake2b(key + worker.url.encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 0.5) / _SCALE  # in (0, 1), never 0
    return -math.log(u) / worker.weight


def ranked(key: str, candidates: Sequence[Worker]) -> list[Worker]:
    """The candidates in the key's order of preference (first: its home worker)."""
    k = key.encode() + b"\x00"
    return sorted(candidates, key=lambda w: _score(k, w))


def pick_bounded(key: str, candidates: Sequence[Worker], bound: float) -> Worker | None:
    """The first worker in the key's order whose load stays within the bound."""
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    loads = {w: load(w) for w in candidates}
    top = max(w.weight for w in candidates)
    if not 0 < top < math.inf:
        return ranked(key, candidates)[0]
    # Weights relative to the largest: their sum is at least 1, so tiny weights (1e-310)
    # cannot make the load per unit of weight infinite.
    total = sum(w.weight for w in candidates if w.weight > 0) / top
    per_share = bound * (sum(loads.values()) + 1.0) / total
    order = ranked(key, candidates)
    for w in order:
        if w.weight > 0 and loads[w] + 1.0 <= math.ceil(per_share * (w.weight / top)):
            return w
    return order[0]

"""The seam every dispatch policy implements: pick one worker among the candidates.

A policy is pure: no I/O, no clock, no aiohttp. It gets the candidates and the request's
`RequestInfo`, and returns one of them (None only when given none). Randomness comes from
the injected `random.Random`, so tests can script it; tunables come from `DispatchConfig`.

Candidates are the available workers (`Worker.available`) that serve the model and were
not already tried for this request. For a load-aware policy (`load_aware = True`) they are
also the ones whose token bucket has a token: the buckets decide *whether* a worker may
take more, the policy *which* of those takes this request. Load-blind policies
(`round_robin`, `random`: the baselines) ignore the buckets and choose among every
available worker.

A load-aware policy may also define `preferred(gated, candidates, info) -> list[Worker]`:
of the workers the gate left out, those the request would rather have had than any
candidate (cache_aware: holders of its history or its preamble). Only their capacity is
probed upward when the request goes elsewhere (buckets.py); a policy without the hook
has every gated worker probed then. And `stretches(info) -> bool`: whether those held back
only by a guessed limit (the probing limit) take this request themselves, as the probe
(`Buckets.stretch`), rather than it going elsewhere (cache_aware: for a later turn).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker


class Policy(Protocol):
    """Picks a worker for a request."""

    name: str
    load_aware: bool

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None: ...


PolicyFactory = Callable[[random.Random, DispatchConfig], Policy]


def pick_lowest(
    candidates: Sequence[Worker], scores: Sequence[float], rng: random.Random
) -> Worker | None:
    """The candidate with the lowest score; ties broken at random (no herd on the first)."""
    best: Worker | None = None
    best_score = float("inf")
    ties = 0
    for w, score in zip(candidates, scores, strict=True):
        if score < best_score:
            best, best_score, ties = w, score, 1
        elif score == best_score and best is not None:
            ties += 1
            # Reservoir sampling: each of the tied candidates wins with probability 1/ties.
            if rng.randrange(ties) == 0:
                best = w
    if best is None and candidates:
        return candidates[0]  # every score infinite (e.g. all weights 0): still answer
    return best

"""The seam every dispatch policy implements: pick one worker among those with room.

A policy is pure: no I/O, no clock, no aiohttp. It gets the candidates (ready workers that
serve the model, have a token and were not already tried for this request) and the
request's `RequestInfo`, and returns one of them or None (None: wait for a better moment).
Randomness comes from the injected `random.Random`, so tests can script it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from vllm_gateway.request_info import RequestInfo
from vllm_gateway.workers import Worker


class Policy(Protocol):
    """Picks a worker for a request."""

    name: str

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None: ...


PolicyFactory = Callable[[random.Random], Policy]

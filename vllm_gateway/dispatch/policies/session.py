"""session: the requests of one session stay on one worker, within a bound on its load.

The key is the `X-Session-ID` (or `X-User-ID`) header, else the body's `user`
(RequestInfo.session_key). Rendezvous hashing with bounded load (affinity.py): a hot
session spills to its next worker instead of sinking one. Requests without a key go to
the least expected wait, as with the `queue` policy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.policies.affinity import pick_bounded
from vllm_gateway.dispatch.policies.queue import QueuePolicy
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker


class SessionAffinity:
    """Rendezvous on the session key, bounded load; no key: the queue policy."""

    name = "session"
    load_aware = True

    def __init__(self, rng: random.Random, config: DispatchConfig | None = None) -> None:
        self._bound = (config or DispatchConfig()).load_bound
        self._fallback = QueuePolicy(rng)

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        key = info.session_key
        if not key:
            return self._fallback.select(candidates, info)
        return pick_bounded(key, candidates, self._bound)

"""prefix: requests that start alike go to the same worker, to reuse its prefix cache.

The key is the first `dispatch.prefix_chars` characters of the prompt, or of the chat
messages (role and content) in order (RequestInfo.prefix_text), so a shared system prompt
and conversation history land where vLLM already holds their KV cache. Rendezvous hashing
with bounded load (affinity.py) keeps a popular prefix from sinking one worker. Requests
with no text (e.g. token-id prompts) go to the least expected wait, as with `queue`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.policies.affinity import pick_bounded
from vllm_gateway.dispatch.policies.queue import QueuePolicy
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker


class PrefixAffinity:
    """Rendezvous on the prompt's leading characters, bounded load; no text: queue."""

    name = "prefix"
    load_aware = True

    def __init__(self, rng: random.Random, config: DispatchConfig | None = None) -> None:
        config = config or DispatchConfig()
        self._bound = config.load_bound
        self._chars = config.prefix_chars
        self._fallback = QueuePolicy(rng)

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        key = info.prefix_text(self._chars)
        if not key:
            return self._fallback.select(candidates, info)
        return pick_bounded(key, candidates, self._bound)

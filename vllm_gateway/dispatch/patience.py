"""Whether a request waits for the full worker that holds its prompt, and how long.

A request whose policy would rather have a worker the capacity gate left out
(cache_aware's `preferred`: the holders of its history, or of its document or system
prompt when no candidate holds it) than any worker with room would, sent to one of
those, prefill again what the holder has, and copy it into one more worker's cache. Where
the holders' KV cache was seen to bind (`Worker.kv_binds`, kv_queue.py), that copy stalls
the worker it lands on and evicts what its own conversations reuse. So the request waits
in the admission queue for the holders instead, set aside so that the requests behind it
may go first (admission.py): for as long as the slowest of them takes to run one request
(1 / pace, learned; without a pace it does not wait), and past that while no worker with
room has free KV blocks for its whole prompt (there vLLM would keep it waiting for blocks,
and every request behind it). docs/dispatch.md "No copy into a full KV cache".
"""

from __future__ import annotations

import time

from vllm_gateway.dispatch.admission import Waiter
from vllm_gateway.dispatch.kv_queue import has_kv_room
from vllm_gateway.dispatch.policies import Policy, waits_for_preferred
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker


def patient(
    policy: Policy,
    info: RequestInfo,
    liked: list[Worker],
    candidates: list[Worker],
    waiter: Waiter | None,
) -> bool:
    """Whether the request waits for `liked` (full) rather than go to a `candidate` now.
    A request not queued yet (`waiter` None) joins the queue when it may wait at all, and
    decides there; a waiter's patience runs from when it was queued, and its `wants`
    (what it waits for) are set here."""
    if not liked or not waits_for_preferred(policy) or not any(w.kv_binds for w in liked):
        return False
    if waiter is None:
        return any(w.pace > 0 for w in liked)
    if not waiter.until:
        waiter.until = waiter.enqueued + max(1.0 / w.pace if w.pace > 0 else 0.0 for w in liked)
    waiter.wants = liked
    if time.monotonic() < waiter.until:
        return True
    size = len(info.body)
    return not any(has_kv_room(w, size) for w in candidates)

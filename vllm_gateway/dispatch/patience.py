"""Whether a request waits for the full worker that holds its prompt, and how long.

A request whose policy would rather have a worker the capacity gate left out
(cache_aware's `preferred`: the holders of its history, or of its document or system
prompt when no candidate holds it) than any worker with room would, sent to one of
those, prefill again what the holder has, and copy it into one more worker's cache. Where
the holders' KV cache was seen to bind (`Worker.kv_binds`, kv_queue.py), that copy stalls
the worker it lands on and evicts what its own conversations reuse. So the request waits
in the admission queue for the holders instead, set aside so that the requests behind it
may go first (admission.py): for as long as the slowest of them takes to run one request
(1 / pace, learned; without a pace it does not wait), at most half the admission queue's
bound; a wanted worker that gets a token, or goes out, ends the wait at once.
docs/dispatch.md "No copy into a full KV cache".
"""

from __future__ import annotations

import time

from vllm_gateway.dispatch.admission import Waiter
from vllm_gateway.dispatch.policies import Policy, waits_for_preferred
from vllm_gateway.workers import Worker


def patient(policy: Policy, liked: list[Worker], waiter: Waiter | None, max_wait: float) -> bool:
    """Whether the request waits for `liked` (full) rather than go to a candidate with room
    now. A request not queued yet (`waiter` None) joins the queue when it may wait at all,
    and decides there; a waiter's patience runs from when it was queued, at most half the
    queue's bound (`max_wait`, 0: none), and its `wants` (what it waits for) are set here."""
    if not liked or not waits_for_preferred(policy):
        return False
    if not any(w.kv_binds and w.pace > 0 for w in liked):
        return False
    if waiter is None:
        return True
    if not waiter.until:
        patience = max(1.0 / w.pace for w in liked if w.kv_binds and w.pace > 0)
        if max_wait > 0:
            patience = min(patience, max_wait / 2)
        waiter.until = waiter.enqueued + patience
    waiter.wants = liked
    return time.monotonic() < waiter.until

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
and every request behind it), in all at most half the admission queue's bound; a wanted
worker that gets a token, or goes out, ends the wait at once.
docs/dispatch.md "No copy into a full KV cache".
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from vllm_gateway.dispatch.admission import Waiter
from vllm_gateway.dispatch.kv_queue import has_kv_room
from vllm_gateway.dispatch.policies import Policy, waits_for_preferred
from vllm_gateway.workers import Worker


def patient(
    policy: Policy,
    liked: list[Worker],
    candidates: list[Worker],
    waiter: Waiter | None,
    max_wait: float,
) -> bool:
    """Whether the request waits for `liked` (full) rather than go to one of the
    `candidates` (with room) now. A request not queued yet (`waiter` None) joins the
    queue when it may wait at all, and decides there. A waiter's patience runs from when it
    was queued; past it, it still waits while no candidate has free KV blocks for its
    prompt, until half the queue's bound (`max_wait`; 0: none, then twice its patience).
    Sets the waiter's `wants` (what it waits for)."""
    if not liked or not waits_for_preferred(policy):
        return False
    binding = [w for w in liked if w.kv_binds and w.pace > 0]
    if not binding:
        return False
    if waiter is None:
        return True
    if not waiter.until:
        patience = max(1.0 / w.pace for w in binding)
        bound = max_wait / 2 if max_wait > 0 else 2 * patience
        waiter.until = waiter.enqueued + min(patience, bound)
        waiter.last = waiter.enqueued + bound
    waiter.wants = liked
    now = time.monotonic()
    if now < waiter.until:
        return True
    return now < waiter.last and not room_for(candidates, waiter)


def room_for(workers: Iterable[Worker], waiter: Waiter) -> bool:
    """Whether any of `workers` has free KV blocks for the waiter's whole request body."""
    size = len(waiter.info.body)
    return any(has_kv_room(w, size) for w in workers)

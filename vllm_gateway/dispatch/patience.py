"""Whether a request waits for the full worker that holds its prompt, and how long.

A request whose policy would rather have a worker the capacity gate left out
(cache_aware's `preferred`: the holders of its history, or of its document or system
prompt when no candidate holds it) than any worker with room would, sent to one of
those, prefill again what the holder has, and copy it into one more worker's cache. So it
may wait in the admission queue for the holders instead, set aside so that the requests
behind it may go first (admission.py); a wanted worker that gets a token, or goes out,
ends the wait at once. Two cases (docs/dispatch.md "No copy into a full KV cache"):

- Where the holders' KV cache was seen to bind (`Worker.kv_binds`, kv_queue.py), the copy
  stalls the worker it lands on and evicts what its own conversations reuse: it waits for
  as long as the slowest of them takes to run one request (1 / pace, learned; without a
  pace it does not wait), and past that while no worker with room has free KV blocks for
  its whole prompt (there vLLM would keep it waiting for blocks, and every request behind
  it), in all at most half the admission queue's bound.
- Elsewhere, a later turn waits for its history's holders when one of them is expected
  to free a batch slot for it sooner than its history would be prefilled on a worker with
  room (`slot_patience`), and for no longer than that prefill would take.

Patience ends at the next event after it (a release or a scrape): no timer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

from vllm_gateway.dispatch.admission import Admission, Waiter
from vllm_gateway.dispatch.kv_queue import has_kv_room
from vllm_gateway.dispatch.policies import Policy, waits_for_preferred
from vllm_gateway.dispatch.prefill_rate import seconds_per_byte
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker


def patient(
    policy: Policy,
    liked: list[Worker],
    candidates: list[Worker],
    waiter: Waiter | None,
    info: RequestInfo,
    stretchable: Callable[[Worker], bool] | None,
    admission: Admission,
) -> bool:
    """Whether the request `info` waits for `liked` (full) rather than go to one of the
    `candidates` (with room) now. A request not queued yet (`waiter` None) joins the
    queue when it may wait at all, and decides there. A waiter's patience runs from when it
    was queued; past it, a request for a binding holder still waits while no candidate has
    free KV blocks for its prompt, until half the queue's bound (`admission.max_wait`; 0:
    none, then twice its patience). `stretchable`: the liked workers the gate would let
    this request past their probing limit (it goes there as the probe instead of
    waiting). Sets the waiter's `wants` (what it waits for)."""
    if not liked or not waits_for_preferred(policy):
        return False
    max_wait = admission.max_wait
    binding = [w for w in liked if w.kv_binds and w.pace > 0]
    if binding:
        patience = max(1.0 / w.pace for w in binding)
        bound = max_wait / 2 if max_wait > 0 else 2 * patience
    else:
        queue = admission.queues.get(info.model)  # those set aside already go first
        aside = queue.patient if queue is not None else ()
        before = [x for x in aside if waiter is None or x.key < waiter.key]
        patience = slot_patience(liked, candidates, info.saved, stretchable, before)
        if patience <= 0.0:
            return False
        bound = patience = min(patience, max_wait / 2) if max_wait > 0 else patience
    if waiter is None:
        return True
    if not waiter.until:
        waiter.until = waiter.enqueued + min(patience, bound)
        waiter.last = waiter.enqueued + bound
    waiter.wants = liked
    now = time.monotonic()
    if now < waiter.until:
        return True
    return now < waiter.last and not room_for(candidates, waiter)


def slot_patience(
    liked: Sequence[Worker],
    candidates: Sequence[Worker],
    saved: int,
    stretchable: Callable[[Worker], bool] | None = None,
    before: Sequence[Waiter] = (),
) -> float:
    """Seconds a later turn waits for its history's full holders `liked`, whose KV cache
    is not known to bind; 0.0: it goes to a candidate now.

    Elsewhere it prefills `saved` bytes more (what the holders hold of its history and no
    candidate does), at the fastest prefill rate learned among the candidates
    (prefill_rate.py). A holder frees a batch slot for it once the requests queued inside
    it and the waiters set aside for it earlier (`before`) have had theirs, one per
    1 / (pace x running) seconds (pace: requests finished per second per running request,
    learned; running: its requests and others', at most its capacity). It waits when the
    first holder's slot is expected sooner than the prefill, for at most that prefill's
    time or twice the slot's (past that, the figures were wrong). Never without both
    figures, nor for a holder the gate would let it into as its probe (it goes there at
    once)."""
    if saved <= 0:
        return 0.0
    if stretchable is not None and any(stretchable(w) for w in liked):
        return 0.0
    rates = [r for r in map(seconds_per_byte, candidates) if r > 0.0]
    if not rates:
        return 0.0
    move = saved * min(rates)
    slot = math.inf
    for w in liked:
        if not w.pace > 0.0:
            continue
        on = w.inflight + w.others  # running and queued inside it, as last seen
        capacity = w.max_num_seqs or w.capacity or on
        running = max(1.0, min(on, capacity))
        queued = max(0.0, on - capacity) + sum(1 for x in before if w in x.wants)
        slot = min(slot, (queued + 1.0) / (w.pace * running))
    if not slot < move:
        return 0.0
    return min(move, 2.0 * slot)


def room_for(workers: Iterable[Worker], waiter: Waiter) -> bool:
    """Whether any of `workers` has free KV blocks for the waiter's whole request body."""
    size = len(waiter.info.body)
    return any(has_kv_room(w, size) for w in workers)

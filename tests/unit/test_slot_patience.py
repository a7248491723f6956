"""Pure tests of how long a later turn waits for a full holder whose KV cache does not
bind (patience.slot_patience), and of the prefill rate it reads (prefill_rate.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from vllm_gateway.dispatch.lease import Lease
from vllm_gateway.dispatch.patience import slot_patience
from vllm_gateway.dispatch.prefill_rate import WEIGHT, note, seconds_per_byte
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker


def worker(pace=0.0, inflight=0, others=0.0, capacity=0, rate=0.0) -> Worker:
    w = Worker("http://w")
    w.pace, w.inflight, w.others, w.max_num_seqs = pace, inflight, others, capacity
    if rate:
        w.prefill_seconds, w.prefill_bytes = rate * 1000, 1000.0
    return w


# (holders as (pace, inflight, others, capacity), candidates' learned seconds per byte,
#  bytes saved, waiters set aside before it (for the first holder), seconds of patience)
CASES = {
    # one holder running 4 at pace 1: a slot in 0.25 s; 1000 bytes at 1 ms: 1 s; it waits
    # at most twice the slot's time (past that the figures were wrong)
    "slot sooner than the prefill: waits": ([(1.0, 4, 0, 4)], [1e-3], 1000, 0, 0.5),
    "the prefill sooner than twice the slot: that long": ([(1.0, 4, 0, 4)], [4e-4], 1000, 0, 0.4),
    "slot later than the prefill: goes now": ([(1.0, 4, 0, 4)], [1e-4], 1000, 0, 0.0),
    "slot as late as the prefill: goes now": ([(1.0, 4, 0, 4)], [2.5e-4], 1000, 0, 0.0),
    "the fastest candidate's rate counts": ([(1.0, 4, 0, 4)], [1e-2, 1e-4], 1000, 0, 0.0),
    "candidates with no rate yet are skipped": ([(1.0, 4, 0, 4)], [0.0, 1e-3], 1000, 0, 0.5),
    "no rate anywhere: goes now": ([(1.0, 4, 0, 4)], [0.0, 0.0], 1000, 0, 0.0),
    "nothing saved: goes now": ([(1.0, 4, 0, 4)], [1e-3], 0, 0, 0.0),
    "no pace on the holder: goes now": ([(0.0, 4, 0, 4)], [1e-3], 1000, 0, 0.0),
    # others' requests on it run too: 1 running frees a slot in 1 s, 4 in 0.25 s
    "other senders' running requests count": ([(1.0, 1, 3.0, 4)], [5e-4], 1000, 0, 0.5),
    "alone, one running: 1 s > 0.5 s": ([(1.0, 1, 0.0, 4)], [5e-4], 1000, 0, 0.0),
    # 6 on a worker that runs 4: 2 queued inside it first, the slot in 3 x 0.25 s
    "requests queued inside the holder go first": ([(1.0, 4, 2.0, 4)], [1e-3], 1000, 0, 1.0),
    "so do waiters set aside for it earlier": ([(1.0, 4, 0, 4)], [1e-3], 1000, 3, 0.0),
    # the first holder to free a slot counts: 1 / (0.5 x 1) = 2 s each, not 1 s together
    "the first holder's slot, not their sum": (
        [(0.5, 1, 0, 1), (0.5, 1, 0, 1)],
        [1.5e-3],
        1000,
        0,
        0.0,
    ),
    "the faster holder's slot": ([(0.5, 1, 0, 1), (2.0, 1, 0, 1)], [1.5e-3], 1000, 0, 1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_slot_patience(case):
    holders, rates, saved, ahead, want = CASES[case]
    liked = [worker(p, i, o, c) for p, i, o, c in holders]
    candidates = [worker(rate=r) for r in rates]
    before = [SimpleNamespace(wants=[liked[0]]) for _ in range(ahead)]
    assert slot_patience(liked, candidates, saved, None, before) == pytest.approx(want)


def test_a_holder_it_may_probe_is_not_waited_for():
    """The gate would let this request past the holder's probing limit (buckets.py
    `can_stretch`): it goes there as the probe instead of waiting."""
    liked, candidates = [worker(1.0, 4, capacity=4)], [worker(rate=1e-3)]
    assert slot_patience(liked, candidates, 1000, lambda w: False) == pytest.approx(0.5)
    assert slot_patience(liked, candidates, 1000, lambda w: True) == 0.0


def test_the_prefill_rate_is_a_ratio_of_smoothed_sums():
    w = Worker("http://w")
    assert seconds_per_byte(w) == 0.0  # unknown
    note(w, 0.5, 1000)
    assert seconds_per_byte(w) == pytest.approx(5e-4)  # one request: its own ratio
    note(w, 0.02, 10)  # a tiny prompt: mostly fixed latency, it weighs little
    seconds = WEIGHT * 0.5 + WEIGHT * (0.02 - WEIGHT * 0.5)
    work = WEIGHT * 1000 + WEIGHT * (10 - WEIGHT * 1000)
    assert seconds_per_byte(w) == pytest.approx(seconds / work)
    assert seconds_per_byte(w) < 1e-3  # where the mean of the two ratios is 1.25e-3


@pytest.mark.parametrize(
    "elapsed, work", [(-1.0, 100), (math.inf, 100), (math.nan, 100), (0.1, 0), (0.1, -5)]
)
def test_nonsense_first_bytes_are_ignored(elapsed, work):
    w = Worker("http://w")
    note(w, 0.1, 100)
    note(w, elapsed, work)
    assert seconds_per_byte(w) == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "status, known, learns",
    [(200, True, True), (503, True, False), (429, True, False), (200, False, False)],
)
def test_only_a_successful_answer_of_known_bytes_teaches_the_rate(status, known, learns):
    """An error's short body comes at once, whatever the prefill: it says nothing of it;
    nor does an answer whose prefill bytes were a guess (dispatcher.py sets `learns`).
    Either way the worker owes the request no more prefill."""
    w = Worker("http://w")
    lease = Lease(None, w, RequestInfo("/v1/chat/completions", b"{}", "m", True, "r"))
    lease.pending, lease.learns = 300, known
    w.backlog = 1000
    lease.first_body(status, lease.started + 0.3)
    assert w.backlog == 700 and lease.pending == 0
    assert seconds_per_byte(w) == (pytest.approx(1e-3) if learns else 0.0)
    lease.first_body(status, lease.started + 9.0)  # (called once; nothing more to learn)
    assert w.backlog == 700

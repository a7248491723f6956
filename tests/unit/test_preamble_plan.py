"""The preamble plan's dealing (preamble_plan.py): each popular preamble gets the workers
it wants, none two while another has none, and a plan made again moves little."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from vllm_gateway.dispatch.policies.rendezvous import Ranks
from vllm_gateway.dispatch.preamble_plan import PreamblePlan, _fewest
from vllm_gateway.workers import EngineStats, Worker

BOUND = 1.25  # the default load bound


def _plan(plan: PreamblePlan, ws: list[Worker], counts: dict[int, int]) -> dict[int, frozenset]:
    plan._build(ws, counts, Ranks().cached)
    return {p: urls for p, (_, urls) in plan._planned.items()}


@pytest.mark.parametrize("seed", range(24))
def test_a_preamble_planned_one_worker_more_keeps_its_own_and_moves_no_other(seed):
    """A popular preamble's share crosses a boundary (the others want one worker each):
    the plan made again gives it one worker more and keeps every other preamble where it
    was (each move would prefill all its conversations again; behind two replicas, whose
    shares cross at other moments, they would go back and forth). Dealt a preamble at a
    time, 10 of these 24 cases moved another preamble."""
    rng = random.Random(seed)
    n = rng.choice([4, 6, 8])
    k = rng.randint(3, n)
    ws = [Worker(f"http://p{seed}-{i}.test:8000", models=("m",)) for i in range(n)]
    preambles = rng.sample(range(1, 1 << 31), k)
    counts = dict.fromkeys(preambles, 1000)
    counts[0] = 1000 * (n - k)  # the rest of the traffic: no preamble
    total = sum(counts.values())
    assert all(_fewest(c / total, total, n, BOUND) == 1 for p, c in counts.items() if p)
    plan = PreamblePlan(BOUND)
    before = _plan(plan, ws, counts)
    raised = rng.choice(preambles)
    counts[raised] = 3000
    total = sum(counts.values())
    wants = {p: _fewest(c / total, total, n, BOUND) for p, c in counts.items() if p}
    assert wants[raised] == 2 and all(w == 1 for p, w in wants.items() if p != raised)
    after = _plan(plan, ws, counts)
    assert before[raised] < after[raised] and len(after[raised]) == 2
    assert {p: u for p, u in after.items() if p != raised} == {
        p: u for p, u in before.items() if p != raised
    }


@pytest.mark.parametrize("seed", range(40))
def test_every_preamble_gets_the_workers_it_wants_and_no_worker_more_than_its_part(seed):
    """Dealt in rounds, the last picks of a round can fill the workers a preamble does not
    have yet (2 workers; wants 2, 1, 1: the big one takes one worker, both small ones the
    other's two slots): a small one makes way, so the big one gets its second worker and
    no worker caches more than its part of the slots (equal weights here)."""
    rng = random.Random(seed)
    n = rng.choice([2, 2, 3, 4, 6])
    ws = [Worker(f"http://d{seed}-{i}.test:8000", models=("m",)) for i in range(n)]
    if n == 2:
        counts = dict(zip(rng.sample(range(1, 1 << 31), 3), (737, 143, 144), strict=True))
    else:
        preambles = rng.sample(range(1, 1 << 31), rng.randint(2, n + 2))
        counts = {p: rng.randint(50, 900) for p in preambles}
    total = sum(counts.values())
    plan = PreamblePlan(BOUND)
    plan._build(ws, counts, Ranks().cached)
    planned = plan._planned
    assert planned
    for p, (want, urls) in planned.items():
        assert want == _fewest(counts[p] / total, total, n, BOUND)
        assert len(urls) == want, planned
    per = Counter(u for _, urls in planned.values() for u in urls)
    part = -(-sum(want for want, _ in planned.values()) // n)
    assert max(per.values()) <= part, planned


def test_moves_count_the_preambles_a_new_plan_gives_other_workers():
    """`moves` (/metrics: vllm_gateway_preamble_plan_moves_total) counts each preamble a
    plan made again gave a worker it did not have: none for the same shares over the same
    workers; when a worker leaves, its preamble and any the new plan pushes along; none
    for a preamble planned one worker fewer; and an empty plan (every worker of weight 0)
    is no baseline."""
    ws = [Worker(f"http://m-{i}.test:8000", models=("m",)) for i in range(4)]
    counts = {101: 1000, 202: 1000, 303: 1000, 0: 1000}
    plan = PreamblePlan(BOUND)
    first = _plan(plan, ws, counts)
    assert plan.moves == 0 and plan.builds == 1
    assert _plan(plan, ws, counts) == first and plan.moves == 0
    gone = next(iter(first[202]))
    rest = [w for w in ws if w.url != gone]
    plan.forget_missing(w.url for w in rest)
    after = _plan(plan, rest, counts)
    moved = [p for p in first if after[p] != first[p]]
    assert 202 in moved and plan.moves == len(moved) and plan.builds == 3
    # One worker fewer for a preamble (it had two): nothing to prefill.
    plan = PreamblePlan(BOUND)
    two = _plan(plan, ws, {101: 2000, 202: 1000, 0: 1000})
    assert len(two[101]) == 2
    fewer = _plan(plan, ws, {101: 1000, 202: 1000, 0: 2000})
    assert len(fewer[101]) == 1 and fewer[101] < two[101] and plan.moves == 0
    # Every worker of weight 0 for a plan: the next one counts against the plan before it
    # (101's worker left meanwhile, so 101 moves).
    for w in ws:
        w.weight = 0.0
    assert _plan(plan, ws, {101: 1000, 202: 1000, 0: 2000}) == {}
    for w in ws:
        w.weight = 1.0
    gone = next(iter(fewer[101]))
    rest = [w for w in ws if w.url != gone]
    plan.forget_missing(w.url for w in rest)
    again = _plan(plan, rest, {101: 1000, 202: 1000, 0: 2000})
    assert plan.moves == sum(not again[p] <= fewer[p] for p in again) >= 1


def _fleet(caches: list[float | None]) -> list[Worker]:
    ws = [Worker(f"http://c-{i}.test:8000", models=("m",)) for i in range(len(caches))]
    for w, tokens in zip(ws, caches, strict=True):
        if tokens is not None:
            w.stats = EngineStats(0, 0, 0.1, 0.0, cache_tokens=tokens)
    return ws


def _per_worker(plan: PreamblePlan, ws: list[Worker], k: int) -> list[int]:
    counts = {p: 1000 for p in range(1, k + 1)}  # k alike preambles, one worker each
    planned = _plan(plan, ws, counts)
    assert all(len(urls) == 1 for urls in planned.values())
    per = Counter(u for urls in planned.values() for u in urls)
    return [per[w.url] for w in ws]


def test_a_worker_with_three_times_the_kv_cache_is_planned_three_times_the_preambles():
    """Two GPU generations: a worker holds the preambles its KV cache (as it reports it,
    `vllm:cache_config_info`) has room for, not as many as a worker with a third of it."""
    assert _per_worker(PreamblePlan(BOUND), _fleet([3e5, 3e5, 1e5, 1e5]), 8) == [3, 3, 1, 1]
    # Alike caches: alike parts, as with no cache reported.
    assert _per_worker(PreamblePlan(BOUND), _fleet([1e5] * 4), 8) == [2, 2, 2, 2]


def test_a_worker_reporting_no_cache_counts_at_the_median_of_those_that_do():
    """A worker that reports no cache size (not vLLM, or no scrape yet) is counted at the
    others' median: the parts do not swing the whole fleet back to weights alone. With no
    report at all, they go by weight."""
    assert _per_worker(PreamblePlan(BOUND), _fleet([3e5, 3e5, 1e5, None]), 10) == [3, 3, 1, 3]
    assert _per_worker(PreamblePlan(BOUND), _fleet([None] * 4), 8) == [2, 2, 2, 2]
    # A worker of weight 0 takes none either way, reported or not.
    ws = _fleet([3e5, 3e5, 1e5, 1e5, None])
    ws[4].weight = 0.0
    assert _per_worker(PreamblePlan(BOUND), ws, 8) == [3, 3, 1, 1, 0]
    # A plan reads the reports as they are now (two replicas read the same): a stale
    # scrape (no stats) counts as no report.
    plan = PreamblePlan(BOUND)
    ws = _fleet([3e5, 1e5, 1e5, 1e5])
    ws[0].stats = None
    assert _per_worker(plan, ws, 4) == [1, 1, 1, 1]


@pytest.mark.parametrize(
    ("claim", "expected"),
    [
        (1e30, [6, 2, 2, 2]),  # counted as 8x the median: without the bound, [9, 1, 1, 1]
        (1e5, [3, 3, 3, 3]),
        (1e5 / 100, [1, 4, 4, 3]),  # below the median: only the claimant loses (one slot)
        (0.5, [3, 3, 3, 3]),  # below a token: nonsense, as no report (the median)
        (-1e5, [3, 3, 3, 3]),
        (math.nan, [3, 3, 3, 3]),
        (math.inf, [3, 3, 3, 3]),
    ],
)
def test_a_worker_claiming_any_cache_size_moves_only_its_own_part_and_that_bounded(claim, expected):
    """A worker's report is untrusted: it counts up to CACHE_SPAN times the median report, a
    nonsense figure at the median, so no claim takes every preamble or moves the others'
    parts but through its own."""
    per = _per_worker(PreamblePlan(BOUND), _fleet([claim, 1e5, 1e5, 1e5]), 12)
    assert sorted(per[1:]) == sorted(expected[1:]) and per[0] == expected[0]


@pytest.mark.parametrize("claim", [1e12, 1e3])
def test_the_median_is_a_truthful_report_while_most_workers_report_truthfully(claim):
    """The median the parts are counted against is the lower one of the reports of the
    workers of weight > 0, and only when more than half of them report: one false claim
    among two reports, or the reports of workers that take no preambles, would otherwise
    set it, and move every truthful worker's part."""
    # Two of four report (one of them false): the parts go by weight.
    assert _per_worker(PreamblePlan(BOUND), _fleet([claim, 1e5, None, None]), 12) == [3] * 4
    # Three of four report: the median is a truthful one, the claim moves its own part only.
    per = _per_worker(PreamblePlan(BOUND), _fleet([claim, 1e5, 1e5, None]), 12)
    assert max(per[1:]) - min(per[1:]) <= 1  # (alike but for rounding)
    assert per[0] == (6 if claim > 1e5 else 1)
    # Workers of weight 0 take no preambles and set nothing, whatever they report (counted,
    # their one-token caches would set the median, and clamp both others to 8x it alike).
    ws = _fleet([1e5, 3e5, 1.0, 1.0, 1.0])
    for w in ws[2:]:
        w.weight = 0.0
    assert _per_worker(PreamblePlan(BOUND), ws, 8) == [2, 6, 0, 0, 0]


def test_the_least_planned_worker_is_counted_for_its_part():
    """Caches 4:2:1 and nine alike preambles: counted for its part (planned / its slots),
    the largest worker takes five of them, about its 4/7; counted in preambles alone, the
    dealing would even them out to 4, 3, 2 within the slots."""
    assert _per_worker(PreamblePlan(BOUND), _fleet([4e5, 2e5, 1e5]), 9) == [5, 2, 2]


def test_tiny_weights_and_caches_leave_no_worker_of_weight_above_0_without_a_slot():
    """The parts are weight x cache relative to the median, not a product that underflows
    (any weight above 0 is in bounds), nor a tiny part relative to the largest."""
    ws = _fleet([1e5, 8e5, 8e5])  # the first at an eighth of the median: 5e-324 / 8 is 0
    for w, weight in zip(ws, [5e-324, 5e-324, 8.0], strict=True):
        w.weight = weight
    plan = PreamblePlan(BOUND)
    planned = _plan(plan, ws, {7: 1000})
    assert len(planned[7]) == 3  # a preamble with all the traffic has every worker

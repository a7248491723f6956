"""The workers the preamble plan fills (preamble_plan.py `_filled`), and the order the
preambles too rare to plan, and a planned one's overflow, take by it
(`PreamblePlan.order`)."""

from __future__ import annotations

import pytest

from vllm_gateway.dispatch.policies.rendezvous import Ranks
from vllm_gateway.dispatch.preamble_plan import PreamblePlan, _filled
from vllm_gateway.workers import EngineStats, Worker

NAMES = "abcde"


def _url(name: str) -> str:
    return f"http://{name}.test:8000"


def _workers(n: int, tag: str = "h") -> list[Worker]:
    return [Worker(f"http://{tag}{i}.test:8000", models=("m",)) for i in range(n)]


@pytest.mark.parametrize(
    ("slots", "planned", "counts", "want"),
    [
        # Nothing planned: none filled.
        ([1, 1], {}, {0: 10}, ""),
        # 60% of the traffic on the first of 2 equal workers: past its half.
        ([1, 1], {7: (1, "a")}, {7: 60, 0: 40}, "a"),
        # Exactly its fair part (50% of 2) fills it too.
        ([1, 1], {7: (1, "a")}, {7: 50, 0: 50}, "a"),
        # 30% on one of 5 (fair 20%) fills it; 10% on another does not.
        ([1, 1, 1, 1, 1], {7: (1, "a"), 8: (1, "b")}, {7: 30, 8: 10, 0: 60}, "a"),
        # Two preambles on one worker add up: 12% + 12% of 5 workers' traffic.
        ([1, 1, 1, 1, 1], {7: (1, "a"), 8: (1, "a")}, {7: 12, 8: 12, 0: 76}, "a"),
        # A preamble on two workers splits its share: 40% over a and b, 20% each of 25%.
        ([1, 1, 1, 1], {7: (2, "ab")}, {7: 40, 0: 60}, ""),
        # ... and 60% over them, 30% each: both filled.
        ([1, 1, 1, 1], {7: (2, "ab")}, {7: 60, 0: 40}, "ab"),
        # Parts by slot weight: a has 3 of 4 (fair 75%) and takes 60%; b 1 of 4 and 30%.
        ([3, 1], {7: (1, "a"), 8: (1, "b")}, {7: 60, 8: 30, 0: 10}, "b"),
        # A worker of no slot weight (weight 0) is never filled (its rank is inf anyway),
        # and has no part: a's is all the traffic.
        ([1, 0], {7: (1, "a")}, {7: 90, 0: 10}, ""),
    ],
)
def test_filled_are_the_workers_planned_their_fair_part_or_more(slots, planned, counts, want):
    ws = [Worker(_url(NAMES[i]), models=("m",)) for i in range(len(slots))]
    plan = {p: (k, frozenset(_url(u) for u in us)) for p, (k, us) in planned.items()}
    got = _filled(ws, [float(x) for x in slots], plan, counts, sum(counts.values()))
    assert got == {_url(u) for u in want}


def test_without_a_plan_the_order_is_the_preambles_own_rendezvous_order():
    ws = _workers(6)
    ranks = Ranks()
    plan = PreamblePlan(1.25)
    for key in range(1, 200):
        own = ranks.cached(key, ws)
        assert plan.order(key, ws, ranks.cached) == sorted(range(6), key=own.__getitem__)


def test_rare_preambles_never_go_first_to_a_worker_a_hot_one_fills():
    """A hot preamble fills one of 4 equal workers (30% of the traffic, fair 25%); another
    takes half of a second worker's part. The preambles too rare to plan go first to the
    other three about equally, never to the filled one; each key's order is a function
    of the key and the plan alone, and is the key's own order with the filled one last."""
    ws = _workers(4)
    plan = PreamblePlan(1.25)
    plan._build(ws, {11: 300, 12: 125, 0: 575}, Ranks().cached)
    hot, warm = plan.urls_of(11), plan.urls_of(12)
    assert hot is not None and warm is not None and len(hot) == 1 and len(warm) == 1
    assert hot != warm
    (h,) = hot
    first = {w.url: 0 for w in ws}
    ranks = Ranks()
    for key in range(1000, 4000):
        order = plan.order(key, ws, ranks.cached)
        assert order == plan.order(key, ws, Ranks().cached)
        first[ws[order[0]].url] += 1
        own = ranks.cached(key, ws)
        assert order == [j for j in sorted(range(4), key=own.__getitem__) if ws[j].url != h] + [
            j for j, w in enumerate(ws) if w.url == h
        ]
    assert first[h] == 0
    assert all(800 < first[u] < 1200 for u in first if u != h), first


def test_parts_by_reported_cache_set_what_fills_a_worker():
    """A worker reporting three times the others' KV cache has a fair part three times
    theirs (the plan's slots): the same planned share (30% of the traffic) fills a small
    one (part 20%), not the large one (part 60%)."""
    ws = _workers(3, "k")
    for w, tokens in zip(ws, (3000.0, 1000.0, 1000.0), strict=True):
        w.stats = EngineStats(0, 0, 0.1, 0.0, cache_tokens=tokens)
    seen = set()
    for preamble in range(1, 40):
        plan = PreamblePlan(1.25)
        plan._build(ws, {preamble: 30, 0: 70}, Ranks().cached)
        (url,) = plan.urls_of(preamble) or ()
        seen.add(url)
        assert plan._filled == (frozenset() if url == ws[0].url else {url})
    assert len(seen) > 1  # (both cases met)


def test_the_plan_is_made_again_on_its_schedule_when_only_rare_preambles_arrive():
    """A hot preamble fills a worker; then it stops, and every conversation has its own
    rare preamble. Those are never planned, yet the schedule still makes the plan again,
    which frees the worker: rare preambles go first to it again, as to any other."""
    from vllm_gateway.dispatch.preamble_plan import Shares

    ws = _workers(5, "s")
    shares = Shares(1.25)
    ranks = Ranks()

    def send(preamble: int) -> None:
        share = shares.add(preamble)
        shares.plan.among(preamble, share, shares.samples, ws, shares.counts, ranks.cached)

    for i in range(2000):
        send(77 if i % 4 == 0 else 1000 + i)  # the hot one: 25%, one worker (fair 20%)
    assert shares.plan._filled and len(shares.plan._filled) == 1
    (freed,) = shares.plan._filled
    for i in range(5000):
        send(100_000 + i)
    assert shares.plan._filled == frozenset()
    firsts = {ws[shares.plan.order(k, ws, ranks.cached)[0]].url for k in range(1, 400)}
    assert freed in firsts

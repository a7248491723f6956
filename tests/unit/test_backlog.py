"""The prefill backlog rule (dispatch/backlog.py), table-driven: which candidates a later
turn leaves, measured from what a typical candidate owes."""

from __future__ import annotations

import math
import random

import pytest

from vllm_gateway.dispatch.backlog import congested, worth_checking
from vllm_gateway.workers import Worker

SIZE = 1000  # the turn's prompt bytes
OWN = 100  # what each candidate would prefill of it (it holds the rest)
# Left when it owes more than the typical candidate by SIZE + (SIZE - OWN).
LIMIT = 2 * SIZE - OWN


@pytest.mark.parametrize(
    ("owed", "speeds", "left"),
    [
        # Nobody busy but one: measured from nothing.
        ([0, 0, 0, LIMIT + 1], [1, 1, 1, 1], {3}),
        ([0, 0, 0, LIMIT], [1, 1, 1, 1], None),
        # Everyone busy prefilling but one idle for a moment: the typical candidate (the
        # lower median) owes 5000, so the busiest is left only past 5000 + LIMIT. (Measured
        # from the idle one, all three would be left.)
        ([0, 5000, 5000, 5000 + LIMIT], [1, 1, 1, 1], None),
        ([0, 5000, 5000, 5000 + LIMIT + 1], [1, 1, 1, 1], {3}),
        ([5000, 5000, 5000, 5000], [1, 1, 1, 1], None),
        # Two candidates: the lower median is the least.
        ([0, LIMIT + 1], [1, 1], {1}),
        # Four: the second least (the lower median), not the third.
        ([0, 0, 1000, 1000 + LIMIT], [1, 1, 1, 1], {3}),
        # Three: the middle one.
        ([0, 3000, 3000 + LIMIT + 1], [1, 1, 1], {2}),
        ([0, 3000, 3000 + LIMIT], [1, 1, 1], None),
        # A worker half as fast drains at half the pace: its backlog counts twice.
        ([0, 0, LIMIT // 2 + 1, 0], [1, 1, 0.5, 1], {2}),
        ([0, 0, LIMIT // 2, 0], [1, 1, 0.5, 1], None),
        # Weight 0 (speed 0): its backlog counts as endless (left whenever the rule is
        # consulted: a last resort anyway), and not in the typical one.
        ([0, 0, 0, LIMIT + 1], [0, 1, 1, 1], {0, 3}),
        ([9e9, 0, 0, LIMIT + 1], [0, 1, 1, 1], {0, 3}),
        ([0, 0, 0, LIMIT], [0, 1, 1, 1], {0}),
        ([0, 0, LIMIT + 1], [0, 1, 1], {0, 2}),  # (counted, it would be the median)
        ([0, 0], [0, 0], None),
    ],
)
def test_a_candidate_is_left_when_it_owes_more_than_a_typical_one_by_what_moving_costs(
    owed, speeds, left
):
    ws = [Worker(f"http://10.0.0.{i}:8000", models=("m",)) for i in range(len(owed))]
    for w, b in zip(ws, owed, strict=True):
        w.backlog = int(b)
    assert congested(ws, speeds, SIZE, lambda j: OWN) == left
    # The cheap bound before the pass never hides a candidate the pass would find.
    if left and left != {0}:
        finite = [b for b, s in zip(owed, speeds, strict=True) if s > 0]
        assert worth_checking(max(owed), min(finite, default=math.inf), speeds, SIZE)


def test_a_holder_that_evicts_is_left_behind_about_one_prompt():
    """`uncached_of(j)`: what candidate j would prefill of the turn. One that would prefill
    all of it (it lost the history) saves nothing by staying but the turn's own wait."""
    ws = [Worker(f"http://10.0.0.{i}:8000", models=("m",)) for i in range(4)]
    ws[3].backlog = SIZE + 1
    assert congested(ws, [1, 1, 1, 1], SIZE, lambda j: SIZE) == {3}
    assert congested(ws, [1, 1, 1, 1], SIZE, lambda j: OWN) is None


def _reference(ws, speeds, size, uncached_of):
    """The rule as first written (log2, round, pow per candidate): the oracle the faster
    form must agree with."""
    top = max(speeds)
    owed = []
    for j, w in enumerate(ws):
        speed = speeds[j]
        if speed > 0:
            ratio = top / speed  # >= 1
            k = min(30, round(math.log2(ratio))) if ratio < 2.0**30 else 30
            owed.append(w.backlog * 2.0**k)
        else:
            owed.append(math.inf)
    finite = sorted(x for x in owed if x != math.inf)
    if not finite:
        return None
    typical = finite[(len(finite) - 1) // 2]
    out = {
        j
        for j, x in enumerate(owed)
        if x > typical + size and x > typical + 2 * size - uncached_of(j)
    }
    return out or None


@pytest.mark.parametrize(
    ("ratio", "factor"),
    [
        (1.0, 1.0),
        (1.4, 1.0),  # under sqrt(2): the fastest class
        (1.42, 2.0),
        (2.0, 2.0),
        (2.8, 2.0),
        (2.9, 4.0),
        (2.0**29.4, 2.0**29),
        (2.0**29.6, 2.0**30),  # the cap
        (1e20, 2.0**30),
        (math.inf, 2.0**30),
    ],
)
def test_a_speed_class_is_the_ratio_rounded_to_a_power_of_two_and_capped(ratio, factor):
    """A candidate `ratio` times slower than the fastest: its backlog counts `factor` times.
    Seen through the rule: it is left exactly when its backlog x factor passes the limit."""
    ws = [Worker(f"http://10.0.0.{i}:8000", models=("m",)) for i in range(3)]
    slow = 1.0 / ratio if ratio != math.inf else 5e-324
    ws[2].backlog = math.floor(LIMIT / factor)  # x factor: at most LIMIT, so not left
    assert congested(ws, [1.0, 1.0, slow], SIZE, lambda j: OWN) is None
    ws[2].backlog = math.floor(LIMIT / factor) + 1
    assert congested(ws, [1.0, 1.0, slow], SIZE, lambda j: OWN) == {2}


def test_the_fast_form_agrees_with_the_rule_as_first_written():
    """Random fleets (backlogs, paces over six speed classes or within one, some of
    weight 0, some holding part of the prompt): the same candidates left as by log2,
    round and pow (but within a few floating-point steps of a class boundary, 2 **
    (k + 1/2), where either side is as right: random paces do not land there)."""
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(1, 12)
        ws = [Worker(f"http://10.0.0.{i}:8000", models=("m",)) for i in range(n)]
        for w in ws:
            w.backlog = rng.choice([0, rng.randrange(0, 20 * SIZE)])
        speeds = [rng.choice([0.0, 1.0]) * 2.0 ** rng.uniform(-6, 0) for _ in ws]
        if rng.random() < 0.7:  # mostly no weight 0 (the fast forms)
            speeds = [s or 1.0 for s in speeds]
        if rng.random() < 0.3:  # one kind of worker: paces within a class
            speeds = [2.0 ** rng.uniform(-0.49, 0) for _ in ws]
        own = [rng.choice([SIZE, OWN, 0]) for _ in ws]
        expected = _reference(ws, speeds, SIZE, own.__getitem__)
        assert congested(ws, speeds, SIZE, own.__getitem__) == expected
        # None: each would prefill the whole prompt.
        whole = _reference(ws, speeds, SIZE, lambda j: SIZE)
        assert congested(ws, speeds, SIZE, None) == whole

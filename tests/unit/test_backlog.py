"""The prefill backlog rule (dispatch/backlog.py), table-driven: which candidates a later
turn leaves, measured from what a typical candidate owes."""

from __future__ import annotations

import math

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

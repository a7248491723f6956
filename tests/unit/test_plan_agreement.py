"""The plan agreement simulation (benchmarks/plan_agreement.py) measures what it says."""

from __future__ import annotations

from benchmarks.plan_agreement import SHAPES, Shape, run


def test_it_is_deterministic_and_one_replica_never_differs():
    shape = SHAPES[0]
    first = run(shape, 3, 2)
    assert first == run(shape, 3, 2)
    one = run(shape, 3, 1)
    assert one["differ"] == 0.0 and one["builds"] >= 1
    assert first["differ"] > 0.0  # two replicas measure their own halves: they differ at times


def test_replicas_with_one_preamble_agree_and_its_load_is_even():
    """One preamble with all the traffic: every worker, in every replica, at every request."""
    shape = Shape("one", (1, 1, 1, 1), 1, 1.0, 40, (2, 5))
    figures = run(shape, 0, 2)
    assert figures["differ"] == 0.0 and figures["moves"] == 0.0
    assert abs(figures["maxload"] - 1.0) < 1e-9

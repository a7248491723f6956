"""The plan agreement simulation (benchmarks/plan_agreement.py) measures what it says."""

from __future__ import annotations

import pytest

from benchmarks.plan_agreement import SHAPES, Shape, main, run


def test_it_is_deterministic_and_two_replicas_differ_at_times():
    shape = SHAPES[0]
    first = run(shape, 3, 2)
    assert first == run(shape, 3, 2)
    assert first["differ"] > 0.0  # two replicas measure their own halves: they differ at times
    assert first["moves"] > 0.0  # and plans made from few samples are made again
    # The plan's schedule (after 32, 64, 128... of a replica's requests) made several.
    assert first["builds"] >= 3


def test_replicas_with_one_preamble_agree_and_its_load_is_even():
    """One preamble with all the traffic: every worker, in every replica, at every request."""
    shape = Shape("one", (1, 1, 1, 1), 1, 1.0, 40, (2, 5))
    figures = run(shape, 0, 2)
    assert figures["differ"] == 0.0 and figures["moves"] == 0.0
    assert figures["maxload"] == pytest.approx(1.0)


def test_maxload_is_against_each_workers_part_of_the_cache():
    """One preamble on both workers, caches 3:1: each carries half the traffic, twice the
    small one's part (a quarter)."""
    shape = Shape("one", (3, 1), 1, 1.0, 40, (2, 5))
    assert run(shape, 0, 1)["maxload"] == pytest.approx(2.0)


def test_a_json_path_it_cannot_write_is_refused_before_the_runs(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["plan_agreement", "--json", "/nonexistent/dir/x.json"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2 and "--json" in capsys.readouterr().err

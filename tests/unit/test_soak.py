"""The soak's CI variant: a few hundred concurrent streams with random client disconnects
and one worker killed and restarted, through real gateway and worker processes.

benchmarks/soak.py holds the harness and states what "nothing lost, nothing leaked" means;
`scripts/soak` runs the long one (thousands of streams).
"""

from __future__ import annotations

import pytest

from benchmarks.soak import SoakConfig, render, run_soak

pytestmark = pytest.mark.timeout(120)


async def test_soak_loses_and_leaks_nothing(capsys):
    cfg = SoakConfig(
        streams=300,
        duration=10.0,
        warmup=2.0,
        restart_at=0.3,  # killed 3 s in, back about 2 s later: traffic must come back to it
        tpot_ms=100.0,  # 4 to 24 tokens: each stream lasts 0.4 to 2.4 s
        restart_down=2.0,
        settle_timeout=15.0,
    )
    report = await run_soak(cfg)
    with capsys.disabled():
        print("\n" + render(cfg, report))
    o = report.outcomes
    assert o["lost"] == 0 and o["hung"] == 0, report.errors
    assert sum(o.values()) == report.started > 1000  # every request has exactly one outcome
    assert o["completed"] > report.started / 2 and o["left"] > 0
    # The restart happened under load: some requests met it, and said so cleanly.
    assert o["clean_error"] > 0
    assert report.worker_stats[0]["received"] > 0  # the restarted worker serves again
    assert report.inflight_end == 0 and report.worker_running_end == 0
    assert report.clients_end == 0 and report.upstream_end <= 2 * cfg.workers
    assert report.fds_end <= report.fds_start + 2
    assert report.rss_end <= report.rss_start * (1 + cfg.rss_slack)
    assert report.ok, report.problems

"""Demand and the desired worker count: table tests of the arithmetic, and the autoscaler's
time-based rules (window, cooldown, commands in flight) with a scripted clock."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_gateway.config.gateway import AutoscaleConfig, ScaleRule
from vllm_gateway.fleet.autoscale import Autoscaler
from vllm_gateway.fleet.demand import desired_workers, measure
from vllm_gateway.workers import EngineStats, WorkerRegistry, WorkerState


@pytest.mark.parametrize(
    ("demand", "current", "expected"),
    [
        (0, 0, 1),  # the minimum
        (0, 3, 1),  # no demand: down to the minimum
        (10, 1, 1),  # exactly one worker's worth
        (11, 1, 2),  # more than one worker carries at the target: up
        (35, 2, 4),  # up by as many as needed
        (500, 2, 6),  # never above the maximum
        (20, 3, 3),  # would fit on 2 at the target, not at 70 % of it: stay (hysteresis)
        (14, 3, 2),  # fits on 2 at 70 %: down
        (14.1, 3, 3),
        (3, 4, 1),
    ],
)
def test_desired_workers_table(demand, current, expected):
    got = desired_workers(demand, current, target=10, down_fraction=0.7, minimum=1, maximum=6)
    assert got == expected


def test_a_long_queue_wait_asks_for_one_more_and_demand_needs_one():
    kw = {"target": 10, "down_fraction": 0.7, "minimum": 0, "maximum": None}
    assert desired_workers(5, 2, queue_wait=6, queue_wait_up=5, **kw) == 3
    assert desired_workers(5, 2, queue_wait=4, queue_wait_up=5, **kw) == 1
    assert desired_workers(0.5, 0, **kw) == 1  # some demand: never zero workers
    assert desired_workers(0, 0, **kw) == 0


def make_registry(*loads: tuple[str, float, float, int]) -> WorkerRegistry:
    """Workers of model m: (state, running, waiting, inflight) each."""
    registry = WorkerRegistry()
    for i, (state, running, waiting, inflight) in enumerate(loads):
        w, _ = registry.add(f"http://w{i}", models=["m"])
        registry.set_state(w, WorkerState(state), "test")
        registry.set_stats(w, EngineStats(running, waiting, None, 0.0))
        w.inflight = inflight
    return registry


def test_measure_adds_up_reported_load_inflight_and_the_queue():
    registry = make_registry(
        ("ready", 4, 2, 3),  # load 6 (reported beats in flight)
        ("joining", 0, 0, 0),  # capacity coming
        ("draining", 9, 0, 2),  # not capacity; its 2 in flight are still demand
        ("unhealthy", 0, 0, 0),
    )
    d = measure("m", registry.serving("m"), queued=5, queue_wait=1.5)
    assert (d.workers, d.ready, d.inflight, d.queued) == (2, 1, 5, 5)
    assert (d.running, d.waiting) == (4, 2)
    assert d.demand == 6 + 2 + 5


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def autoscaler(registry, clock, **changes) -> Autoscaler:
    rule = ScaleRule(
        min_workers=1, max_workers=4, scale_up_command="true", scale_down_command="true"
    )
    config = AutoscaleConfig(
        enabled=True,
        target_per_worker=10,
        cooldown=5,
        scale_up_window=0,
        scale_down_window=30,
        startup_grace=60,
        models={"m": rule},
    )
    return Autoscaler(registry, dataclasses.replace(config, **changes), clock=clock)


def set_inflight(registry: WorkerRegistry, total: int) -> None:
    workers = [w for w in registry if w.state is WorkerState.READY]
    for i, w in enumerate(workers):
        w.stats = None
        w.inflight = total // len(workers) + (1 if i < total % len(workers) else 0)


async def test_scales_up_at_once_down_after_the_window_with_cooldown_between():
    registry = make_registry(("ready", 0, 0, 0))
    clock = Clock()
    a = autoscaler(registry, clock)
    set_inflight(registry, 25)
    await a.step()
    assert [(e.direction, e.index, e.result) for e in a.events] == [
        ("up", 2, "ok"),
        ("up", 3, "ok"),
    ]
    assert a.signals["m"].desired == 3 and a.current["m"] == 3  # started ones count at once

    # Not registered yet: still counted (startup grace), so nothing is started twice.
    clock.now += 10
    await a.step()
    assert len(a.events) == 2 and a.current["m"] == 3

    # They register; demand falls. Down waits for the window (30 s of low readings).
    for i in (1, 2):
        w, _ = registry.add(f"http://new{i}", models=["m"])
        registry.set_state(w, WorkerState.READY, "test")
    set_inflight(registry, 2)
    for _ in range(5):
        clock.now += 5
        await a.step()
    assert len(a.events) == 2 and a.recommended["m"] == 1 and a.signals["m"].desired == 3
    clock.now += 25
    await a.step()
    assert [(e.direction, e.index) for e in a.events][2:] == [("down", 3), ("down", 2)]

    # Right after a command, the cooldown holds the next one back.
    set_inflight(registry, 40)
    await a.step()
    assert len(a.events) == 4 and a.signals["m"].desired == 4
    clock.now += 5
    await a.step()
    assert [(e.direction, e.index) for e in a.events][4:] == [("up", 2), ("up", 3), ("up", 4)]


async def test_one_noisy_reading_does_not_scale_up():
    registry = make_registry(("ready", 0, 0, 0))
    clock = Clock()
    a = autoscaler(registry, clock, scale_up_window=1.0)
    for total in (5, 5, 30, 5, 5, 30, 30, 30, 30):
        set_inflight(registry, total)
        clock.now += 0.3
        await a.step()
    # The spikes at 30 were single readings; the last run of 30 outlasted the window.
    assert [(e.direction, e.index) for e in a.events] == [("up", 2), ("up", 3)]


async def test_dry_run_and_other_processes_and_failures():
    registry = make_registry(("ready", 0, 0, 0))
    clock = Clock()
    set_inflight(registry, 30)

    dry = autoscaler(registry, clock, dry_run=True)
    await dry.step()
    assert {e.result for e in dry.events} == {"dry_run"} and dry.commands_run == 0

    other = Autoscaler(registry, autoscaler(registry, clock).config, process_index=1, clock=clock)
    await other.step()
    assert not other.events and other.signals["m"].desired == 3  # signals, no commands

    failing = autoscaler(
        registry,
        clock,
        models={"m": ScaleRule(max_workers=4, scale_up_command="exit 3")},
    )
    await failing.step()
    assert [e.result for e in failing.events] == ["exit 3"]  # stops at the first failure
    assert failing.command_failures == 1 and "m" not in failing.commanded


async def test_placeholders_are_filled_in(tmp_path):
    registry = make_registry(("ready", 0, 0, 0))
    set_inflight(registry, 15)
    out = tmp_path / "calls"
    rule = ScaleRule(max_workers=4, scale_up_command=f"echo {{model}} {{index}} {{count}} >> {out}")
    a = autoscaler(registry, Clock(), models={"m": rule})
    await a.step()
    assert out.read_text() == "m 2 1\n"


def test_a_shared_workers_load_counts_under_the_model_its_requests_asked_for():
    registry = WorkerRegistry()
    w, _ = registry.add("http://shared", models=["a", "b"])
    registry.set_state(w, WorkerState.READY, "test")
    registry.set_stats(w, EngineStats(6, 2, None, 0.0))
    w.inflight, w.inflight_by_model = 4, {"a": 4}  # every request in flight asked for "a"
    a, b = (measure(m, registry.serving(m)) for m in ("a", "b"))
    assert (a.inflight, a.demand, a.running, a.waiting) == (4, 8, 6, 2)
    assert (b.inflight, b.demand, b.running, b.waiting) == (0, 0, 0, 0)
    assert a.workers == b.workers == 1  # capacity for both all the same

    w.inflight, w.inflight_by_model = 4, {"a": 1, "b": 3}
    a, b = (measure(m, registry.serving(m)) for m in ("a", "b"))
    assert (a.inflight, b.inflight) == (1, 3) and (a.demand, b.demand) == (2, 6)

    # Nothing in flight from the gateway (another client, or a stale report): an even
    # split, so the load is counted once in all.
    w.inflight, w.inflight_by_model = 0, {}
    a, b = (measure(m, registry.serving(m)) for m in ("a", "b"))
    assert a.demand == b.demand == 4

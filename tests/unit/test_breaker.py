"""The passive circuit breaker, driven by scripted lease outcomes."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import wait_until
from vllm_gateway.config.gateway import BreakerConfig
from vllm_gateway.dispatch import dispatcher as dispatch
from vllm_gateway.dispatch.dispatcher import Dispatcher, Lease
from vllm_gateway.dispatch.policies import make_policy
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.fleet.breaker import CircuitBreaker
from vllm_gateway.workers import Circuit, WorkerRegistry, WorkerState

pytestmark = pytest.mark.timeout(10)

INFO = RequestInfo("/v1/completions", b"{}", "m", False, "r1")


def setup(failures: int = 3, open_seconds: float = 0.1):
    registry = WorkerRegistry()
    worker, _ = registry.add("http://w1", models=["m"])
    other, _ = registry.add("http://w2", models=["m"])  # so w1 is not the last one
    registry.set_state(worker, WorkerState.READY, "test")
    registry.set_state(other, WorkerState.READY, "test")
    dispatcher = Dispatcher(registry, make_policy("round_robin"))
    breaker = CircuitBreaker(registry, BreakerConfig(failures=failures, open_seconds=open_seconds))
    return registry, worker, dispatcher, breaker


def finish(breaker, dispatcher, worker, outcome=dispatch.OK, status=200):
    lease = Lease(dispatcher, worker, INFO)
    lease.outcome = outcome
    lease.status = status
    breaker.on_release(lease)


@pytest.mark.parametrize(
    ("outcome", "status", "counts"),
    [
        (dispatch.UNREACHABLE, 0, True),
        (dispatch.CONNECT_TIMEOUT, 0, True),  # counts, though it does not take the worker out
        (dispatch.BROKEN, 200, True),
        (dispatch.TIMEOUT, 0, True),
        (dispatch.OK, 500, True),
        (dispatch.OK, 503, True),
        (dispatch.OK, 200, False),
        (dispatch.OK, 400, False),  # the client's mistake says nothing against the worker
        (dispatch.OK, 429, False),
        (dispatch.CLIENT_GONE, 0, False),
    ],
)
async def test_what_counts_as_a_failure(outcome, status, counts):
    _, worker, dispatcher, breaker = setup(failures=3)
    for _ in range(3):
        finish(breaker, dispatcher, worker, outcome, status)
    assert (worker.circuit is Circuit.OPEN) is counts
    assert worker.available is not counts


async def test_opens_after_failures_in_a_row_only():
    _, worker, dispatcher, breaker = setup(failures=3)
    for _ in range(5):  # a success between failures resets the count
        finish(breaker, dispatcher, worker, dispatch.BROKEN)
        finish(breaker, dispatcher, worker, dispatch.BROKEN)
        finish(breaker, dispatcher, worker)
    assert worker.circuit is Circuit.CLOSED and worker.breaker_openings == 0
    for _ in range(3):
        finish(breaker, dispatcher, worker, dispatch.OK, 502)
    assert worker.circuit is Circuit.OPEN and worker.breaker_openings == 1
    assert not worker.available
    assert worker.state is WorkerState.READY  # the state is the prober's; the circuit is apart


async def test_half_open_lets_one_trial_through_then_closes_on_success():
    registry, worker, dispatcher, breaker = setup(failures=2, open_seconds=0.05)
    finish(breaker, dispatcher, worker, dispatch.BROKEN)
    finish(breaker, dispatcher, worker, dispatch.BROKEN)
    assert worker.circuit is Circuit.OPEN
    await wait_until(lambda: worker.circuit is Circuit.HALF_OPEN, timeout=2)
    assert worker.available
    other = registry.get("http://w2")
    async with dispatcher.lease(INFO, exclude=[other]) as lease:
        assert lease.worker is worker
        assert not worker.available  # one trial at a time
        assert dispatcher.choose(INFO) is other
    finish(breaker, dispatcher, worker)
    assert worker.circuit is Circuit.CLOSED and worker.available


async def test_failed_trial_reopens_and_counts_another_opening():
    _, worker, dispatcher, breaker = setup(failures=2, open_seconds=0.05)
    finish(breaker, dispatcher, worker, dispatch.OK, 500)
    finish(breaker, dispatcher, worker, dispatch.OK, 500)
    await wait_until(lambda: worker.circuit is Circuit.HALF_OPEN, timeout=2)
    finish(breaker, dispatcher, worker, dispatch.BROKEN)
    assert worker.circuit is Circuit.OPEN and worker.breaker_openings == 2
    await wait_until(lambda: worker.circuit is Circuit.HALF_OPEN, timeout=2)
    breaker.stop()


async def test_disabled_breaker_never_opens():
    _, worker, dispatcher, breaker = setup(failures=0)
    for _ in range(50):
        finish(breaker, dispatcher, worker, dispatch.BROKEN)
    assert worker.circuit is Circuit.CLOSED and worker.available


async def test_the_last_available_worker_of_a_model_is_never_cut_off():
    registry, worker, dispatcher, breaker = setup(failures=2, open_seconds=0.05)
    other = registry.get("http://w2")
    registry.set_state(other, WorkerState.DRAINING, "test")
    for _ in range(5):
        finish(breaker, dispatcher, worker, dispatch.BROKEN)
    assert worker.circuit is Circuit.CLOSED and worker.available
    # With another worker back, the next failure opens it.
    registry.set_state(other, WorkerState.READY, "test")
    finish(breaker, dispatcher, worker, dispatch.BROKEN)
    assert worker.circuit is Circuit.OPEN
    # A failed trial while it has become the last one closes it instead of reopening.
    await wait_until(lambda: worker.circuit is Circuit.HALF_OPEN, timeout=2)
    registry.set_state(other, WorkerState.UNHEALTHY, "test")
    finish(breaker, dispatcher, worker, dispatch.OK, 500)
    assert worker.circuit is Circuit.CLOSED


async def test_removed_worker_does_not_half_open():
    registry, worker, dispatcher, breaker = setup(failures=1, open_seconds=0.02)
    finish(breaker, dispatcher, worker, dispatch.BROKEN)
    registry.remove(worker.url, "test")
    await asyncio.sleep(0.1)
    assert worker.circuit is Circuit.OPEN and worker.state is WorkerState.REMOVED


async def test_transitions_are_logged_once(logs):
    _, worker, dispatcher, breaker = setup(failures=2)
    for _ in range(6):
        finish(breaker, dispatcher, worker, dispatch.BROKEN)
    records = logs.records("worker circuit")
    assert len(records) == 1, records
    assert records[0]["new"] == "open" and "2 failed requests in a row" in records[0]["reason"]
    assert records[0]["level"] == "warning"  # capacity lost: what an operator alerts on
    breaker.stop()


async def test_log_levels_follow_meaning_losing_capacity_warns_recovery_informs(logs):
    registry, worker, _, breaker = setup()
    before = len(logs.records())
    registry.set_state(worker, WorkerState.UNHEALTHY, "probe failed")
    registry.set_state(worker, WorkerState.READY, "probe passed")
    registry.set_circuit(worker, Circuit.OPEN, "failures")
    registry.set_circuit(worker, Circuit.HALF_OPEN, "open time passed")
    registry.set_circuit(worker, Circuit.CLOSED, "trial passed")
    seen = [
        (r["event"], r["new"], r["level"])
        for r in logs.records()[before:]
        if r["event"] in ("worker state", "worker circuit")
    ]
    assert seen == [
        ("worker state", "unhealthy", "warning"),
        ("worker state", "ready", "info"),
        ("worker circuit", "open", "warning"),
        ("worker circuit", "half_open", "info"),
        ("worker circuit", "closed", "info"),
    ]
    breaker.stop()


@pytest.mark.parametrize("state", [WorkerState.READY, WorkerState.DRAINING])
async def test_an_unreachable_worker_is_out_at_once_even_the_last_one(state):
    registry = WorkerRegistry()
    worker, _ = registry.add("http://w1", models=["m"])  # the only worker of "m"
    registry.set_state(worker, state, "test")
    dispatcher = Dispatcher(registry, make_policy("round_robin"))
    breaker = CircuitBreaker(registry, BreakerConfig(failures=3))
    finish(breaker, dispatcher, worker, dispatch.UNREACHABLE)
    if state is WorkerState.READY:  # one refused connection: unhealthy until a probe passes
        assert worker.state is WorkerState.UNHEALTHY and not worker.available
    else:  # a draining worker stays draining (its drain decides when it leaves)
        assert worker.state is WorkerState.DRAINING
    assert worker.circuit is Circuit.CLOSED  # the circuit is the breaker's count, apart


async def test_half_open_workers_are_not_others_that_can_serve():
    """With the other workers half-open (one trial each, at most), the failing worker is
    still the last one that takes the model's traffic: its circuit stays closed."""
    registry, worker, dispatcher, breaker = setup(failures=2, open_seconds=60)
    other = registry.get("http://w2")
    third, _ = registry.add("http://w3", models=["m"])
    registry.set_state(third, WorkerState.READY, "test")
    for w in (other, third):
        registry.set_circuit(w, Circuit.HALF_OPEN, "test")
    assert other.available and third.available  # no trial out yet
    for _ in range(3):  # 5xx answers (an unreachable worker is taken out by its state)
        finish(breaker, dispatcher, worker, dispatch.OK, 500)
    assert worker.circuit is Circuit.CLOSED
    # Once one of them closes (its trial succeeded), the failing worker may open.
    registry.set_circuit(other, Circuit.CLOSED, "test")
    finish(breaker, dispatcher, worker, dispatch.OK, 500)
    assert worker.circuit is Circuit.OPEN
    breaker.stop()

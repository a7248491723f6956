"""Fleet.retire: drain, then remove at the release of the last lease; wait_idle woken by it."""

from __future__ import annotations

import asyncio
import random

import pytest

from vllm_gateway.dispatch.dispatcher import Dispatcher
from vllm_gateway.dispatch.policies import make_policy
from vllm_gateway.dispatch.request_info import parse_request
from vllm_gateway.fleet.operations import Fleet
from vllm_gateway.workers import Source, WorkerRegistry, WorkerState

pytestmark = pytest.mark.timeout(10)


class Prober:
    def forget(self, url: str) -> None:
        pass

    async def probe_one(self, worker) -> None:
        pass


def setup():
    registry = WorkerRegistry()
    worker, _ = registry.add("http://w0", models=("m",))
    registry.set_state(worker, WorkerState.READY, "test")
    dispatcher = Dispatcher(registry, make_policy("queue", random.Random(0)))
    fleet = Fleet(registry, Prober())  # type: ignore[arg-type]
    dispatcher.on_release.append(fleet.on_release)
    return registry, worker, dispatcher, fleet


def info():
    return parse_request("/v1/completions", b'{"model": "m"}', "r", {})


def test_source_is_a_str_enum_that_compares_with_strings():
    registry = WorkerRegistry()
    worker, _ = registry.add("http://w", source="registered")  # type: ignore[arg-type]
    assert worker.source is Source.REGISTERED and worker.source == "registered"
    assert f"{worker.source}" == "registered" and Source("dns") is Source.DNS


async def test_an_idle_worker_is_removed_at_once():
    registry, worker, _, fleet = setup()
    assert fleet.retire(worker, "gone") is True
    assert registry.get(worker.url) is None and worker.state_reason == "gone"
    assert fleet.retire(worker, "gone") is True  # idempotent


async def test_a_busy_worker_leaves_at_the_release_of_its_last_lease():
    registry, worker, dispatcher, fleet = setup()
    first = dispatcher.lease(info())
    second = dispatcher.lease(info())
    await first.__aenter__()
    await second.__aenter__()
    assert fleet.retire(worker, "dropped") is False
    assert fleet.retire(worker, "dropped again") is False  # idempotent: the first reason stays
    assert worker.state is WorkerState.DRAINING and fleet.retiring == {worker.url: "dropped"}
    await first.__aexit__(None, None, None)
    assert registry.get(worker.url) is worker  # one request still in flight
    await second.__aexit__(None, None, None)
    assert registry.get(worker.url) is None  # in the same step as the release: no polling
    assert worker.state_reason == "dropped" and fleet.retiring == {}


async def test_taken_back_before_idle_stays():
    registry, worker, dispatcher, fleet = setup()
    async with dispatcher.lease(info()):
        fleet.retire(worker, "dropped")
        assert fleet.unretire(worker, "listed again") is True
        assert worker.state is WorkerState.JOINING
    assert registry.get(worker.url) is worker and fleet.retiring == {}
    # An operator's undrain also calls a retirement off.
    registry.set_state(worker, WorkerState.READY, "probe passed")
    async with dispatcher.lease(info()):
        fleet.retire(worker, "dropped")
        assert await fleet.undrain(worker) is True
    assert registry.get(worker.url) is worker


async def test_wait_idle_is_woken_by_the_release_and_bounded_by_its_timeout():
    _, worker, dispatcher, fleet = setup()
    lease = dispatcher.lease(info())
    await lease.__aenter__()
    assert await fleet.wait_idle(worker, 0.05) is False  # timed out, in flight still
    waiting = asyncio.create_task(fleet.wait_idle(worker, 5))
    await asyncio.sleep(0)
    assert not waiting.done()
    await lease.__aexit__(None, None, None)
    await asyncio.sleep(0)  # one step of the loop: no 20 ms poll
    assert waiting.done() and waiting.result() is True
    assert fleet._idle_waiters == {}
    assert await fleet.wait_idle(worker, 0) is True  # idle already

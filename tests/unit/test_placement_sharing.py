"""What a process does with its siblings' and peers' lines (process/placement_sharing.py):
requests counted on their workers, bounded; ends that open the gate serve the queue; a
worker only named (`choose`) left with nothing counted."""

from __future__ import annotations

import random

import pytest

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.buckets import PROBE_START
from vllm_gateway.dispatch.dispatcher import Dispatcher
from vllm_gateway.dispatch.policies import make_policy
from vllm_gateway.dispatch.request_info import parse_request
from vllm_gateway.process.placement_sharing import (
    DONE,
    LOAD,
    OTHERS_SPAN,
    _applier,
    share_placements,
)
from vllm_gateway.workers import WorkerRegistry, WorkerState

pytestmark = pytest.mark.timeout(10)


def fleet(policy: str = "cache_aware"):
    registry = WorkerRegistry()
    w, _ = registry.add("http://w0", models=("m",))
    registry.set_state(w, WorkerState.READY, "test")
    d = Dispatcher(registry, make_policy(policy, random.Random(0)), config=DispatchConfig())
    return registry, w, d


class Feed:
    """Stands for a PlacementFeed: keeps what was published."""

    def __init__(self) -> None:
        self.lines: list[tuple] = []

    def publish(self, *line) -> None:
        self.lines.append(line)


@pytest.mark.parametrize("max_num_seqs", [0, 3])
def test_a_peers_requests_count_on_their_worker_at_most_a_span_of_its_capacity(max_num_seqs):
    """Starts told with no end (a bug, a lost link, a hostile token holder) move the count
    only so far: OTHERS_SPAN x the capacity (configured, else the probing start)."""
    registry, w, d = fleet()
    w.max_num_seqs = max_num_seqs
    apply = _applier(d, registry)
    for _ in range(1000):
        apply("m", w.url, LOAD, 0, ())
    assert w.others == OTHERS_SPAN * (max_num_seqs or PROBE_START)
    apply("m", w.url, DONE, 0, ())
    assert w.others == OTHERS_SPAN * (max_num_seqs or PROBE_START) - 1
    apply("m", "http://unknown", LOAD, 0, ())  # a worker not known here: nothing to count
    apply("m", "http://unknown", DONE, 0, ())
    w.others = 100.0  # a scrape's page showed more: the cap bounds what is told, not that
    apply("m", w.url, LOAD, 0, ())
    assert w.others == 100.0


def test_an_end_serves_the_queue_only_when_it_opens_the_gate(monkeypatch):
    """A told end runs the admission queue only when the worker was full and is no more;
    an end below the capacity, or one with nothing counted, does nothing more."""
    registry, w, d = fleet()
    w.max_num_seqs = 2
    served: list[str] = []
    monkeypatch.setattr(d, "room_opened", lambda worker: served.append(worker.url))
    apply = _applier(d, registry)
    w.inflight = 1
    apply("m", w.url, LOAD, 0, ())
    apply("m", w.url, LOAD, 0, ())
    assert d.buckets.is_full(w)
    apply("m", w.url, DONE, 0, ())  # 1 + 1 of 2: still full
    assert served == [] and d.buckets.is_full(w)
    apply("m", w.url, DONE, 0, ())  # 1 + 0: open
    assert served == [w.url]
    apply("m", w.url, DONE, 0, ())  # nothing counted: nothing ends
    assert served == [w.url] and w.others == 0


@pytest.mark.parametrize("policy", ["cache_aware", "queue"])
async def test_a_worker_only_named_is_told_with_nothing_left_counted(policy):
    """`choose` (FastChat's /get_worker_address) names a worker with no lease here: its
    cache_aware placement is told (recorded by the others) with its end at once, so the
    receivers count nothing that no end would ever take off; another policy tells
    nothing. A leased request is told once, and its end when the lease is released."""
    registry, w, d = fleet(policy)
    feed = Feed()
    share_placements(d, registry, lambda apply: feed, None)  # type: ignore[arg-type,return-value]
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 3000 + b'"}]}'
    request = parse_request("/v1/chat/completions", body, "r1", {})
    assert d.choose(request) is w
    shared = [line[2] for line in feed.lines]
    if policy == "cache_aware":  # the placement (a count of what it shares: >= -1), ended
        assert len(shared) == 2 and shared[0] >= -1 and shared[1] == DONE
        assert feed.lines[0][4]  # its block names, for the others' index
    else:
        assert shared == []
    feed.lines.clear()
    async with d.lease(parse_request("/v1/chat/completions", body, "r2", {})):
        expected = (lambda x: x >= -1) if policy == "cache_aware" else (lambda x: x == LOAD)
        assert len(feed.lines) == 1 and expected(feed.lines[0][2])
    assert len(feed.lines) == 2 and feed.lines[1][2] == DONE

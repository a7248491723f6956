"""Policies, table-driven with a scripted random source."""

from __future__ import annotations

import random

import pytest

from vllm_gateway.policies import POLICIES, check_policy_name, make_policy
from vllm_gateway.request_info import parse_request
from vllm_gateway.workers import EngineStats, Worker, WorkerState

INFO = parse_request("/v1/completions", b'{"model": "m"}', "r")


def workers(*inflight: int) -> list[Worker]:
    out = []
    for i, n in enumerate(inflight):
        w = Worker(f"http://w{i}", models=("m",))
        w.state = WorkerState.READY
        w.inflight = n
        out.append(w)
    return out


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_picks_from_candidates_or_none(name):
    p = make_policy(name, random.Random(1))
    ws = workers(0, 1, 2)
    for _ in range(20):
        assert p.select(ws, INFO) in ws
    assert p.select([], INFO) is None


def test_round_robin_spreads_evenly():
    p = make_policy("round_robin", random.Random(0))
    ws = workers(0, 0, 0)
    picks = [p.select(ws, INFO) for _ in range(30)]
    assert {ws.index(w): picks.count(w) for w in ws} == {0: 10, 1: 10, 2: 10}


def test_least_inflight_picks_the_idlest():
    p = make_policy("least_inflight", random.Random(0))
    ws = workers(3, 1, 2)
    assert p.select(ws, INFO) is ws[1]


def test_queue_policy_counts_reported_and_recent_sends():
    p = make_policy("queue", random.Random(0))
    ws = workers(0, 0)
    ws[0].stats = EngineStats(running=4, waiting=6, kv_cache_usage=0.5, at=0.0)
    ws[1].stats = EngineStats(running=4, waiting=0, kv_cache_usage=0.5, at=0.0)
    assert p.select(ws, INFO) is ws[1]
    ws[1].sent_since_scrape = 7  # a burst just went there
    assert p.select(ws, INFO) is ws[0]


def test_unknown_policy_is_named_with_choices():
    problem = check_policy_name("fastest")
    assert problem and "round_robin" in problem
    assert check_policy_name("shortest_queue") is None

"""Policies, table-driven, with a scripted random source."""

from __future__ import annotations

import random
from collections import Counter

import orjson
import pytest

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.policies import POLICIES, check_policy_name, make_policy
from vllm_gateway.dispatch.policies.affinity import ranked
from vllm_gateway.dispatch.request_info import parse_request
from vllm_gateway.workers import EngineStats, Worker, WorkerState

INFO = parse_request("/v1/completions", b'{"model": "m"}', "r")


class Scripted(random.Random):
    """A random source that answers from a script, so a test states every draw."""

    def __init__(self, *draws: float) -> None:
        super().__init__(0)
        self.draws = list(draws)

    def randrange(self, n: int, *args: object) -> int:  # type: ignore[override]
        value = int(self.draws.pop(0))
        assert 0 <= value < n, (value, n)
        return value

    def random(self) -> float:
        return float(self.draws.pop(0))


def workers(*inflight: int, pace: float = 0.0) -> list[Worker]:
    out = []
    for i, n in enumerate(inflight):
        w = Worker(f"http://w{i}", models=("m",))
        w.state = WorkerState.READY
        w.inflight = n
        w.pace = pace
        out.append(w)
    return out


def chat(session: str | None = None, text: str = "hi", user: str | None = None):
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if user:
        body["user"] = user
    headers = {"x-session-id": session} if session else {}
    return parse_request("/v1/chat/completions", orjson.dumps(body), "r", headers)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_picks_from_candidates_or_none(name):
    p = make_policy(name, random.Random(1))
    ws = workers(0, 1, 2)
    for _ in range(20):
        assert p.select(ws, INFO) in ws
        assert p.select(ws[1:2], INFO) is ws[1]
    assert p.select([], INFO) is None


@pytest.mark.parametrize(
    ("name", "load_aware"),
    [
        ("queue", True),
        ("least_inflight", True),
        ("power_of_two", True),
        ("session", True),
        ("prefix", True),
        ("round_robin", False),
        ("random", False),
        ("shortest_queue", True),
        ("lottery", False),
    ],
)
def test_aliases_and_load_awareness(name, load_aware):
    assert check_policy_name(name) is None
    assert make_policy(name).load_aware is load_aware


def test_unknown_policy_is_named_with_choices():
    problem = check_policy_name("fastest")
    assert problem and "round_robin" in problem and "lottery" in problem


@pytest.mark.parametrize("n", [1, 2, 5, 30, 31])
def test_round_robin_spreads_within_one(n):
    p = make_policy("round_robin", random.Random(0))
    ws = workers(0, 9, 0)  # load is ignored
    counts = Counter(p.select(ws, INFO) for _ in range(n))
    shares = [counts[w] for w in ws]
    assert sum(shares) == n and max(shares) - min(shares) <= 1


def test_least_inflight_picks_the_idlest_per_weight():
    p = make_policy("least_inflight", random.Random(0))
    ws = workers(3, 1, 2)
    assert p.select(ws, INFO) is ws[1]
    ws[0].weight = 4.0  # 3 / 4 < 1
    assert p.select(ws, INFO) is ws[0]


def test_ties_are_broken_by_the_random_source():
    ws = workers(1, 0, 0, 0)
    # Reservoir over the three tied workers: keep w1, replace by w2 (draw 0), keep (draw 1).
    assert make_policy("least_inflight", Scripted(0, 1)).select(ws, INFO) is ws[2]
    assert make_policy("least_inflight", Scripted(1, 0)).select(ws, INFO) is ws[3]


@pytest.mark.parametrize(
    ("reported", "sent", "finished", "inflight", "expected_load"),
    [
        ((4, 6), 0, 0, 0, 10),  # what the worker said
        ((4, 0), 7, 0, 7, 11),  # plus what was sent since
        ((4, 0), 0, 3, 1, 1),  # minus what finished since
        ((0, 0), 0, 0, 5, 5),  # never below the gateway's own in-flight count
        (None, 9, 0, 2, 2),  # no report: in-flight only
    ],
)
def test_load_view(reported, sent, finished, inflight, expected_load):
    from vllm_gateway.dispatch.load import load

    (w,) = workers(inflight)
    if reported:
        w.stats = EngineStats(running=reported[0], waiting=reported[1], kv_cache_usage=0.5, at=0)
    w.sent_since_scrape, w.finished_since_scrape = sent, finished
    assert load(w) == expected_load


def test_queue_policy_counts_reported_and_recent_sends():
    p = make_policy("queue", random.Random(0))
    ws = workers(0, 0)
    ws[0].stats = EngineStats(running=4, waiting=6, kv_cache_usage=0.5, at=0.0)
    ws[1].stats = EngineStats(running=4, waiting=0, kv_cache_usage=0.5, at=0.0)
    assert p.select(ws, INFO) is ws[1]
    ws[1].sent_since_scrape = 7  # a burst just went there
    assert p.select(ws, INFO) is ws[0]


@pytest.mark.parametrize(
    ("loads", "paces", "weights", "expected"),
    [
        ((3, 3), (2.0, 1.0), (1, 1), 0),  # same load: the faster worker
        ((5, 2), (2.0, 1.0), (1, 1), 0),  # 6/2 = 3 = 3/1: tie -> scripted draw keeps w0
        ((6, 2), (2.0, 1.0), (1, 1), 1),  # 7/2 > 3/1: twice as fast is not more than twice
        ((3, 3), (0.0, 1.0), (1, 1), 0),  # no pace yet: scored with the best pace, tie
        ((0, 5), (1.0, 1.0), (0, 1), 1),  # weight 0 takes nothing while another can
    ],
)
def test_queue_policy_weighs_load_by_pace(loads, paces, weights, expected):
    ws = workers(*loads)
    for w, pace, weight in zip(ws, paces, weights, strict=True):
        w.pace, w.weight = pace, weight
    assert make_policy("queue", Scripted(1)).select(ws, INFO) is ws[expected]


@pytest.mark.parametrize(
    ("loads", "draws", "expected"),
    [
        ((3, 1, 2), (0, 0), 1),  # w0 vs w1 (the second draw skips the first index)
        ((3, 1, 2), (0, 1), 2),  # w0 vs w2
        ((3, 1, 2), (2, 0), 2),  # w2 vs w0
        ((3, 1, 2), (1, 1), 1),  # w1 vs w2
        ((1, 1, 0), (1, 0), 1),  # w1 vs w0, equal: the first draw stays; w2 was not drawn
    ],
)
def test_power_of_two_compares_two_distinct_draws(loads, draws, expected):
    ws = workers(*loads)
    assert make_policy("power_of_two", Scripted(*draws)).select(ws, INFO) is ws[expected]


@pytest.mark.parametrize(("draw", "expected"), [(0.0, 0), (0.2, 0), (0.3, 1), (0.99, 1)])
def test_random_follows_weights(draw, expected):
    ws = workers(0, 0)
    ws[0].weight, ws[1].weight = 1.0, 3.0  # w0 owns [0, 0.25) of the draws
    assert make_policy("random", Scripted(draw)).select(ws, INFO) is ws[expected]


@pytest.mark.parametrize("name", ["queue", "least_inflight", "power_of_two", "session", "prefix"])
def test_load_aware_policies_avoid_a_busy_worker(name):
    p = make_policy(name, random.Random(3))
    ws = workers(50, 0, 0)
    picks = Counter(p.select(ws, chat(session="s", text="t")) for _ in range(30))
    assert picks[ws[0]] == 0


def test_session_sticks_and_spreads():
    p = make_policy("session", random.Random(0))
    ws = workers(0, 0, 0, 0)
    homes = {}
    for i in range(200):
        key = f"user-{i}"
        first = p.select(ws, chat(session=key))
        assert all(p.select(ws, chat(session=key)) is first for _ in range(3))
        homes[key] = first
    spread = Counter(homes.values())
    assert len(spread) == 4 and min(spread.values()) > 25  # ~50 each
    # The body's `user` is a session key too, and the header wins over it.
    assert p.select(ws, chat(user="user-7")) is homes["user-7"]
    assert p.select(ws, chat(session="user-7", user="user-8")) is homes["user-7"]


def test_bounded_load_moves_a_hot_session():
    p = make_policy("session", random.Random(0), DispatchConfig(load_bound=1.25))
    ws = workers(3, 3, 3)
    home = p.select(ws, chat(session="hot"))
    home.inflight = 12  # 12 + 1 > ceil(1.25 * (12 + 3 + 3 + 1) / 3) = 8
    moved = p.select(ws, chat(session="hot"))
    assert moved is not home
    assert moved is ranked("hot", ws)[1]  # the key's second choice, always the same one
    home.inflight = 4  # 4 + 1 <= ceil(1.25 * 11 / 3) = 5: home again
    assert p.select(ws, chat(session="hot")) is home


def test_rendezvous_moves_only_the_keys_of_a_removed_worker():
    ws = workers(0, 0, 0, 0)
    before = {f"k{i}": ranked(f"k{i}", ws)[0] for i in range(300)}
    gone = ws[2]
    rest = [w for w in ws if w is not gone]
    for key, home in before.items():
        after = ranked(key, list(reversed(rest)))[0]  # order of candidates does not matter
        if home is not gone:
            assert after is home


def test_prefix_groups_shared_prompts():
    p = make_policy("prefix", random.Random(0), DispatchConfig(prefix_chars=64))
    ws = workers(0, 0, 0)
    system = "You are a helpful assistant for the ACME corporation. " * 3
    homes = {p.select(ws, chat(text=system + f"question {i}")) for i in range(20)}
    assert len(homes) == 1  # the first 64 characters are shared
    spread = Counter(p.select(ws, chat(text=f"{i} unrelated prompt")) for i in range(90))
    assert len(spread) == 3
    # A completions prompt works the same way.
    info = parse_request("/v1/completions", b'{"model": "m", "prompt": "abc"}', "r")
    assert p.select(ws, info) is p.select(ws, info)


def test_affinity_without_a_key_falls_back_to_least_wait():
    ws = workers(5, 0, 5)
    assert make_policy("session", random.Random(0)).select(ws, INFO) is ws[1]
    tokens = parse_request("/v1/completions", b'{"model": "m", "prompt": [1, 2, 3]}', "r")
    assert make_policy("prefix", random.Random(0)).select(ws, tokens) is ws[1]

"""A worker's cache pressure (workers.py `note_cache`) and how cache_aware weighs a new
conversation's home by it (pure, table by table)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from vllm_gateway.dispatch.policies.cache_aware import CacheAware
from vllm_gateway.dispatch.policies.pressure import SHARED_SECONDS
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import (
    PRESSURE_FLOOR,
    PRESSURE_SECONDS,
    EngineStats,
    Worker,
    WorkerRegistry,
    note_cache,
)


def stats(
    queries: float | None, hits: float | None, at: float, tokens: float | None
) -> EngineStats:
    return EngineStats(0, 0, None, at, tokens, queries, hits)


def decay(dt: float) -> float:
    return -math.expm1(-dt / PRESSURE_SECONDS)


@pytest.mark.parametrize(
    ("before", "now", "rate", "weighed"),
    [
        # 1000 tokens queried in 1 s, 100 missed: the first interval is the whole average.
        ((1000, 900, 0.0, 4000), (2000, 1800, 1.0, 4000), 100.0, True),
        ((1000, 900, 0.0, 4000), (2000, 1000, 0.5, 4000), 1800.0, True),  # 900 in 0.5 s
        ((1000, 900, 0.0, 4000), (1000, 900, 1.0, 4000), 0.0, True),  # idle: 0 missed
        ((5000, 900, 0.0, 4000), (2000, 1900, 1.0, 4000), 0.0, False),  # restarted: unknown
        ((1000, 900, 0.0, 4000), (2000, 2900, 1.0, 4000), 0.0, False),  # hits past queries
        ((1000, 900, 1.0, 4000), (2000, 1900, 1.0, 4000), 0.0, False),  # no time: no rate yet
        ((1000, 900, 0.0, None), (2000, 1800, 1.0, None), 100.0, False),  # no cache size
        ((1000, 900, 0.0, 4000), (2000, 1800, 1.0, math.inf), 100.0, False),
        ((None, None, 0.0, 4000), (2000, 1800, 1.0, 4000), 0.0, False),  # no counters before
        ((1000, 900, 0.0, 4000), (math.inf, 1800, 1.0, 4000), 0.0, False),  # nonsense counter
    ],
)
def test_a_workers_cache_pressure_is_its_missed_tokens_per_second_over_its_cache(
    before, now, rate, weighed
):
    w = Worker("http://10.0.0.1:8000", models=("m",))
    note_cache(w, stats(*before), stats(*now))
    assert w.miss_rate == pytest.approx(rate)
    if weighed:
        assert w.pressure == pytest.approx((rate + PRESSURE_FLOOR) / now[3])
    else:
        assert w.pressure == 0.0  # unknown: not weighed


def known_pressure() -> Worker:
    w = Worker("http://10.0.0.1:8000", models=("m",))
    note_cache(w, stats(1000, 900, 0.0, 4000), stats(2000, 1000, 1.0, 4000))
    assert w.pressure > 0 and w.miss_rate > 0
    return w


@pytest.mark.parametrize(
    "after",
    [
        stats(100, 50, 2.0, 4000),  # the counters went back: restarted, its cache empty
        stats(None, None, 2.0, 4000),  # the counters are gone
        stats(3000, 1500, 2.0, None),  # the cache size is gone (the rate stays)
    ],
)
def test_a_pressure_that_no_longer_holds_is_forgotten(after):
    w = known_pressure()
    note_cache(w, stats(2000, 1000, 1.0, 4000), after)
    assert w.pressure == 0.0


def test_a_stale_scrape_forgets_the_pressure():
    registry = WorkerRegistry()
    w, _ = registry.add("http://10.0.0.1:8000", models=("m",))
    registry.set_stats(w, stats(1000, 900, 0.0, 4000))
    registry.set_stats(w, stats(2000, 1000, 1.0, 4000))
    assert w.pressure > 0 and w.miss_rate > 0
    registry.set_stats(w, None)  # the scrape went stale
    assert w.pressure == 0.0 and w.miss_rate == 0.0


def test_the_rate_follows_a_worker_that_starts_evicting_with_its_time_constant():
    """Long idle, then 2000 tokens a second all missed: one time constant later the rate is
    1 - 1/e of the way there whatever the scrape interval, four later 98%."""
    for interval in (0.25, 1.0):
        w = Worker("http://10.0.0.1:8000", models=("m",))
        q, t = 0.0, 0.0
        for missed in (0.0, 2000.0):
            end = t + (8 if missed == 0 else 4) * PRESSURE_SECONDS
            while t < end - 1e-9:
                before = stats(q, 0.0, t, 1000)
                q, t = q + missed * interval, t + interval
                note_cache(w, before, stats(q, 0.0, t, 1000))
                if missed and abs(t - end + 3 * PRESSURE_SECONDS) < 1e-9:
                    assert w.miss_rate == pytest.approx(2000 * (1 - math.exp(-1)), rel=0.01)
        assert w.miss_rate == pytest.approx(2000 * (1 - math.exp(-4)), rel=0.01)
        assert w.pressure == pytest.approx((w.miss_rate + PRESSURE_FLOOR) / 1000)


def test_after_a_reset_the_first_readings_are_the_average_not_a_fraction_of_it():
    """A worker back from a stale scrape (or new) reads its rate from the first interval
    on, not 6% of it (which would read its cache as turning over 16 times slower, and draw
    every new conversation to it)."""
    registry = WorkerRegistry()
    w, _ = registry.add("http://10.0.0.1:8000", models=("m",))
    registry.set_stats(w, stats(0, 0, 0.0, 1000))
    registry.set_stats(w, stats(500, 0, 0.25, 1000))  # 2000 missed tokens/s
    assert w.miss_rate == pytest.approx(2000)
    registry.set_stats(w, None)  # stale
    registry.set_stats(w, stats(1000, 0, 10.0, 1000))
    registry.set_stats(w, stats(1250, 0, 10.25, 1000))  # 1000/s now
    assert w.miss_rate == pytest.approx(1000)


def workers(n: int) -> list[Worker]:
    return [Worker(f"http://10.0.0.{i}:8000", models=("m",)) for i in range(n)]


SYSTEM = "You answer from the attached manual. " * 60  # ~2.6 KB: a preamble


def first_turn(i: int, system: str = SYSTEM) -> RequestInfo:
    """A new conversation under `system`: with the default, a preamble it shares."""
    doc = {"model": "m", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": f"conversation {i}: " + "words " * 60}]}  # fmt: skip
    return RequestInfo("/v1/chat/completions", b"", "m", True, f"r{i}", {}, doc)


def homes_of(pressures: list[float], n: int = 2000, system: str = SYSTEM) -> list[int]:
    """Where each of `n` new conversations goes (its worker's index), one policy each
    (nothing recorded between them: the preamble is all of its traffic, so every worker
    takes it), on workers with these pressures (0: not reported), nothing in flight."""
    ws = workers(len(pressures))
    for w, p in zip(ws, pressures, strict=True):
        w.pressure = p
    out = []
    for i in range(n):
        policy = CacheAware(random.Random(0))
        info = first_turn(i, system)
        chosen = policy.select(ws, info)
        assert chosen is not None and info.placed in ("preamble", "home"), info.placed
        out.append(ws.index(chosen))
    return out


def homes(pressures: list[float], n: int = 2000, system: str = SYSTEM) -> Counter[int]:
    """How many of `n` new conversations each worker gets (`homes_of`)."""
    return Counter(homes_of(pressures, n, system))


@pytest.mark.parametrize(
    "pressures",
    [
        [1e-3, 1e-3, 1e-3, 1e-3],  # alike: an even split
        [2e-3, 1e-3],  # twice the pressure: a quarter of the other's share (0.2, 0.8)
        [1e-3, 1e-3, 3e-3],  # a ninth of each other's
        [1e-6, 1e-3],  # one whose cache turns over a thousand times faster: ~none
    ],
)
def test_new_conversations_go_where_caches_turn_over_least(pressures):
    """A new conversation's home is weighted rendezvous, each worker's rank times its
    pressure squared: the workers' shares go as 1 / pressure^2."""
    got = homes(pressures)
    n = sum(got.values())
    weights = [1 / p**2 for p in pressures]
    for j in range(len(pressures)):
        assert abs(got[j] / n - weights[j] / sum(weights)) < 0.04, got


def test_without_every_workers_pressure_the_key_alone_decides():
    """One worker reports no cache pressure (no counters, or no cache size): the figures
    of the others are not comparable with it, so none is weighed; the same homes as when
    none reports."""
    assert homes([1e-3, 0.0, 4e-3], 300) == homes([0.0, 0.0, 0.0], 300)
    plain = homes([0.0, 0.0, 0.0], 300)
    assert all(80 < plain[j] < 120 for j in range(3)), plain


def test_with_nothing_shared_the_key_alone_decides():
    """A conversation under no preamble (a system prompt under a block) is not weighed:
    measured on long private chats (`longchat`), weighing them did no better."""
    short = "Be brief."
    assert homes([1e-3, 4e-3, 4e-3], 300, short) == homes([0.0, 0.0, 0.0], 300, short)
    assert homes([1e-3, 4e-3, 4e-3], 300)[0] > 250  # (under a preamble: weighed)


def test_pressures_a_little_apart_keep_most_homes():
    """Figures 5% apart at random (the next scrapes of the same workers) move few new
    conversations' homes (weighted rendezvous moves only the keys whose two best weighed
    ranks are that close), while the weighing itself moves many from the plain order."""
    base = [1e-3, 2e-3, 5e-4, 1e-3, 3e-3]
    rng = random.Random(7)
    n = 1000
    a = homes_of(base, n)
    b = homes_of([p * rng.uniform(0.95, 1.05) for p in base], n)
    plain = homes_of([0.0] * 5, n)
    agree = sum(x == y for x, y in zip(a, b, strict=True)) / n
    moved = sum(x != y for x, y in zip(a, plain, strict=True)) / n
    assert agree > 0.9 and moved > 0.3, (agree, moved)


def test_behind_other_senders_the_key_alone_decides():
    """A candidate with requests from another sender (a replica, a sibling process) on
    it: a later turn may reach a replica that never saw this conversation, which takes
    the plain order, so the first turn takes it too; with none, it is weighed."""
    ws = workers(3)

    def placed() -> list[int]:
        out = []
        for i in range(300):
            chosen = CacheAware(random.Random(0)).select(ws, first_turn(i))
            assert chosen is not None
            out.append(ws.index(chosen))
        return out

    plain = placed()  # (no pressure reported yet)
    for w, p in zip(ws, [1e-3, 1e-3, 4e-3], strict=True):
        w.pressure = p
    alone = placed()
    ws[1].stats = EngineStats(0, 0, None, 100.0)  # its last scrape, at t=100 s
    ws[1].others_at = 100.0 - SHARED_SECONDS + 1  # another sender's request seen then
    behind = placed()
    ws[1].others_at = 100.0 - SHARED_SECONDS - 1  # ...and not since, a minute on
    again = placed()
    assert behind == plain and alone != plain and again == alone
    assert alone.count(2) < 20 and plain.count(2) > 70, (alone.count(2), plain.count(2))


def test_a_scrape_showing_another_senders_requests_marks_the_worker_shared():
    registry = WorkerRegistry()
    w, _ = registry.add("http://10.0.0.1:8000", models=("m",))
    registry.set_stats(w, EngineStats(3, 0, None, 5.0), own=3)  # all its requests ours
    assert w.others == 0 and w.others_at == -math.inf
    registry.set_stats(w, EngineStats(5, 1, None, 7.0), own=3)  # three more: another's
    assert w.others == 3 and w.others_at == 7.0
    registry.set_stats(w, EngineStats(2, 0, None, 9.0), own=3)
    assert w.others == 0 and w.others_at == 7.0  # (remembered)


def test_a_popular_preambles_conversations_are_weighed_among_its_planned_workers_only():
    """Two equally popular preambles on four workers are planned two workers each
    (preamble_plan.py); the pressure decides between a preamble's two workers, never
    sends a conversation past them, and leaves the plan as it was."""
    systems = [f"manual number {s}: " + "read it closely. " * 150 for s in range(2)]

    def placed(pressures: list[float]) -> dict[int, Counter[int]]:
        ws = workers(4)
        for w, p in zip(ws, pressures, strict=True):
            w.pressure = p
        policy = CacheAware(random.Random(0))
        where: dict[int, Counter[int]] = {0: Counter(), 1: Counter()}
        for i in range(600):
            s = i % 2
            chosen = policy.select(ws, first_turn(i, systems[s]))
            assert chosen is not None
            if i >= 200:  # once the shares are counted and the plan made
                where[s][ws.index(chosen)] += 1
        return where

    plain = placed([0.0] * 4)
    pairs = {s: set(on) for s, on in plain.items()}
    assert all(len(pair) == 2 for pair in pairs.values()) and not pairs[0] & pairs[1], plain
    # In each pair, one worker's cache turns over ten times as fast as the other's.
    pressures = [0.0] * 4
    for pair in pairs.values():
        low, high = sorted(pair)
        pressures[low], pressures[high] = 1e-3, 1e-2
    weighed = placed(pressures)
    for s, on in weighed.items():
        assert set(on) <= pairs[s], (s, on, pairs)  # never past its planned workers
        low = min(pairs[s])
        assert on[low] > 0.95 * sum(on.values()), (s, on)  # shares 100 : 1


def test_a_history_held_by_two_workers_goes_to_the_one_whose_cache_turns_over_slower():
    """A conversation held on two workers (its turn went to a second while the first was
    full): its next turn, under a preamble, takes the holders' order weighed by pressure,
    as a new conversation does, not the plain order."""
    ws = workers(6)
    policy = CacheAware(random.Random(0))
    to_low = 0
    for c in range(20):
        user = f"conversation {c}: " + "a long question. " * 300  # longer than the preamble
        first = {"model": "m", "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}  # fmt: skip
        a = policy.select(ws, RequestInfo("/v1/chat/completions", b"", "m", True, "a", {}, first))
        rest = [w for w in ws if w is not a]
        b = policy.select(rest, RequestInfo("/v1/chat/completions", b"", "m", True, "b", {}, first))
        assert a is not None and b is not None and a is not b
        answer = {"role": "assistant", "content": "an answer"}
        later = {"model": "m", "messages": [*first["messages"], answer,
                                            {"role": "user", "content": "more"}]}  # fmt: skip
        for w in ws:
            w.pressure = 1e-3
        a.pressure = 1e-1  # a's cache turns over a hundred times as fast as b's
        info = RequestInfo("/v1/chat/completions", b"", "m", True, "c", {}, later)
        chosen = policy.select(ws, info)
        assert chosen in (a, b) and info.placed == "history", (chosen, info.placed)
        to_low += chosen is b
        for w in ws:
            w.pressure = 0.0
    assert to_low >= 18, to_low  # weighed shares 10^4 : 1 (plain: `a`, the key's first)


def test_a_stray_goes_back_to_the_planned_worker_whose_cache_turns_over_slower():
    """A first turn sent past its preamble's planned pair (both left out by the gate) copies the
    preamble elsewhere; its next turn, with a history shorter than the preamble, goes back
    to the pair (1a, `_back_home`), taking the pair's order weighed by cache pressure as
    a new conversation does: to the cooler of the two."""
    systems = [f"manual number {s}: " + "read it closely. " * 150 for s in range(2)]
    ws = workers(4)
    policy = CacheAware(random.Random(0))
    where: Counter[int] = Counter()
    for i in range(400):  # the shares counted and the plan made: two workers each
        chosen = policy.select(ws, first_turn(i, systems[i % 2]))
        assert chosen is not None
        if i >= 200 and i % 2 == 0:
            where[ws.index(chosen)] += 1
    pair = [ws[j] for j in where]
    assert len(pair) == 2, where
    cool, hot = pair
    back: Counter[str] = Counter()
    for c in range(20):
        first = first_turn(1000 + c, systems[0])
        stray = policy.select([w for w in ws if w not in pair], first)
        assert stray is not None and stray not in pair
        later_doc = {"model": "m", "messages": [
            {"role": "system", "content": systems[0]},
            {"role": "user", "content": f"conversation {1000 + c}: " + "words " * 60},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "and then?"}]}  # fmt: skip
        for w in ws:
            w.pressure = 1e-3
        hot.pressure = 1e-2  # its cache turns over ten times as fast as `cool`'s
        info = RequestInfo("/v1/chat/completions", b"", "m", True, f"l{c}", {}, later_doc)
        chosen = policy.select(ws, info)
        assert info.placed == "back" and chosen in pair, (info.placed, chosen)
        back["cool" if chosen is cool else "hot"] += 1
        for w in ws:
            w.pressure = 0.0
    assert back["cool"] >= 18, back  # weighed shares 100 : 1 (plain: by each key's order)

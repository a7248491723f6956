"""Bytes per token, measured per worker (dispatch/kv_queue.py `TokenBytes`), and the prefix
index sized by it once measured (dispatch/prefix_index.py)."""

from __future__ import annotations

import orjson
import pytest

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.buckets import Buckets
from vllm_gateway.dispatch.prefix_hash import BLOCK_BYTES, prefix_blocks
from vllm_gateway.dispatch.prefix_index import BYTES_PER_TOKEN, PrefixIndex, capacity_of
from vllm_gateway.http.routes import describe_worker
from vllm_gateway.workers import EngineStats, Worker, WorkerRegistry, WorkerState


def setup() -> tuple[WorkerRegistry, Worker, Buckets]:
    registry = WorkerRegistry()
    worker, _ = registry.add("http://w", models=("m",))
    registry.set_state(worker, WorkerState.READY, "test")
    buckets = Buckets(DispatchConfig())
    registry.stats_listeners.append(buckets.on_stats)
    return registry, worker, buckets


def play(
    scrapes: list[tuple[int, int, float, float]], start: tuple[float, float] = (0.0, 0.0)
) -> float:
    """Per scrape, 0.25 s apart: (requests this process sent since the last one, their
    bytes each, prompt tokens the worker looked up since, requests it finished since);
    the worker's counters start at `start`. Returns `Worker.token_bytes` after the last."""
    registry, w, b = setup()
    queries, done = start
    registry.set_stats(w, EngineStats(0, 0, None, 0.0, prompt_tokens=queries, requests_done=done))
    for i, (sent, size, tokens, finished) in enumerate(scrapes, 1):
        for _ in range(sent):
            b.take(w, True, size)
        queries, done = queries + tokens, done + finished
        stats = EngineStats(0, 0, None, 0.25 * i, prompt_tokens=queries, requests_done=done)
        registry.set_stats(w, stats)
    return w.token_bytes


@pytest.mark.parametrize(
    ("scrapes", "figure"),
    [
        # One sender: 4000-byte bodies of 1000-token prompts.
        ([(4, 4000, 4000.0, 4.0)] * 8, 4.0),
        # Two replicas alternating: this one sends half the requests the worker counts, of
        # the same mix; the figure is the same.
        ([(2, 4000, 4000.0, 4.0)] * 8, 4.0),
        # The worker counts a prompt when its prefill starts and the request when it ends:
        # counts out of step with the sends, the same mean over the window.
        ([(4, 10_000, 0.0, 0.0), (4, 10_000, 4000.0, 0.0), (0, 0, 0.0, 4.0)] * 6, 10.0),
        # Too few requests yet on either side: not known.
        ([(1, 4000, 1000.0, 1.0)] * 4, 0.0),  # few sent, few finished
        ([(1, 4000, 4000.0, 4.0)] * 4, 0.0),  # few sent, many finished (other senders')
        ([(4, 4000, 1000.0, 1.0)] * 4, 0.0),  # many sent, few finished yet
        # Fewer than one prompt token a request: the counters say nothing of prompts.
        ([(4, 4000, 0.0, 4.0)] * 8, 0.0),
        ([(4, 4000, 2.0, 4.0)] * 8, 0.0),
    ],
)
def test_bytes_per_token_are_the_mean_body_over_the_mean_prompt(scrapes, figure):
    assert play(scrapes) == pytest.approx(figure, rel=0.02)


def test_the_figure_is_right_from_the_first_reading_while_long_answers_ramp_up():
    """4 requests a second of 1000-token prompts in 10 000-byte bodies, each decoding for
    10 s: the worker counts each prompt when it starts and the request 10 s later. Counted
    by the finished alone, the first readings said 1.7 bytes a token (clamped to 2, the
    index would keep a fifth of the cache); with the growth of the running requests, 10."""
    registry, w, b = setup()
    readings = []
    for i in range(200):  # 50 s, a scrape every 0.25 s, one request sent before each
        b.take(w, True, 10_000)
        started = i + 1
        done = float(max(0, started - 40))  # each ends 40 scrapes (10 s) after it started
        stats = EngineStats(
            started - done, 0, None, 0.25 * i, prompt_tokens=1000.0 * started, requests_done=done
        )
        registry.set_stats(w, stats)
        if w.token_bytes:
            readings.append(w.token_bytes)
    assert readings and all(x == pytest.approx(10.0, rel=0.05) for x in readings)


def test_the_figure_follows_a_new_mix_and_starts_over_when_the_worker_restarts():
    old = [(4, 4000, 4000.0, 4.0)] * 40  # 4 bytes per token for 10 s
    new = [(4, 12_000, 4000.0, 4.0)] * 480  # then 12 for 120 s: four half-lives
    assert play(old + new) == pytest.approx(12.0, rel=0.1)
    restarted = [*old, (4, 4000, -10_000.0, -100.0)]  # its counters went back
    assert play(restarted, start=(50_000.0, 500.0)) == 0.0
    assert play(restarted + old, start=(50_000.0, 500.0)) == pytest.approx(4.0)


def test_without_the_counters_nothing_is_measured():
    registry, w, b = setup()
    for i in range(20):
        b.take(w, True, 4000)
        registry.set_stats(w, EngineStats(0, 0, None, 0.25 * i, prompt_tokens=1000.0 * i))
    assert w.token_bytes == 0.0


def test_a_known_figure_holds_through_a_quiet_spell_and_a_page_without_the_counters():
    """Once measured, the figure stays while the evidence thins (nothing sent for an hour:
    the sums decay under the threshold) or a page lacks a counter for a scrape, rather
    than the index's size flapping between the measured figure and 16."""
    busy = [(4, 4000, 4000.0, 4.0)] * 40
    assert play(busy + [(0, 0, 0.0, 0.0)] * 14_400) == pytest.approx(4.0)
    registry, w, b = setup()
    at = 0.0
    for i in range(41):
        b.take(w, True, 4000)
        at += 0.25
        tokens, done = (1000.0 * i, float(i)) if i != 20 else (None, None)
        registry.set_stats(w, EngineStats(0, 0, None, at, prompt_tokens=tokens, requests_done=done))
        if i > 10:
            assert w.token_bytes == pytest.approx(4.0), i


@pytest.mark.parametrize(
    ("binds", "token_bytes", "per_token"),
    [
        (False, 0.0, BYTES_PER_TOKEN),  # nothing measured yet: counted high
        (True, 0.0, BYTES_PER_TOKEN),  # binding, the figure not known yet
        (False, 10.0, 10.0),  # measured: at the figure, binding or not
        (True, 10.0, 10.0),
        (False, 40.0, BYTES_PER_TOKEN),  # never more than before it was measured
        (True, 0.5, 2.0),  # nor less than 2 bytes a token
    ],
)
def test_a_workers_index_is_sized_at_its_measured_bytes_per_token(binds, token_bytes, per_token):
    w = Worker("http://w", models=("m",))
    w.stats = EngineStats(0, 0, 0.5, 0.0, cache_tokens=10_240.0)
    w.kv_binds, w.token_bytes = binds, token_bytes
    assert capacity_of(w) == int(10_240 * per_token // BLOCK_BYTES)


def test_the_index_forgets_the_document_the_workers_cache_had_no_room_for():
    """A cache of 5000 tokens at 10 bytes a token holds two documents of 2560 tokens (25
    KiB): sent a third, the worker evicted the first, whether or not it ever kept a request
    waiting for blocks. Counted high (16 bytes a token, nothing measured) the index still
    names it a holder; sized at the measured figure, it does not."""
    docs = [(f"document {d} " * 3000)[: 25 * BLOCK_BYTES + 100] for d in range(3)]
    blocks = [prefix_blocks({"prompt": doc}) for doc in docs]
    held = []
    for measured in (0.0, 10.0):
        w = Worker("http://w", models=("m",))
        w.stats = EngineStats(0, 0, 0.5, 0.0, cache_tokens=5000.0)
        w.token_bytes = measured  # (kv_binds stays False: an evicting cache need not bind)
        index = PrefixIndex()
        for b in blocks:
            assert b is not None
            index.record(w, b)
        held.append([index.deepest(b.blocks, [w])[1] > 0 for b in blocks if b is not None])
    assert held == [[True, True, True], [False, True, True]]


def test_an_index_filled_before_the_figure_was_measured_shrinks_at_the_next_record():
    """Three documents remembered while nothing was measured for the worker; once the
    figure is, the next request recorded there evicts the least recently sent past its
    measured size."""
    docs = [(f"document {d} " * 3000)[: 25 * BLOCK_BYTES + 100] for d in range(3)]
    blocks = [prefix_blocks({"prompt": doc}) for doc in docs]
    w = Worker("http://w", models=("m",))
    w.stats = EngineStats(0, 0, 0.5, 0.0, cache_tokens=5000.0)
    index = PrefixIndex()
    for b in blocks:
        assert b is not None
        index.record(w, b)
    assert index.blocks_of(w) == 75  # 25 names each, under 5000 x 16 / 1024 = 78
    w.token_bytes = 10.0
    assert blocks[2] is not None
    index.record(w, blocks[2])  # the latest again
    assert index.blocks_of(w) == capacity_of(w) == 48
    assert [index.deepest(b.blocks, [w])[1] > 0 for b in blocks if b is not None] == [
        False,
        True,
        True,
    ]


def test_list_workers_shows_the_kv_figures_as_json():
    """`kv_free` and `token_bytes` are null while not counted or measured (never inf)."""
    w = Worker("http://w", models=("m",))
    plain = orjson.loads(orjson.dumps(describe_worker(w, 0.0)))
    assert (plain["kv_binds"], plain["kv_free"], plain["token_bytes"]) == (False, None, None)
    w.kv_binds, w.kv_free, w.token_bytes = True, 1234.0, 9.876
    shown = orjson.loads(orjson.dumps(describe_worker(w, 0.0)))
    assert (shown["kv_binds"], shown["kv_free"], shown["token_bytes"]) == (True, 1234.0, 9.88)
    # The learned prefill time per KiB owed (prefill_rate.py): null until a first byte.
    assert plain["prefill_ms_per_kib"] is None
    w.prefill_seconds, w.prefill_bytes = 0.05, 1024.0
    shown = orjson.loads(orjson.dumps(describe_worker(w, 0.0)))
    assert shown["prefill_ms_per_kib"] == 50.0

"""The dispatch benchmark's workloads: arrival processes, families, the hit-rate reading."""

from __future__ import annotations

import random

import pytest

from benchmarks.cache_stats import _SAMPLE, hit_rate, per_worker, total
from benchmarks.dispatch_report import doc_key
from benchmarks.families import (
    AGENT_SESSIONS,
    CHAT_DOCS,
    DOCS,
    FAMILIES,
    LONG_RANGE,
    RAG_CONVERSATIONS,
    RAG_DOC_WORDS,
    RAG_DOCS,
    Sizes,
    agent,
    bigbatch,
    docchat,
    docqa,
    longchat,
    longprompt,
    multiturn,
    ragchat,
)
from benchmarks.placements import (
    brief,
    count,
    inside,
    later_turns,
    moved,
    plan_moves,
    prefill,
    prefill_brief,
)
from benchmarks.traffic import render
from benchmarks.workload import WorkerSpec, bursts, poisson
from vllm_gateway.fake_worker.metrics import CacheInfo, EngineMetrics

SIZES = Sizes(warmup=3, duration=15, load=0.7, cache_share=0.5)


def test_poisson_and_bursts_keep_their_rates() -> None:
    rng = random.Random(1)
    assert 900 < len(list(poisson(rng, 10.0, 0.0, 100.0))) < 1100
    arrivals = list(bursts(rng, base=5.0, peak=50.0, period=5.0, length=1.0, end=500.0))
    in_bursts = sum(1 for t in arrivals if t % 5.0 < 1.0)
    assert arrivals == sorted(arrivals)
    assert 4000 < in_bursts < 6000  # 100 s of bursts at 50/s
    assert 1600 < len(arrivals) - in_bursts < 2400  # 400 s at 5/s


def test_capacity_follows_the_workers() -> None:
    fast, slow = WorkerSpec(40, 20, 16), WorkerSpec(80, 40, 16)
    assert fast.capacity(51) == pytest.approx(16 / 1.04)
    assert slow.capacity(51) == pytest.approx(fast.capacity(51) / 2)


def test_families_are_deterministic_per_seed() -> None:
    for make in FAMILIES.values():
        family = make(SIZES)
        one, two = family.build(random.Random(5)), family.build(random.Random(5))
        assert one == two and one != family.build(random.Random(6))
        assert all(0 <= c.start < SIZES.warmup + SIZES.duration for c in one)


def test_longchat_shares_nothing_but_each_conversations_own_history() -> None:
    family = longchat(SIZES)
    conversations = family.build(random.Random(0))
    assert len(conversations) == 110
    assert {len(c.turns) for c in conversations} <= set(range(6, 17))
    # One system prompt, shorter than a KV block (16 words): no prefix shared across them.
    (system,) = {c.system for c in conversations}
    assert len(system.split()) < 16
    assert len({c.turns[0].user for c in conversations}) == 110
    fast = [w for w in family.workers if w.tpot_ms == 20]
    slow = [w for w in family.workers if w.tpot_ms == 40]
    assert len(fast) == 4 and len(slow) == 2
    assert all(w.prefill_ms_per_token == 2 * fast[0].prefill_ms_per_token for w in slow)
    bigger = longchat(Sizes(3, 15, 0.7, cache_share=1.0)).workers[0].num_gpu_blocks
    assert bigger == pytest.approx(2 * family.workers[0].num_gpu_blocks, abs=1)


def test_multiturn_cache_holds_a_share_of_every_conversation() -> None:
    family = multiturn(SIZES)
    conversations = family.build(random.Random(0))
    assert len(conversations) == 80 and {len(c.turns) for c in conversations} == {6}
    assert len({c.system for c in conversations}) == 4
    blocks = {w.num_gpu_blocks for w in family.workers}
    assert len(family.workers) == 4 and len(blocks) == 1
    (per_worker,) = blocks
    bigger = multiturn(Sizes(3, 15, 0.7, cache_share=1.0)).workers[0].num_gpu_blocks
    assert per_worker is not None and bigger is not None
    assert bigger == pytest.approx(2 * per_worker, abs=1)


def test_docqa_quotes_popular_documents_first_in_the_user_message() -> None:
    from collections import Counter

    family = docqa(SIZES)
    requests = family.build(random.Random(0))
    assert all(len(c.turns) == 1 for c in requests) and len(requests) > 200
    docs = Counter(c.turns[0].user.split(":", 1)[0] for c in requests)
    assert set(docs) <= {f"Document {i}" for i in range(DOCS)} and len(docs) > DOCS // 2
    assert docs.most_common(1)[0][0] == "Document 0"  # Zipf: the first is the most popular
    assert len({c.turns[0].user for c in requests}) == len(requests)  # each its question
    assert {len(c.system) for c in requests} == {len("You are a helpful assistant.")}


def test_docchat_quotes_one_document_first_then_asks_about_it() -> None:
    from collections import Counter

    family = docchat(SIZES)
    conversations = family.build(random.Random(0))
    assert len(conversations) == 60 and {len(c.turns) for c in conversations} == {5}
    firsts = Counter(c.turns[0].user.split(":", 1)[0] for c in conversations)
    assert set(firsts) <= {f"Doc {i}" for i in range(CHAT_DOCS)} and len(firsts) > 2
    assert firsts.most_common(1)[0][0] == "Doc 0"  # Zipf: the first is the most popular
    assert not any(t.user.startswith("Doc ") for c in conversations for t in c.turns[1:])
    (blocks,) = {w.num_gpu_blocks for w in family.workers}
    assert len(family.workers) == 3 and blocks is not None
    assert blocks < 3 * 2000 // 16  # a worker's cache holds fewer than three documents


def test_agent_runs_long_sessions_mostly_under_one_system_prompt_on_a_mixed_fleet() -> None:
    from collections import Counter

    family = agent(SIZES)
    sessions = family.build(random.Random(0))
    assert len(sessions) == AGENT_SESSIONS
    assert {len(c.turns) for c in sessions} <= set(range(2, 17))
    assert max(len(c.turns) for c in sessions) >= 10
    systems = Counter(c.system for c in sessions).most_common()
    assert len(systems) == 3 and systems[0][1] > len(sessions) / 2
    speeds = Counter((w.tpot_ms, w.max_num_seqs) for w in family.workers)
    assert speeds == {(20, 16): 4, (40, 8): 2}
    lengths = [len(t.user.split()) for c in sessions for t in c.turns]
    assert min(lengths) >= 4 and max(lengths) > 5 * sorted(lengths)[len(lengths) // 2]


def test_ragchat_puts_one_of_many_popular_documents_in_each_conversations_system_prompt() -> None:
    from collections import Counter

    family = ragchat(SIZES)
    conversations = family.build(random.Random(0))
    assert len(conversations) == RAG_CONVERSATIONS
    assert {len(c.turns) for c in conversations} <= set(range(3, 9))
    docs = Counter(c.system for c in conversations)
    assert len(docs) > RAG_DOCS // 2 and all(d.startswith("Context ") for d in docs)
    assert docs.most_common(1)[0][0].startswith("Context 0:")  # Zipf: the first is the most used
    # The name says the document, for traces: rag<i>d<k> under "Context <k>:".
    assert all(c.system.startswith(f"Context {c.session.split('d')[1]}:") for c in conversations)
    assert not any("Context" in t.user for c in conversations for t in c.turns)
    speeds = Counter((w.tpot_ms, w.max_num_seqs) for w in family.workers)
    assert speeds == {(20, 16): 3, (40, 8): 2}
    (blocks,) = {w.num_gpu_blocks for w in family.workers}
    assert blocks is not None and 3 * RAG_DOC_WORDS < blocks * 16 < 4 * RAG_DOC_WORDS


def test_gpumix_has_two_gpu_generations_with_three_times_the_cache_on_the_fast_ones() -> None:
    from collections import Counter

    from benchmarks.families import MIX_BIG, MIX_CONVERSATIONS, MIX_DOCS, gpumix

    family = gpumix(SIZES)
    kinds = Counter((w.tpot_ms, w.max_num_seqs, w.num_gpu_blocks) for w in family.workers)
    (fast, slow) = sorted(kinds)
    assert kinds[fast] == kinds[slow] == 2 and slow[0] == 2 * fast[0]
    assert fast[2] == MIX_BIG * slow[2]  # the fast ones hold three times the blocks
    conversations = family.build(random.Random(0))
    assert len(conversations) == MIX_CONVERSATIONS
    docs = Counter(c.system for c in conversations)
    assert len(docs) > MIX_DOCS // 2 and docs.most_common(1)[0][0].startswith("Manual 0:")
    assert all(c.system.startswith(f"Manual {c.session.split('d')[1]}:") for c in conversations)


def test_bigbatch_runs_far_more_at_once_than_the_capacity_gate_first_assumes() -> None:
    from vllm_gateway.dispatch.buckets import PROBE_START

    family = bigbatch(SIZES)
    assert [w.max_num_seqs for w in family.workers] == [64, 32, 48]
    assert family.workers[2].tpot_ms == 2 * family.workers[0].tpot_ms  # one at half speed
    requests = family.build(random.Random(0))
    seconds = SIZES.warmup + SIZES.duration
    rate = len(requests) / seconds
    capacity = sum(w.capacity(24) for w in family.workers)  # answers 12-36 tokens, mean 24
    assert 0.9 < rate / (SIZES.load * capacity) < 1.1
    # Little's law: running at once = rate x time each runs (1.2 s on a fast worker, answers
    # of 24 tokens at 50 ms each; 2.4 s on the slow one): several times what the capacity
    # gate lets each worker run until it has seen it run more.
    assert rate * 1.2 > 3 * PROBE_START * len(family.workers)
    assert all(len(c.turns) == 1 and 12 <= c.turns[0].max_tokens <= 36 for c in requests)


def test_longprompt_sends_each_request_its_own_long_text() -> None:
    family = longprompt(SIZES)
    requests = family.build(random.Random(0))
    bodies = [c.turns[0].user for c in requests]
    heads = {b.split(": ", 1)[1].split()[0] for b in bodies}
    assert len(heads) == len(bodies)  # no two texts start alike: nothing to reuse
    lengths = sorted(len(b.split()) - 3 for b in bodies)  # ("Summarize text i:")
    low, high = LONG_RANGE
    assert low <= lengths[0] and lengths[-1] <= high
    assert 600 < lengths[len(lengths) // 2] < 1000 and lengths[-1] > 3 * lengths[len(lengths) // 2]
    speeds = [(w.tpot_ms, w.prefill_ms_per_token) for w in family.workers]
    assert speeds == [(20, 0.05)] * 3 + [(40, 0.1)]
    assert all(w.num_gpu_blocks is None for w in family.workers)


def test_the_doc_block_of_a_run_names_its_replicas_and_gateway_processes() -> None:
    assert doc_key("multiturn", 1) == "multiturn r1"  # as before: existing blocks stay
    assert doc_key("multiturn", 2, 2) == "multiturn r2 p2"
    assert doc_key("docchat", 1, 1, kv_wait=True) == "docchat r1 kv"


def test_hit_rate_reads_the_fake_workers_counters() -> None:
    page = EngineMetrics("m", 0, legacy=False).render(
        running=0, waiting=0, usage=0.0, cache=CacheInfo(16, None, 200, 50),
        running_loras=[], waiting_loras=[],
    )  # fmt: skip
    assert dict(_SAMPLE.findall(page)) == {
        "vllm:prefix_cache_queries_total": "200.0",
        "vllm:prefix_cache_hits_total": "50.0",
    }
    assert hit_rate((100, 10), (300, 60)) == 0.25


def test_the_hit_rate_is_read_per_worker_and_for_the_fleet():
    before, after = [(100.0, 10.0), (50.0, 50.0)], [(300.0, 60.0), (50.0, 50.0)]
    assert hit_rate(total(before), total(after)) == 0.25  # the idle worker adds nothing
    rates = per_worker(before, after)
    assert rates[0] == {"queried": 200.0, "hit_rate": 0.25}
    assert rates[1]["queried"] == 0.0 and rates[1]["hit_rate"] != rates[1]["hit_rate"]  # NaN


def test_placements_count_the_access_log_lines_of_requests_that_reached_a_worker() -> None:
    """--placements: each finished request's `placed`, and how many waited in the gateway;
    other log lines (refusals, startup text, broken JSON) do not count."""
    line = '{"event": "request", "worker": "http://w", "placed": "%s", "waited": %s}'
    lines = [
        "fake worker listening on http://127.0.0.1:1",
        line % ("history", 0.0),
        line % ("history", 0.25),
        line % ("home", 0.0),
        '{"event": "request", "status": 404, "code": "model_not_found", "outcome": "rejected"}',
        '{"event": "request", "worker": "http://w", "placed": null, "waited": 0.0}',
        '{"event": "scrape failed", "worker": "http://w"}',
        '{"event": "request", "worker": ',
        "[1, 2]",
    ]
    counts = count(lines)
    assert counts == {"history": 2, "home": 1, "None": 1, "waited": 1}
    assert brief(counts) == "history:2/home:1/None:1;waited:1"
    assert brief(count([])) == "none;waited:0"


def test_prefill_joins_the_workers_request_logs_with_the_placements_by_request_id() -> None:
    """--placements: the tokens the workers prefilled, by the step that placed each request;
    a worker's line no access log line names counts as unlogged, broken lines not at all."""
    placed = '{"event": "request", "request_id": "%s", "worker": "http://w", "placed": "%s"}'
    gateway = [placed % ("a", "history"), placed % ("b", "only"), placed % ("c", "history")]
    gateway.append('{"event": "request", "request_id": "d", "status": 429, "outcome": "rejected"}')
    line = '{"event": "prefill", "request_id": "%s", "prompt_tokens": 2100, "uncached_tokens": %s}'
    workers = [
        "fake worker listening on http://127.0.0.1:1",
        line % ("a", 40),
        line % ("b", 2040),
        line % ("c", 0),
        line % ("d", 500),
        line % ("e", '"many"'),
        '{"event": "prefill", "request_id": ',
    ]
    tokens = prefill(gateway, workers)
    assert tokens == {"history": 40, "only": 2040, "unlogged": 500}
    assert prefill_brief(tokens) == "only:2040/unlogged:500/history:40"
    assert prefill_brief(prefill([], [])) == "none"


def test_moved_counts_later_turns_another_worker_prefilled_than_the_turn_before() -> None:
    """--placements: from the workers' request logs (any system in front), the later turns
    whose worker is not their turn before's; ids not <conversation>-t<turn>, broken lines
    and a turn with no line before it count nothing."""
    line = '{"event": "prefill", "request_id": "%s", "prompt_tokens": 9, "uncached_tokens": 9}'
    one = [line % "c1-t0", line % "c1-t1", line % "c2-t1", line % "c-t-t0", line % "gw-1-2"]
    two = [line % "c1-t2", line % "c2-t0", line % "c-t-t1", line % "c3-t5", "not json", "{"]
    three = [line % "c1-t3", line % "c1-tx"]
    # c1: t1 stays, t2 and t3 move; c2: t1 moves; "c-t": t1 moves; c3's t5 has no t4.
    assert moved([one, two, three]) == 4
    assert moved([one + two + three]) == 0  # one worker: nothing moves
    assert moved([]) == 0
    # A name with "-t" in it: the turn is what follows the last one.
    assert moved([[line % "a-t1-t0"], [line % "a-t1-t1"]]) == 1
    # A turn retried on a second worker has a line on each: it moved only if neither is
    # where its turn before was, whichever file lists it first.
    for files in ([[line % "r-t0", line % "r-t1"], [line % "r-t1"]],
                  [[line % "r-t1"], [line % "r-t0", line % "r-t1"]]):  # fmt: skip
        assert moved(files) == 0
    assert moved([[line % "r-t0"], [line % "r-t1"], [line % "r-t1"]]) == 1
    assert moved([[line % "u-t0"], [line % "u-t\u00b2"]]) == 0  # not an ASCII turn: skipped


def test_later_turns_tell_a_kept_history_from_an_evicted_one_and_a_move() -> None:
    """--placements: each later turn by what its worker held, from the workers' logs: on a
    worker of the turn before, finding at least half the turn before's prompt cached
    (kept) or less (evicted: that worker had dropped the history); elsewhere (moved).
    With the tokens each kind prefilled, a retry's lines all counted."""
    line = '{"event": "prefill", "request_id": "%s", "prompt_tokens": %d, "uncached_tokens": %d}'
    one = [line % ("a-t0", 100, 100), line % ("a-t1", 300, 60), line % ("a-t2", 500, 400)]
    one += [line % ("b-t0", 80, 80), line % ("r-t0", 50, 50), line % ("r-t1", 90, 90)]
    two = [line % ("b-t1", 200, 200), line % ("r-t1", 90, 40), line % ("z-t3", 9, 9)]
    two.append('{"event": "prefill", "request_id": "b-t2", "prompt_tokens": "x"}')
    turns, tokens = later_turns([one, two])
    # a: t1 kept (240 cached of the 100 before), t2 evicted (100 of the 300 before); b: t1
    # moved, t2 on b-t1's worker, its line's counts not numbers: nothing says evicted; r: t1
    # retried, judged on r-t0's worker (0 of 50 cached: evicted), both lines' tokens
    # counted; z: no t2 line, so t3 is not a later turn here.
    assert turns == {"kept": 2, "evicted": 2, "moved": 1}
    assert tokens == {"kept": 60, "evicted": 400 + 90 + 40, "moved": 200}
    assert moved([one, two]) == 1
    assert later_turns([]) == ({}, {})
    # A new message longer than the whole history before it is no eviction: 40 of the 40
    # before are cached, though 128 of its 168 tokens are prefilled.
    assert later_turns([[line % ("n-t0", 40, 40), line % ("n-t1", 168, 128)]])[0] == {"kept": 1}
    # Half the turn before's prompt cached is still kept; less is evicted.
    assert later_turns([[line % ("h-t0", 10, 10), line % ("h-t1", 30, 25)]])[0] == {"kept": 1}
    assert later_turns([[line % ("h-t0", 10, 10), line % ("h-t1", 30, 26)]])[0] == {"evicted": 1}


def test_inside_counts_requests_queued_inside_a_worker_and_their_waits() -> None:
    """--placements: the requests a worker kept queued (arrival to admission) over INSIDE
    seconds, counted and their waits summed, over every worker; an admission's own
    millisecond, lines without a numeric wait and broken lines count nothing."""
    line = '{"event": "prefill", "request_id": "r%d", "waited": %s}'
    one = [line % (1, "0.001"), line % (2, "0.25"), line % (3, '"0.5"'), "{"]
    two = [line % (4, "0.011"), line % (5, "1.0"), line % (6, "0.01"), "not json"]
    assert inside([one, two]) == "3/1.26s"
    assert inside([one]) == "1/0.25s"
    assert inside([]) == "0/0.00s"


def test_plan_moves_sums_models_and_takes_one_process_of_each() -> None:
    """A gateway's /metrics page: the moves of each model's plan, summed over models; with
    `--gateway-processes N`, the processes' figures of one model are one plan, not N."""
    page = "\n".join(
        [
            "# TYPE vllm_gateway_preamble_plan_moves_total counter",
            'vllm_gateway_preamble_plan_moves_total{model="a"} 3',
            'vllm_gateway_preamble_plan_moves_total{model="b \\"x\\""} 2',
            'vllm_gateway_preamble_plans_total{model="a"} 40',
            'vllm_gateway_preamble_plan_moves_total{model="c",process="0"} 5',
            'vllm_gateway_preamble_plan_moves_total{model="c",process="1"} 4',
            'vllm_gateway_preamble_plan_moves_total{model="d"} nonsense',
        ]
    )
    assert plan_moves(page) == 3 + 2 + 5
    assert plan_moves("") == 0


def test_completions_render_a_turn_as_one_prompt_the_next_turn_extends():
    """`--api completions`: each turn's messages as `role: content` lines and the answer's
    cue, so the next turn's prompt starts with this one's and the answer (as the fake
    worker caches them: prompt, then answer tokens)."""
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert render(first) == "system: Be brief.\nuser: Hi?\nassistant:"
    second = [
        *first,
        {"role": "assistant", "content": " w0 w1"},
        {"role": "user", "content": "So?"},
    ]
    assert render(second).startswith(render(first) + "  w0 w1\n")
    assert doc_key("ragchat", 1, api="completions") == "ragchat r1 completions"
    assert doc_key("ragchat", 1, api="chat") == "ragchat r1"

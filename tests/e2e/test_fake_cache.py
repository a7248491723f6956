"""The fake worker's prefix cache over real sockets: hits, eviction, usage, prefill cost.

Prompts are counted in the fake's tokens (one per word); blocks hold 16 of them unless a
test says otherwise. Timing tests assert bounds with wide margins, for a busy machine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from vllm_gateway.cli.main import main
from vllm_gateway.fake_worker import FakeWorker

MakeWorker = Callable[..., Awaitable[FakeWorker]]
FAST = {"ttft_ms": 5.0, "tpot_ms": 2.0}
REAL_PAGE = Path(__file__).parent.parent / "data" / "vllm_metrics_v1.txt"


def words(n: int, tag: str = "a") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def metrics(http: aiohttp.ClientSession, worker: FakeWorker) -> dict[str, Any]:
    """The page's families by name; `value(name)` of a family's first sample."""
    async with http.get(worker.url + "/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return {f.name: f for f in text_string_to_metric_families(await resp.text())}


async def counters(http: aiohttp.ClientSession, worker: FakeWorker) -> tuple[float, float]:
    """(tokens queried, tokens hit) since the worker started."""
    fams = await metrics(http, worker)
    return (
        fams["vllm:prefix_cache_queries"].samples[0].value,
        fams["vllm:prefix_cache_hits"].samples[0].value,
    )


async def usage(http: aiohttp.ClientSession, worker: FakeWorker) -> float:
    return (await metrics(http, worker))["vllm:kv_cache_usage_perc"].samples[0].value


async def complete(http: aiohttp.ClientSession, worker: FakeWorker, prompt: str) -> None:
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 2}
    async with http.post(worker.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200


async def hits_of(http: aiohttp.ClientSession, worker: FakeWorker, prompt: str) -> float:
    """Tokens of `prompt` the worker found cached."""
    _, before = await counters(http, worker)
    await complete(http, worker, prompt)
    _, after = await counters(http, worker)
    return after - before


async def first_token_after(
    http: aiohttp.ClientSession, worker: FakeWorker, prompt: str, started: float
) -> float:
    """Seconds from `started` (monotonic) to the first token of a streamed completion."""
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 2, "stream": True}
    async with http.post(worker.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        first = None
        async for _ in resp.content.iter_any():
            first = first or time.monotonic()
    assert first is not None
    return first - started


async def test_repeated_prompt_hits_all_but_its_last_block(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await fake_worker(**FAST)
    prompt = words(40)  # two full blocks and a partial one
    assert await hits_of(http, worker, prompt) == 0
    assert await hits_of(http, worker, prompt) == 32
    assert await counters(http, worker) == (80, 32)
    # A block-aligned prompt cached whole still computes its last token, as vLLM does:
    # its last block is not a hit.
    aligned = words(32, "b")
    await complete(http, worker, aligned)
    assert await hits_of(http, worker, aligned) == 16


async def test_shared_prefix_hits_only_the_shared_blocks(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await fake_worker(**FAST)
    shared = words(50, "sys")  # 3 full blocks (48 tokens) are shared, then the paths part
    await complete(http, worker, shared + " " + words(30, "q"))
    assert await hits_of(http, worker, shared + " " + words(30, "r")) == 48
    assert await hits_of(http, worker, words(80, "other")) == 0


async def test_chat_prefix_hits_and_roles_matter(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await fake_worker(**FAST)
    system = {"role": "system", "content": words(40, "sys")}

    async def chat(*messages: dict[str, str]) -> float:
        _, before = await counters(http, worker)
        body = {"model": "fake-model", "messages": list(messages), "max_tokens": 2}
        async with http.post(worker.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["prompt_tokens"] == 45
        return (await counters(http, worker))[1] - before

    assert await chat(system, {"role": "user", "content": "one two three four five"}) == 0
    assert await chat(system, {"role": "user", "content": "six seven eight nine ten"}) == 32
    # The same words said by the user are another prompt.
    as_user = {"role": "user", "content": system["content"]}
    assert await chat(as_user, {"role": "user", "content": "six seven eight nine ten"}) == 0


async def test_small_capacity_evicts_least_recently_used_blocks(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    # 4 blocks; each prompt below needs 3 while it runs (2 full + 1 partial) and leaves
    # 2 cached. A, then B, then C: C's admission evicts what A and B left, oldest first.
    worker = await fake_worker(num_gpu_blocks=4, **FAST)
    a, b, c = words(33, "a"), words(33, "b"), words(33, "c")
    for prompt in (a, b, c):
        await complete(http, worker, prompt)
    assert await hits_of(http, worker, c) == 32  # the newest is still cached
    assert await hits_of(http, worker, a) == 0  # the oldest was evicted
    unbounded = await fake_worker(**FAST)
    for prompt in (a, b, c):
        await complete(http, unbounded, prompt)
    assert await hits_of(http, unbounded, a) == 32


async def test_usage_counts_blocks_pinned_by_running_requests(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await fake_worker(num_gpu_blocks=10, ttft_ms=1, tpot_ms=150)
    prompt = words(40)  # 3 blocks: 2 full, shared once computed, and a private partial one
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 8, "stream": True}
    assert await usage(http, worker) == 0.0
    first = await http.post(worker.url + "/v1/completions", json=body)
    await first.content.readuntil(b"\n\n")  # its first token: prompt blocks computed
    assert await usage(http, worker) == pytest.approx(0.3)
    second = await http.post(worker.url + "/v1/completions", json=body)
    await second.content.readuntil(b"\n\n")
    # The two full blocks are pinned by both, each has its own partial block: 4 of 10.
    assert await usage(http, worker) == pytest.approx(0.4)
    for resp in (first, second):
        await asyncio.wait_for(resp.read(), 5)
        resp.release()
    # Finished requests leave their blocks cached, but nobody uses them.
    await worker.wait_for(lambda s: s.running == 0)
    assert await usage(http, worker) == 0.0


async def test_usage_grows_with_generated_tokens(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await fake_worker(num_gpu_blocks=10, ttft_ms=1, tpot_ms=200, block_size=4)
    body = {"model": "fake-model", "prompt": "p q r", "max_tokens": 10, "stream": True}
    async with http.post(worker.url + "/v1/completions", json=body) as resp:
        await resp.content.readuntil(b"\n\n")  # 3 + 1 tokens: one block
        early = await usage(http, worker)
        for _ in range(8):
            await resp.content.readuntil(b"\n\n")  # 3 + 9 tokens: three blocks
        late = await usage(http, worker)
        await asyncio.wait_for(resp.read(), 5)
    assert early == pytest.approx(0.1) and late == pytest.approx(0.3)


async def test_the_next_turn_finds_the_answer_cached(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    """Generated tokens fill blocks too (vLLM V1): a turn that quotes the last answer
    hits its full blocks, streamed (chat) or not (completions). Not without a capacity:
    nothing would ever evict them."""
    worker = await fake_worker(num_gpu_blocks=1000, **FAST)
    user = {"role": "user", "content": words(40)}  # 2 full blocks + 8 tokens
    body = {"model": "fake-model", "messages": [user], "max_tokens": 40, "stream": True}
    answer = ""
    async with http.post(worker.url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                delta = orjson.loads(line[6:])["choices"][0]["delta"]
                answer += delta.get("content") or ""
    assert answer.split()[0] == "w0" and len(answer.split()) == 40
    # 8 + 39 computed tokens after the prompt's blocks: 2 more full blocks (the last
    # token's KV is never computed).
    _, before = await counters(http, worker)
    turn = [user, {"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    async with http.post(
        worker.url + "/v1/chat/completions",
        json={"model": "fake-model", "messages": turn, "max_tokens": 2},
    ) as resp:
        assert resp.status == 200
    assert (await counters(http, worker))[1] - before == 64
    prompt = words(40, "c")
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 40}
    async with http.post(worker.url + "/v1/completions", json=body) as resp:
        text = (await resp.json())["choices"][0]["text"]
    assert await hits_of(http, worker, prompt + text + " more") == 64
    unbounded = await fake_worker(**FAST)
    async with http.post(unbounded.url + "/v1/completions", json=body) as resp:
        assert (await resp.json())["choices"][0]["text"] == text
    assert await hits_of(http, unbounded, prompt + text + " more") == 32  # the prompt's only


async def test_prefill_time_grows_with_uncached_tokens(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await fake_worker(prefill_ms_per_token=2.0, ttft_ms=5, tpot_ms=1)
    long_prompt = words(300, "long")
    cold = await first_token_after(http, worker, long_prompt, time.monotonic())
    warm = await first_token_after(http, worker, long_prompt, time.monotonic())  # 12 uncached
    short = await first_token_after(http, worker, words(20, "s"), time.monotonic())
    assert cold >= 0.6  # 300 tokens x 2 ms
    assert warm < cold / 3 and short < cold / 3


async def test_a_long_prefill_delays_another_requests_first_token(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await fake_worker(prefill_ms_per_token=2.0, ttft_ms=5, tpot_ms=1)
    alone = await first_token_after(http, worker, words(5, "x"), time.monotonic())
    t0 = time.monotonic()
    long_task = asyncio.create_task(first_token_after(http, worker, words(400, "long"), t0))
    await worker.wait_for(lambda s: s.running == 1)
    await asyncio.sleep(0.05)
    short = await first_token_after(http, worker, words(5, "y"), t0)
    long = await asyncio.wait_for(long_task, 10)
    # The short prompt needs 10 ms of prefill, but waits behind the long one's 800 ms.
    assert alone < 0.4
    assert short >= 0.7 and short >= long - 0.05


async def test_a_prompt_queued_behind_the_prefill_of_its_prefix_finds_it_cached(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    """As vLLM looks the cache up when it schedules a request: two conversations with the
    same 400-token system prompt arriving together pay its prefill once, not twice."""
    worker = await fake_worker(prefill_ms_per_token=2.0, ttft_ms=5, tpot_ms=1)
    shared = words(400, "sys")
    t0 = time.monotonic()
    first = asyncio.create_task(first_token_after(http, worker, shared + " one", t0))
    await worker.wait_for(lambda s: s.running == 1)
    second = await first_token_after(http, worker, shared + " two", t0)
    assert await asyncio.wait_for(first, 10) >= 0.7  # 400 tokens x 2 ms
    assert second < 1.2  # behind the first's 0.8 s, then ~1 block of its own, not 0.8 s more
    _, hits = await counters(http, worker)
    assert hits == 400 // 16 * 16  # the second found every full block of the shared part


async def test_metrics_are_in_vllms_exposition_format(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await fake_worker(models=("m",), num_gpu_blocks=123, **FAST)
    body = {"model": "m", "prompt": words(20), "max_tokens": 2}
    async with http.post(worker.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
    fams = await metrics(http, worker)
    for name, value in (("vllm:prefix_cache_queries", 20), ("vllm:prefix_cache_hits", 0)):
        assert fams[name].type == "counter"
        (sample,) = [s for s in fams[name].samples if s.name == name + "_total"]
        assert sample.labels == {"engine": "0", "model_name": "m"} and sample.value == value
    info = fams["vllm:cache_config_info"]
    assert info.type == "gauge"
    (sample,) = info.samples
    assert sample.value == 1
    assert sample.labels["block_size"] == "16" and sample.labels["num_gpu_blocks"] == "123"
    assert sample.labels["enable_prefix_caching"] == "True"
    # The same labels as the V1-shaped page in tests/data (vLLM lists every CacheConfig
    # field, a set that changes between versions).
    real = {f.name: f for f in text_string_to_metric_families(REAL_PAGE.read_text())}
    assert set(sample.labels) == set(real["vllm:cache_config_info"].samples[0].labels)
    assert 0.0 <= fams["vllm:kv_cache_usage_perc"].samples[0].value <= 1.0


def test_cache_options_on_the_command_line() -> None:
    out = CliRunner().invoke(main, ["fake-worker", "--help"])
    assert out.exit_code == 0
    for option in ("--block-size", "--num-gpu-blocks", "--prefill-ms-per-token", "--log-requests"):
        assert option in out.output
    bad = CliRunner().invoke(main, ["fake-worker", "--num-gpu-blocks", "0"])
    assert bad.exit_code != 0 and "--num-gpu-blocks" in bad.output


async def test_responses_prompts_go_through_the_cache(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await fake_worker(**FAST)
    body = {"model": "fake-model", "instructions": words(20, "i"), "input": words(20, "in")}
    for _ in range(2):
        async with http.post(worker.url + "/v1/responses", json=body) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["input_tokens"] == 40
    assert await counters(http, worker) == (80, 32)


async def test_a_prompt_whose_blocks_do_not_fit_waits_with_batch_slots_free(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    """vLLM's scheduler leaves a request waiting while its prompt's blocks cannot be
    allocated, whatever its batch has free, and admits nobody behind it meanwhile."""
    worker = await fake_worker(num_gpu_blocks=10, block_size=4, ttft_ms=1, tpot_ms=40)

    async def stream(prompt: str, tokens: int) -> list[float]:
        """Times (monotonic) of the answer's events."""
        body = {"model": "fake-model", "prompt": prompt, "max_tokens": tokens, "stream": True}
        times = []
        async with http.post(worker.url + "/v1/completions", json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    times.append(time.monotonic())
        return times

    first = asyncio.create_task(stream(words(24), 10))  # 6 blocks, 8 once answered
    await worker.wait_for(lambda s: s.running == 1)
    big = asyncio.create_task(stream(words(20, "b"), 1))  # 5 blocks: not beside 6-8
    await worker.wait_for(lambda s: s.waiting == 1)
    small = asyncio.create_task(stream("c0", 1))  # 1 block would fit, but waits its turn
    await worker.wait_for(lambda s: s.waiting == 2)
    assert worker.stats.running == 1  # 64 batch slots, 63 of them free
    ended = (await asyncio.wait_for(first, 10))[-1]
    big_times = await asyncio.wait_for(big, 10)
    small_times = await asyncio.wait_for(small, 10)
    assert big_times[0] >= ended and small_times[0] >= ended
    assert worker.stats.max_running_seen == 2  # big and small then ran together


async def test_an_overcommitting_cache_admits_what_does_not_fit(
    fake_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    """--kv-overcommit: the fake's behaviour before it kept such a request waiting."""
    worker = await fake_worker(
        num_gpu_blocks=10, block_size=4, ttft_ms=1, tpot_ms=40, kv_overcommit=True
    )
    body = {"model": "fake-model", "prompt": words(24), "max_tokens": 10, "stream": True}
    async with http.post(worker.url + "/v1/completions", json=body) as first:
        await first.content.readuntil(b"\n\n")
        big = {"model": "fake-model", "prompt": words(20, "b"), "max_tokens": 1}
        async with http.post(worker.url + "/v1/completions", json=big) as resp:
            assert resp.status == 200  # ran beside the first, past the capacity
        assert worker.stats.max_waiting_seen == 0
        await asyncio.wait_for(first.read(), 10)
    runner = CliRunner().invoke(main, ["fake-worker", "--help"])
    assert "--kv-overcommit" in runner.output


async def test_the_request_log_says_what_each_prompt_found_cached(
    fake_worker: MakeWorker, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--log-requests`: a line per request as its prefill starts, under the caller's
    X-Request-Id (cut short: anyone may send one), with what it had to prefill."""
    worker = await fake_worker(**FAST, log_requests=True)
    prompt = words(40)
    for rid in ("first", "again", "x" * 1000):
        body = {"model": "fake-model", "prompt": prompt, "max_tokens": 2, "stream": rid == "again"}
        async with http.post(
            worker.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}
        ) as resp:
            assert resp.status == 200
            await resp.read()
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    responses = {"input": prompt, "max_output_tokens": 2, "stream": True}
    for path, body in (("/v1/chat/completions", chat), ("/v1/responses", responses)):
        body = {**body, "model": "fake-model"}
        async with http.post(worker.url + path, json=body, headers={"X-Request-Id": path}) as resp:
            assert resp.status == 200
            await resp.read()
    lines = [orjson.loads(x) for x in capsys.readouterr().err.splitlines() if '"prefill"' in x]
    assert [(x["request_id"], x["prompt_tokens"], x["uncached_tokens"]) for x in lines[:3]] == [
        ("first", 40, 40),
        ("again", 40, 8),
        ("x" * 128, 40, 8),
    ]
    assert [x["request_id"] for x in lines[3:]] == ["/v1/chat/completions", "/v1/responses"]
    assert all(x["prompt_tokens"] >= 40 and x["uncached_tokens"] > 0 for x in lines[3:])
    assert all(0.0 <= x["waited"] < 5.0 for x in lines)


async def test_no_request_log_by_default(
    fake_worker: MakeWorker, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    worker = await fake_worker(**FAST)
    await complete(http, worker, words(20))
    assert '"prefill"' not in capsys.readouterr().err


async def test_the_benchmark_names_each_turn_by_its_conversation_and_turn(
    fake_worker: MakeWorker, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench_dispatch's traffic: every turn's X-Request-Id is `<session>.<n>-t<turn>` (n:
    the conversation's place in the run, so sessions that repeat still give unique ids),
    which the workers' request logs carry (benchmarks/placements.py `moved` reads them)."""
    from benchmarks.traffic import play
    from benchmarks.workload import MODEL, Conversation, Turn

    worker = await fake_worker(**FAST, models=(MODEL,), log_requests=True)
    turns = (Turn("hello there", 2, 0.0), Turn("and again", 2, 0.01))
    conversations = [Conversation(0.0, "Be brief.", "s7", turns)] * 2

    async def nothing() -> None:
        return None

    played = await asyncio.wait_for(play([worker.url], conversations, 0.0, 5.0, nothing), 30)
    assert len(played.ok()) == 4
    lines = [orjson.loads(x) for x in capsys.readouterr().err.splitlines() if '"prefill"' in x]
    assert sorted(x["request_id"] for x in lines) == ["s7.0-t0", "s7.0-t1", "s7.1-t0", "s7.1-t1"]

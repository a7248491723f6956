"""The fake vLLM worker over real sockets: wire format, batching, aborts, faults, lifecycle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_gateway.fake_worker import FakeWorker, FakeWorkerConfig, parse_fault, run_forever

MakeWorker = Callable[..., Awaitable[FakeWorker]]
CHAT = [{"role": "user", "content": "say three words"}]


@pytest.fixture
async def make_worker() -> AsyncIterator[MakeWorker]:
    """Start fake workers (fast by default) on 127.0.0.1:0; stop them all afterwards."""
    workers: list[FakeWorker] = []

    async def make(**overrides: Any) -> FakeWorker:
        config = FakeWorkerConfig(**{"ttft_ms": 5.0, "tpot_ms": 2.0, **overrides})
        worker = FakeWorker(config)
        await worker.start()
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        await asyncio.wait_for(worker.stop(), 5)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        yield session


def sdk(worker: FakeWorker, api_key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=worker.url + "/v1", api_key=api_key, max_retries=0)


async def read_events(resp: aiohttp.ClientResponse) -> list[tuple[float, bytes]]:
    """Split a raw SSE body into events (without the blank line), with arrival times."""
    events: list[tuple[float, bytes]] = []
    buf = b""
    async for data in resp.content.iter_any():
        now = time.monotonic()
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            events.append((now, event))
    assert buf == b"", f"trailing bytes outside an event: {buf[:100]!r}"
    return events


def payloads(events: list[tuple[float, bytes]]) -> list[Any]:
    """The JSON of each `data:` event; "[DONE]" stays a string."""
    out = []
    for _, event in events:
        assert event.startswith(b"data: "), event[:100]
        data = event[len(b"data: ") :]
        out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


async def stream(
    http: aiohttp.ClientSession, worker: FakeWorker, n: int = 4, **extra: Any
) -> aiohttp.ClientResponse:
    """Open a streaming /v1/completions request; the caller reads and releases it."""
    headers = extra.pop("headers", None)
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": n, "stream": True, **extra}
    return await http.post(worker.url + "/v1/completions", json=body, headers=headers)


def fault(name: str) -> dict[str, str]:
    return {"X-Fake-Fault": name}


# --- wire format -------------------------------------------------------------------------


async def test_completions_non_streaming_has_vllm_shape(make_worker: MakeWorker) -> None:
    worker = await make_worker()
    async with sdk(worker) as client:
        out = await client.completions.create(
            model="fake-model", prompt="one two three", max_tokens=4
        )
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.model == "fake-model" and out.created > 0
    assert out.choices[0].text == " w0 w1 w2 w3"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 4)
    assert out.usage.total_tokens == 7


async def test_chat_non_streaming_honours_max_completion_tokens(make_worker: MakeWorker) -> None:
    worker = await make_worker(max_tokens=2)
    async with sdk(worker) as client:
        default = await client.chat.completions.create(model="fake-model", messages=CHAT)
        out = await client.chat.completions.create(
            model="fake-model", messages=CHAT, max_completion_tokens=5
        )
    assert default.choices[0].message.content == " w0 w1"
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == " w0 w1 w2 w3 w4"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.prompt_tokens == 3
    assert out.usage.completion_tokens == 5


async def test_completions_stream_every_token_once_in_order(make_worker: MakeWorker) -> None:
    worker = await make_worker()
    async with sdk(worker) as client:
        chunks = [
            c
            async for c in await client.completions.create(
                model="fake-model",
                prompt="a b",
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
    *tokens, usage = chunks
    assert [c.choices[0].text for c in tokens] == [f" w{i}" for i in range(6)]
    assert [c.choices[0].finish_reason for c in tokens] == [None] * 5 + ["length"]
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (2, 6)
    assert len({c.id for c in chunks}) == 1


async def test_chat_stream_starts_with_role_and_ends_with_usage(make_worker: MakeWorker) -> None:
    worker = await make_worker(lora_adapters=("sql-lora",))
    async with sdk(worker) as client:
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="sql-lora",
                messages=CHAT,
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
    role, *tokens, usage = chunks
    assert role.choices[0].delta.role == "assistant" and role.choices[0].delta.content == ""
    assert [c.choices[0].delta.content for c in tokens] == [" w0", " w1", " w2"]
    assert tokens[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.model == "sql-lora" for c in chunks)
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 6


async def test_stream_framing_is_chunked_sse_one_event_per_token_paced(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    # Paced slowly enough that a first token read a few tens of ms late (a loaded machine)
    # does not make the next one look early.
    tpot = 0.06
    worker = await make_worker(ttft_ms=10, tpot_ms=tpot * 1000)
    async with await stream(http, worker, n=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["Transfer-Encoding"] == "chunked"
        events = await read_events(resp)
    data = payloads(events)
    assert data[-1] == "[DONE]" and len(data) == 6
    assert [d["choices"][0]["text"] for d in data[:-1]] == [f" w{i}" for i in range(5)]
    assert data[0]["choices"][0] == {
        "index": 0, "text": " w0", "logprobs": None, "finish_reason": None, "stop_reason": None
    }  # fmt: skip
    # Tokens leave one per tpot, never early and never batched together.
    times = [t for t, _ in events[:-1]]
    for i, t in enumerate(times):
        assert t - times[0] >= i * tpot - tpot / 2, f"token {i} arrived early"
    assert times[-1] - times[0] < 4 * tpot + 0.5


async def test_errors_have_openai_shape(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    url = worker.url + "/v1/completions"
    cases = [
        (b'{"model": "nope", "prompt": "x"}', 404, "The model `nope` does not exist."),
        (b'{"model": "fake-model", "prompt": "x"', 400, None),
        (b'{"model": "fake-model"}', 400, None),
        (b'{"model": "fake-model", "prompt": "x", "max_tokens": 0}', 400, None),
        (b'{"model": "fake-model", "prompt": "x", "stream_options": {}}', 400, None),
    ]
    for body, status, message in cases:
        async with http.post(url, data=body) as resp:
            assert resp.status == status, body
            err = (await resp.json())["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
        assert message is None or err["message"] == message
    async with sdk(worker) as client:
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="x")
    assert worker.stats.errors == len(cases) + 1


async def test_api_key_guards_v1_only(make_worker: MakeWorker, http: aiohttp.ClientSession) -> None:
    worker = await make_worker(api_key="sekret")
    async with sdk(worker, api_key="wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    async with sdk(worker, api_key="sekret") as client:
        out = await client.completions.create(model="fake-model", prompt="x", max_tokens=1)
        assert out.choices[0].text == " w0"
    for path in ("/health", "/metrics", "/version"):
        async with http.get(worker.url + path) as resp:
            assert resp.status == 200, path
    assert worker.stats.last("/v1/completions").headers["authorization"] == "Bearer sekret"


async def test_models_version_health(make_worker: MakeWorker, http: aiohttp.ClientSession) -> None:
    worker = await make_worker(models=("base", "alias"), lora_adapters=("lora-a",))
    async with http.get(worker.url + "/v1/models") as resp:
        listing = await resp.json()
    assert listing["object"] == "list"
    cards = {c["id"]: c for c in listing["data"]}
    assert list(cards) == ["base", "alias", "lora-a"]
    assert cards["alias"]["root"] == "base" and cards["alias"]["parent"] is None
    assert cards["lora-a"]["parent"] == "base"
    assert all(c["object"] == "model" and c["owned_by"] == "vllm" for c in cards.values())
    assert cards["base"]["max_model_len"] == 4096 and cards["base"]["permission"]
    async with http.get(worker.url + "/health") as resp:
        assert resp.status == 200 and await resp.read() == b""
    async with http.get(worker.url + "/version") as resp:
        assert "version" in await resp.json()
    # Probes and scrapes are counted apart so they never crowd out real requests.
    assert worker.stats.health_probes == 1 and worker.stats.received == 2


async def test_embeddings_are_deterministic(make_worker: MakeWorker) -> None:
    worker = await make_worker(embedding_dim=6)
    async with sdk(worker) as client:
        one = await client.embeddings.create(model="fake-model", input="hello world")
        many = await client.embeddings.create(model="fake-model", input=["x", "hello world"])
    assert len(one.data) == 1 and len(one.data[0].embedding) == 6
    assert [d.index for d in many.data] == [0, 1]
    assert many.data[1].embedding == one.data[0].embedding != many.data[0].embedding
    assert one.usage.prompt_tokens == 2


async def test_tokenize_score_rerank(make_worker: MakeWorker, http: aiohttp.ClientSession) -> None:
    worker = await make_worker()
    async with http.post(
        worker.url + "/tokenize", json={"model": "fake-model", "prompt": "a b c"}
    ) as resp:
        tok = await resp.json()
    assert tok["count"] == 3 == len(tok["tokens"]) and tok["max_model_len"] == 4096
    async with http.post(
        worker.url + "/v1/score", json={"model": "fake-model", "text_1": "q", "text_2": ["a", "b"]}
    ) as resp:
        score = await resp.json()
    assert [d["index"] for d in score["data"]] == [0, 1]
    assert all(0 < d["score"] < 1 for d in score["data"])
    body = {"model": "fake-model", "query": "q", "documents": ["a", "b", "c"], "top_n": 2}
    async with http.post(worker.url + "/v1/rerank", json=body) as resp:
        rerank = await resp.json()
    scores = [r["relevance_score"] for r in rerank["results"]]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)


async def test_records_keep_exact_body_and_forwarded_headers(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    raw = b'{ "prompt" : "x",\n  "model":"fake-model", "max_tokens": 1 , "extra": [1,2] }'
    headers = {"X-Request-Id": "req-42", "Authorization": "Bearer tok"}
    async with http.post(worker.url + "/v1/completions", data=raw, headers=headers) as resp:
        out = await resp.json()
    assert out["id"] == "cmpl-req-42"  # vLLM bases its id on X-Request-Id
    rec = worker.stats.last()
    assert rec.body == raw and rec.path == "/v1/completions" and rec.outcome == "completed"
    assert rec.headers["X-Request-Id"] == "req-42" and rec.headers["Authorization"] == "Bearer tok"
    async with http.get(worker.url + "/fake/stats") as resp:
        stats = await resp.json()
    assert stats["received"] == stats["completed"] == 1
    assert stats["requests"][-1]["body"] == raw.decode()


# --- /metrics ------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("legacy", [False, True])
async def test_metrics_page_is_vllm_shaped(
    make_worker: MakeWorker, http: aiohttp.ClientSession, legacy: bool
) -> None:
    worker = await make_worker(legacy_metrics=legacy, models=("m",))
    async with sdk(worker) as client:
        await client.completions.create(model="m", prompt="a b c", max_tokens=4)
    async with http.get(worker.url + "/metrics") as resp:
        text = await resp.text()
    fams = parse_metrics(text)
    usage = "vllm:gpu_cache_usage_perc" if legacy else "vllm:kv_cache_usage_perc"
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", usage):
        assert fams[name].type == "gauge"
        assert fams[name].samples[0].labels == {"engine": "0", "model_name": "m"}
    assert "vllm:gpu_cache_usage_perc" in fams if legacy else "vllm:kv_cache_usage_perc" in fams
    assert fams["vllm:prompt_tokens"].type == "counter"
    value = {s.name: s.value for f in fams.values() for s in f.samples if not s.labels.get("le")}
    assert value["vllm:prompt_tokens_total"] == 3 and value["vllm:generation_tokens_total"] == 4
    success = {
        s.labels["finished_reason"]: s.value
        for s in fams["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    assert success["length"] == 1
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert fams[hist].type == "histogram"
        buckets = [s for s in fams[hist].samples if s.name.endswith("_bucket")]
        assert len(buckets) > 5 and buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 1
    lora = fams["vllm:lora_requests_info"].samples[0].labels
    assert {"running_lora_adapters", "waiting_lora_adapters"} <= set(lora)
    assert any(n.startswith("python_") for n in fams)
    assert any(n.startswith("process_") for n in fams)


# --- continuous batching and aborts ---------------------------------------------------------


async def gauges(http: aiohttp.ClientSession, worker: FakeWorker) -> dict[str, float]:
    async with http.get(worker.url + "/metrics") as resp:
        fams = parse_metrics(await resp.text())
    return {
        name: fams[name].samples[0].value
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
    } | {"usage": fams["vllm:kv_cache_usage_perc"].samples[0].value}


async def test_batch_runs_at_most_max_num_seqs_rest_wait_fifo(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    # Each request holds its slot 0.4 s: time enough to look at the full batch before the
    # first one ends, even on a loaded machine. The second starts 50 ms after the first,
    # so the two slots free up 50 ms apart and the order of the finishes is well defined.
    worker = await make_worker(max_num_seqs=2, ttft_ms=1, tpot_ms=80, lora_adapters=("la",))
    finished: list[int] = []

    async def one(i: int) -> None:
        model = "la" if i == 4 else "fake-model"
        body = {"model": model, "prompt": "x", "max_tokens": 6}
        async with http.post(worker.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
        finished.append(i)

    tasks = []
    for i in range(5):  # one at a time, so FIFO order is well defined
        tasks.append(asyncio.create_task(one(i)))
        await worker.wait_for(lambda s, n=i + 1: s.running + s.waiting == n)
        if i == 0:
            await asyncio.sleep(0.05)
    assert (worker.stats.running, worker.stats.waiting) == (2, 3)
    assert await gauges(http, worker) == {
        "vllm:num_requests_running": 2, "vllm:num_requests_waiting": 3, "usage": 1.0
    }  # fmt: skip
    async with http.get(worker.url + "/metrics") as resp:
        text = await resp.text()
    assert 'waiting_lora_adapters="la"' in text
    async with http.get(worker.url + "/fake/stats") as resp:
        assert (await resp.json())["waiting"] == 3
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert finished[:2] == [0, 1] and finished[2:4] == [2, 3] and finished[4] == 4
    assert worker.stats.max_running_seen == 2 and worker.stats.completed == 5
    assert (worker.stats.running, worker.stats.waiting) == (0, 0)


async def test_aborted_stream_frees_its_slot(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker(max_num_seqs=1, tpot_ms=5)
    resp = await stream(http, worker, n=10_000)
    await resp.content.readuntil(b"\n\n")  # generating: it holds the only slot
    waiting = asyncio.create_task(http.post(worker.url + "/v1/completions",
                                            json={"prompt": "x", "max_tokens": 1}))  # fmt: skip
    await worker.wait_for(lambda s: s.waiting == 1)
    resp.close()  # the client goes away mid-stream
    await worker.wait_for(lambda s: s.aborted == 1 and s.running <= 1, timeout=1.0)
    async with await asyncio.wait_for(waiting, 2) as second:
        assert second.status == 200
    assert worker.stats.aborted == 1 and worker.stats.completed == 1
    assert worker.stats.requests[0].outcome == "aborted"
    async with http.get(worker.url + "/metrics") as m:
        assert 'vllm:request_success_total{engine="0",finished_reason="abort"' in await m.text()


async def test_aborted_non_streaming_request_frees_its_slot(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker(max_num_seqs=1, tpot_ms=5)
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 10_000}
    running = asyncio.create_task(http.post(worker.url + "/v1/completions", json=body))
    await worker.wait_for(lambda s: s.running == 1)
    queued = asyncio.create_task(http.post(worker.url + "/v1/completions", json=body))
    await worker.wait_for(lambda s: s.waiting == 1)
    queued.cancel()  # leaves the waiting line
    await worker.wait_for(lambda s: s.aborted == 1 and s.waiting == 0, timeout=1.0)
    running.cancel()  # gives up the running slot
    await worker.wait_for(lambda s: s.aborted == 2 and s.running == 0, timeout=1.0)
    assert worker.stats.completed == 0


async def test_holds_a_thousand_concurrent_streams_and_their_aborts(
    make_worker: MakeWorker,
) -> None:
    # One token a second each: the point is holding 1,000 open streams, not throughput.
    worker = await make_worker(max_num_seqs=1000, ttft_ms=5, tpot_ms=1000)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        responses = await asyncio.wait_for(
            asyncio.gather(*(stream(http, worker, n=100) for _ in range(1000))), 20
        )
        firsts = await asyncio.wait_for(
            asyncio.gather(*(r.content.readuntil(b"\n\n") for r in responses)), 20
        )
        assert all(b'"text":" w0"' in f for f in firsts)
        await worker.wait_for(lambda s: s.running == 1000 and s.waiting == 0)
        for resp in responses:
            resp.close()
        await worker.wait_for(lambda s: s.aborted == 1000 and s.running == 0, timeout=5)


# --- faults ------------------------------------------------------------------------------------


def test_fault_grammar() -> None:
    assert parse_fault(None) is None and parse_fault("none") is None
    assert str(parse_fault("status=503")) == "status=503"
    assert parse_fault("stall_headers") is not None
    assert str(parse_fault("huge_event")) == "huge_event=262144"
    for bad in ("stall", "hang=3", "status=abc", "status=200", "drip=-1"):
        with pytest.raises(ValueError):
            parse_fault(bad)
    with pytest.raises(ValueError):
        FakeWorkerConfig(fault="typo")


async def test_unknown_fault_is_a_loud_400(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    async with await stream(http, worker, headers=fault("stal_midstream=2")) as resp:
        assert resp.status == 400
        assert "unknown fault" in (await resp.json())["error"]["message"]
    async with http.post(worker.url + "/fake/fault", json={"fault": "nope"}) as resp:
        assert resp.status == 400
    with pytest.raises(ValueError):
        worker.set_fault("nope")


async def test_hang_never_answers_and_counts_abort(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker(fault="hang")
    with pytest.raises(asyncio.TimeoutError):
        await http.post(
            worker.url + "/v1/completions",
            json={"prompt": "x"},
            timeout=aiohttp.ClientTimeout(total=0.3),
        )
    await worker.wait_for(lambda s: s.aborted == 1, timeout=1.0)
    assert worker.stats.requests[0].fault == "hang"
    # The worker-wide fault spares probes and scrapes; a header can opt a request out.
    async with http.get(worker.url + "/health") as resp:
        assert resp.status == 200
    async with await stream(http, worker, headers=fault("none")) as resp:
        assert payloads(await read_events(resp))[-1] == "[DONE]"


async def test_stall_headers_delays_the_status_line(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    start = time.monotonic()
    async with await stream(http, worker, headers=fault("stall_headers=0.3")) as resp:
        headers_at = time.monotonic() - start
        assert payloads(await read_events(resp))[-1] == "[DONE]"
    assert 0.3 <= headers_at < 2


async def test_stall_midstream_sends_k_events_then_nothing(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    async with await stream(http, worker, n=8, headers=fault("stall_midstream=2")) as resp:
        got = [await resp.content.readuntil(b"\n\n") for _ in range(2)]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 0.3)
        assert worker.stats.running == 1  # the stalled sequence keeps its slot
    assert [orjson.loads(e[6:])["choices"][0]["text"] for e in got] == [" w0", " w1"]
    await worker.wait_for(lambda s: s.aborted == 1 and s.running == 0, timeout=1.0)


async def test_reset_midstream_cuts_the_connection(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    async with await stream(http, worker, n=8, headers=fault("reset_midstream=3")) as resp:
        got = [await resp.content.readuntil(b"\n\n") for _ in range(3)]
        with pytest.raises(aiohttp.ClientError):
            await asyncio.wait_for(resp.content.read(), 2)
    assert len(got) == 3
    await worker.wait_for(lambda s: s.faulted == 1 and s.running == 0, timeout=1.0)
    assert worker.stats.aborted == 0


async def test_close_midstream_ends_cleanly_without_done(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    async with await stream(http, worker, n=8, headers=fault("close_midstream=3")) as resp:
        data = payloads(await asyncio.wait_for(read_events(resp), 2))
    assert [d["choices"][0]["text"] for d in data] == [" w0", " w1", " w2"]
    assert worker.stats.faulted == 1 and worker.stats.aborted == 0


@pytest.mark.parametrize("name", ["reset_midstream=1", "close_midstream=1"])
async def test_midstream_faults_truncate_non_streaming_bodies(
    make_worker: MakeWorker, http: aiohttp.ClientSession, name: str
) -> None:
    worker = await make_worker()
    body = {"prompt": "x", "max_tokens": 3}
    with pytest.raises(aiohttp.ClientError):
        async with http.post(
            worker.url + "/v1/completions", json=body, headers=fault(name)
        ) as resp:
            assert resp.status == 200
            await asyncio.wait_for(resp.read(), 2)
    await worker.wait_for(lambda s: s.faulted == 1, timeout=1.0)


@pytest.mark.parametrize("code", [429, 500, 503])
async def test_status_fault_answers_openai_error(make_worker: MakeWorker, code: int) -> None:
    worker = await make_worker()
    worker.set_fault(f"status={code}")
    async with sdk(worker) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.completions.create(model="fake-model", prompt="x", stream=True)
    assert info.value.status_code == code
    assert info.value.body["code"] == code  # type: ignore[index]
    retry_after = info.value.response.headers.get("Retry-After")
    assert retry_after == ("1" if code in (429, 503) else None)


async def test_drip_writes_a_few_bytes_at_a_time(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    start = time.monotonic()
    reads = 0
    async with await stream(http, worker, n=1, headers=fault("drip=2")) as resp:
        body = b""
        async for data in resp.content.iter_any():
            reads += 1
            body += data
    assert body.endswith(b"data: [DONE]\n\n") and b" w0" in body
    assert reads > len(body) // 16  # arrived in small pieces
    assert time.monotonic() - start >= len(body) // 4 * 0.002 * 0.8
    # A non-streamed body drips too, and still arrives whole.
    body2 = {"prompt": "x", "max_tokens": 2}
    async with http.post(
        worker.url + "/v1/completions", json=body2, headers=fault("drip=1")
    ) as resp:
        assert (await resp.json())["choices"][0]["text"] == " w0 w1"


async def test_malformed_sse_is_not_parseable(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    async with await stream(http, worker, n=2, headers=fault("malformed_sse")) as resp:
        events = await read_events(resp)
    for _, event in events[:-1]:
        if event.startswith(b"data: "):
            with pytest.raises(orjson.JSONDecodeError):
                orjson.loads(event[6:])
    assert any(not event.startswith(b"data: ") for _, event in events)
    async with http.post(
        worker.url + "/v1/completions", json={"prompt": "x"}, headers=fault("malformed_sse")
    ) as resp:
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(await resp.read())


async def test_huge_event_then_normal_stream(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker()
    async with await stream(http, worker, n=3, headers=fault("huge_event=300000")) as resp:
        data = payloads(await read_events(resp))
    texts = [d["choices"][0]["text"] for d in data[:-1]]
    assert texts == ["x" * 300_000, " w0", " w1", " w2"] and data[-1] == "[DONE]"
    async with sdk(worker) as client:
        chat = await client.chat.completions.with_raw_response.create(
            model="fake-model", messages=CHAT, max_tokens=1,
            extra_headers=fault("huge_event=1000"),
        )  # fmt: skip
    assert chat.parse().choices[0].message.content == "x" * 1000 + " w0"


async def test_fault_control_endpoint(make_worker: MakeWorker, http: aiohttp.ClientSession) -> None:
    worker = await make_worker()
    async with http.post(worker.url + "/fake/fault", json={"fault": "status=503"}) as resp:
        assert (await resp.json()) == {"fault": "status=503"}
    async with await stream(http, worker) as resp:
        assert resp.status == 503
    async with http.post(worker.url + "/fake/fault", json={"fault": None}) as resp:
        assert (await resp.json()) == {"fault": None}
    async with await stream(http, worker) as resp:
        assert resp.status == 200
    assert worker.fault is None


# --- lifecycle ---------------------------------------------------------------------------------


async def test_pause_refuses_and_cuts_then_resume_serves_same_port(
    make_worker: MakeWorker, http: aiohttp.ClientSession
) -> None:
    worker = await make_worker(tpot_ms=5)
    port = worker.port
    resp = await stream(http, worker, n=10_000)
    await resp.content.readuntil(b"\n\n")
    await asyncio.wait_for(worker.pause(), 2)
    with pytest.raises(aiohttp.ClientError):
        await asyncio.wait_for(resp.content.read(), 2)  # the open stream is cut
    resp.release()
    with pytest.raises(aiohttp.ClientConnectorError):
        await http.get(worker.url + "/health")
    assert worker.stats.dropped == 1 and worker.stats.running == 0
    await worker.resume()
    assert worker.port == port
    async with http.get(worker.url + "/health") as ok:
        assert ok.status == 200


async def test_run_forever_announces_and_stops_on_cancel(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = FakeWorkerConfig(models=("a", "b"))
    task = asyncio.create_task(run_forever(config, "127.0.0.1", 0))
    line = ""
    for _ in range(200):
        await asyncio.sleep(0.01)
        line += capsys.readouterr().out
        if line:
            break
    assert line.startswith("fake worker listening on http://127.0.0.1:")
    assert line.rstrip().endswith("serving a,b")
    url = line.split()[4]
    async with aiohttp.ClientSession() as http, http.get(url + "/health") as resp:
        assert resp.status == 200
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_freeze_accepts_and_never_answers_then_resume_serves(
    make_worker: MakeWorker,
) -> None:
    worker = await make_worker()
    await worker.freeze()
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(worker.host, worker.port), 2
    )  # the handshake completes: the kernel accepts for the frozen process
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), 0.3)  # ...and nothing ever answers
    writer.close()
    await worker.resume()
    async with aiohttp.ClientSession() as http, http.get(worker.url + "/health") as resp:
        assert resp.status == 200


async def test_blackhole_makes_connects_time_out_then_resume_serves(
    make_worker: MakeWorker,
) -> None:
    worker = await make_worker()
    await worker.blackhole()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.open_connection(worker.host, worker.port), 0.3)
    assert time.monotonic() - t0 >= 0.25  # not refused: the connect hung until our limit
    await worker.resume()
    async with aiohttp.ClientSession() as http, http.get(worker.url + "/health") as resp:
        assert resp.status == 200


async def test_outage_over_http_then_resume(make_worker: MakeWorker) -> None:
    worker = await make_worker()
    async with aiohttp.ClientSession() as http:
        async with http.post(worker.url + "/fake/outage", json={"mode": "nope"}) as resp:
            assert resp.status == 400
        body = {"mode": "pause", "seconds": 0.5}
        async with http.post(worker.url + "/fake/outage", json=body) as resp:
            assert resp.status == 202
        await asyncio.sleep(0.2)
        with pytest.raises(aiohttp.ClientConnectorError):
            await http.get(worker.url + "/health")  # refused while paused
        await asyncio.sleep(0.6)
        async with http.get(worker.url + "/health") as resp:
            assert resp.status == 200  # back on its own

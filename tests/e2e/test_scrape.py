"""Scrape: the /metrics parser on real-shaped vLLM pages (tests/data/README.md: written for
these tests; the published captures are in tests/unit/test_scrape_captures.py), and the
background scraper."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_until
from vllm_gateway.config.gateway import ScrapeConfig
from vllm_gateway.fleet import scrape
from vllm_gateway.fleet.scrape import MetricNames, Scraper, parse_labels, parse_metrics
from vllm_gateway.http.server import start_server
from vllm_gateway.proxy.pool import UpstreamPool
from vllm_gateway.workers import EngineStats, WorkerRegistry, WorkerState

DATA = Path(__file__).parent.parent / "data"
V1 = (DATA / "vllm_metrics_v1.txt").read_text()
V0 = (DATA / "vllm_metrics_v0.txt").read_text()
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "Qwen/Qwen2.5-7B-Instruct"
NAMES = MetricNames.from_config(ScrapeConfig())

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("page", "models", "running", "waiting", "kv"),
    [
        # Two data-parallel engines of one model: summed; KV usage is their mean.
        (V1, {LLAMA}, 32.0, 3.0, 0.375),
        # A LoRA adapter name alongside its base model changes nothing.
        (V1, {LLAMA, "sql-lora"}, 32.0, 3.0, 0.375),
        (V1, {QWEN}, 5.0, 9.0, 0.9),
        # Models not learned yet: every sample counts.
        (V1, set(), 37.0, 12.0, (0.4375 + 0.3125 + 0.9) / 3),
        # vLLM before the V1 engine: no engine label, the older KV-cache gauge name.
        (V0, {LLAMA}, 7.0, 2.0, 0.71),
    ],
)
def test_parse_real_shaped_pages(page, models, running, waiting, kv):
    stats = parse_metrics(page, NAMES, models, at=12.5)
    assert stats is not None
    assert (stats.running, stats.waiting, stats.at) == (running, waiting, 12.5)
    assert stats.kv_cache_usage == pytest.approx(kv)


def test_parse_agrees_with_prometheus_client():
    """The reference parser reads the same numbers (and accepts the page as valid)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(V1):
        for sample in family.samples:
            if sample.labels.get("model_name") == LLAMA:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    stats = parse_metrics(V1, NAMES, {LLAMA})
    assert stats is not None
    assert stats.running == totals["vllm:num_requests_running"]
    assert stats.waiting == totals["vllm:num_requests_waiting"]


def test_metric_names_are_configuration():
    page = 'sglang:num_running_reqs 4\nsglang:num_queue_reqs{model_name="m"} 6\n'
    names = MetricNames(["sglang:num_running_reqs"], ["sglang:num_queue_reqs"], [])
    stats = parse_metrics(page, names, {"m"})
    assert stats == EngineStats(running=4.0, waiting=6.0, kv_cache_usage=None, at=0.0)
    # The first name present wins; later ones are fallbacks.
    names = MetricNames(["new:running", "sglang:num_running_reqs"], ["sglang:num_queue_reqs"], [])
    assert parse_metrics(page, names).running == 4.0


@pytest.mark.parametrize(
    "page",
    [
        "",
        "garbage\n\x00\x01 not prometheus {{{\n",
        V1.replace("vllm:num_requests_waiting{", "vllm:num_requests_waitin{"),  # gauge missing
    ],
)
def test_a_page_without_the_gauges_gives_none(page):
    assert parse_metrics(page, NAMES, {LLAMA}) is None


def test_malformed_and_unknown_lines_are_skipped():
    page = (
        'vllm:num_requests_running{model_name="m"} not-a-number\n'
        'vllm:num_requests_running{model_name="m"} 3 1712345678000\n'  # with a timestamp
        'vllm:num_requests_running_per_engine{model_name="m"} 99\n'  # a longer name
        'vllm:num_requests_running{model_name="m"\n'  # cut short
        'vllm:num_requests_waiting{model_name="m"} NaN\n'
        'vllm:num_requests_waiting{model_name="m"} 1.5e+00\n'
    )
    stats = parse_metrics(page, NAMES, {"m"})
    assert stats is not None and (stats.running, stats.waiting) == (3.0, 1.5)


def test_parse_labels_handles_escapes():
    text = r'a="1",chat_template="{% if x %}\"q, r\"{% endif %}\n",model_name="m"'
    assert parse_labels(text) == {
        "a": "1",
        "chat_template": '{% if x %}"q, r"{% endif %}\n',
        "model_name": "m",
    }
    with pytest.raises(ValueError):
        parse_labels('a="unterminated')


async def test_fake_worker_page_parses(fake_worker, http):
    w = await fake_worker(models=("m",), lora_adapters=("lora-a",), max_num_seqs=1, tpot_ms=50)
    tasks = [
        asyncio.create_task(
            http.post(
                w.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 10}
            )
        )
        for _ in range(3)
    ]
    await wait_until(lambda: w.stats.waiting == 2)
    async with http.get(w.url + "/metrics") as r:
        page = await r.text()
    stats = parse_metrics(page, NAMES, {"m", "lora-a"})
    assert stats is not None and (stats.running, stats.waiting) == (1.0, 2.0)
    assert stats.kv_cache_usage == 1.0
    for t in tasks:
        (await t).close()


async def test_scraper_records_stats_and_withdraws_stale_ones(fake_worker):
    w = await fake_worker(models=("m",))
    registry = WorkerRegistry()
    worker, _ = registry.add(w.url)
    registry.set_state(worker, WorkerState.READY, "test")
    seen = []
    registry.stats_listeners.append(seen.append)
    pool = UpstreamPool(1.0)
    await pool.open()
    scraper = Scraper(registry, pool, ScrapeConfig(interval=0.05, timeout=0.5, stale_after=0.3))
    await scraper.start()
    try:
        await wait_until(lambda: worker.stats is not None)
        assert worker.stats.running == 0.0 and seen and seen[0] is worker
        await w.pause()  # no more answers: the snapshot goes stale and is withdrawn
        await wait_until(lambda: worker.stats is None, timeout=3)
        assert scraper.failures > 0
        await w.resume()
        await wait_until(lambda: worker.stats is not None, timeout=3)
    finally:
        await scraper.stop()
        await pool.close()


def test_set_stats_keeps_requests_sent_while_the_scrape_was_out():
    registry = WorkerRegistry()
    worker, _ = registry.add("http://w")
    worker.sent_since_scrape, worker.finished_since_scrape = 5, 2
    # The scrape started when 3 had been sent and 1 finished; 2 more went out meanwhile.
    registry.set_stats(worker, EngineStats(1, 0, None, 0.0), sent=3, finished=1)
    assert (worker.sent_since_scrape, worker.finished_since_scrape) == (2, 1)
    registry.set_stats(worker, None)
    assert worker.stats is None and worker.sent_since_scrape == 2


async def test_a_request_that_ends_while_the_scrape_is_out_is_not_taken_off_twice():
    """The page already shows the finished request gone; the one sent meanwhile is not on it
    yet. The worker must look as busy as it is: one request of the gateway's own on top of
    an empty page, not zero (which would give its token bucket room it does not have)."""
    registry = WorkerRegistry()

    async def metrics(request: web.Request) -> web.Response:
        # While the GET is out, the gateway sees one request end and sends the next.
        worker.finished_since_scrape += 1
        worker.sent_since_scrape += 1
        page = "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"
        return web.Response(text=page)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = await start_server(app, "127.0.0.1", 0)
    worker, _ = registry.add(server.url)
    pool = UpstreamPool(1.0)
    await pool.open()
    try:
        assert await Scraper(registry, pool, ScrapeConfig()).scrape_worker(worker)
    finally:
        await pool.close()
        await server.stop()
    assert worker.stats is not None and worker.stats.running == 0
    assert worker.sent_since_scrape - worker.finished_since_scrape == 1


def test_parsed_labels_are_remembered_within_bounds():
    """A page's label texts repeat on every scrape, so their parses are remembered; a
    page of ever new (or huge) label texts cannot grow what is kept past its bound."""
    scrape._labels_memo.clear()
    names = MetricNames(["vllm:num_requests_running"], ["vllm:num_requests_waiting"], [])
    # Engines alternate between two models, so a parse remembered for the wrong text
    # would count the other model's samples.
    page = "\n".join(
        [
            f'vllm:num_requests_running{{model_name="{"ab"[i % 2]}",engine="{i % 2000}"}} 1'
            for i in range(3000)
        ]
        + ['vllm:num_requests_waiting{model_name="m",engine="0} 2']  # malformed: skipped
        + [f'vllm:num_requests_waiting{{model_name="m",x="{"y" * 2000}"}} 3']  # too long to keep
    )
    stats = parse_metrics(page, names, ("a", "m"))
    assert stats is not None and stats.running == 1500 and stats.waiting == 3
    assert 0 < len(scrape._labels_memo) <= scrape._LABELS_KEPT
    assert all(len(text) <= scrape._LABEL_TEXT_KEPT for text in scrape._labels_memo)
    again = parse_metrics(page, names, ("a", "m"))
    assert again == stats
    other = parse_metrics(page, names, ("b",))
    assert other is not None and other.running == 1500

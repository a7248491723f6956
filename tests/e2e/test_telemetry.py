"""The gateway's /metrics: valid exposition format, and counters that match the traffic sent."""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import FAST_PROBES, replace, wait_until
from tests.support.rawhttp import exchange, request
from vllm_gateway.app import GATEWAY, REGISTRY
from vllm_gateway.observe import telemetry
from vllm_gateway.observe.exposition import Histogram
from vllm_gateway.observe.telemetry import GONE_RETENTION_SECONDS, TTFB_BUCKETS, RequestMetrics

pytestmark = pytest.mark.timeout(30)


async def scrape(http, gw) -> dict[str, list]:
    """GET /metrics, parsed by prometheus-client: family name -> samples."""
    async with http.get(gw.url + "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for f in families.values():
        assert f.documentation, f"{f.name} has no HELP"
        if f.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in f.samples)
    return {name: f.samples for name, f in families.items()}


def total(samples, name: str, **labels) -> float:
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items())
    )


async def test_counters_match_the_traffic_sent(fake_worker, gateway, client, http):
    a = await fake_worker(models="alpha", tpot_ms=1, ttft_ms=1)
    b = await fake_worker(models="beta", tpot_ms=1, ttft_ms=1)
    gw = await gateway([a, b])
    c = client(gw)
    for _ in range(7):
        await c.completions.create(model="alpha", prompt="x", max_tokens=3)
    for _ in range(5):
        stream = await c.completions.create(model="beta", prompt="x", max_tokens=4, stream=True)
        async for _chunk in stream:
            pass
    for _ in range(3):
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="nope", prompt="x")
    # The worker's own error answer is relayed and counted with its status.
    with pytest.raises(openai.InternalServerError):
        await c.completions.create(
            model="alpha", prompt="x", extra_headers={"X-Fake-Fault": "status=500"}
        )

    m = await scrape(http, gw)
    # prometheus-client's parser strips `_total` from the family name.
    req = m["vllm_gateway_requests"]
    assert total(req, "vllm_gateway_requests_total", model="alpha", status=200, outcome="ok") == 7
    assert total(req, "vllm_gateway_requests_total", model="alpha", worker=a.url) == 8
    assert total(req, "vllm_gateway_requests_total", model="alpha", status=500) == 1
    assert total(req, "vllm_gateway_requests_total", model="beta", worker=b.url) == 5
    assert total(req, "vllm_gateway_requests_total") == 13
    errors = m["vllm_gateway_errors"]
    assert total(errors, "vllm_gateway_errors_total", status=404, code="model_not_found") == 3
    assert total(m["vllm_gateway_retries"], "vllm_gateway_retries_total") == 0

    for family in (
        "vllm_gateway_request_duration_seconds",
        "vllm_gateway_time_to_first_byte_seconds",
    ):
        samples = m[family]
        assert total(samples, family + "_count", model="alpha") == 8
        assert total(samples, family + "_count", model="beta") == 5
        # Buckets are cumulative and end at +Inf == count.
        buckets = [
            s for s in samples if s.name == family + "_bucket" and s.labels["model"] == "beta"
        ]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf"
        assert counts[-1] == 5
    # Each answer's duration is at least its time to first byte.
    ttfb_sum = total(
        m["vllm_gateway_time_to_first_byte_seconds"], "vllm_gateway_time_to_first_byte_seconds_sum"
    )
    dur_sum = total(
        m["vllm_gateway_request_duration_seconds"], "vllm_gateway_request_duration_seconds_sum"
    )
    assert 0 < ttfb_sum <= dur_sum
    body_bytes = total(
        m["vllm_gateway_response_bytes"], "vllm_gateway_response_bytes_total", model="beta"
    )
    assert body_bytes > 5 * 4 * len(b"data: ")

    state = m["vllm_gateway_worker_state"]
    assert total(state, "vllm_gateway_worker_state", worker=a.url, state="ready") == 1
    assert total(state, "vllm_gateway_worker_state", worker=a.url, state="unhealthy") == 0
    models = m["vllm_gateway_worker_model"]
    assert total(models, "vllm_gateway_worker_model", worker=b.url, model="beta") == 1
    inflight = m["vllm_gateway_worker_inflight_requests"]
    assert total(inflight, "vllm_gateway_worker_inflight_requests") == 0
    assert m["vllm_gateway_build_info"][0].labels["version"]
    assert m["process_resident_memory_bytes"][0].value > 0


async def test_preamble_plans_are_exported_per_model(fake_worker, gateway, client, http):
    """cache_aware's plans of where each popular preamble goes, per model: made, and the
    preambles they moved (a unit test counts moves: test_preamble_plan.py)."""
    a = await fake_worker(models="alpha", tpot_ms=1, ttft_ms=1)
    b = await fake_worker(models="alpha", tpot_ms=1, ttft_ms=1)
    gw = await gateway([a, b])
    c = client(gw)
    system = "You answer questions about the manual. " * 60  # a preamble: over one block
    for i in range(3):
        await c.chat.completions.create(
            model="alpha",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
            max_tokens=2,
        )
    m = await scrape(http, gw)
    plans = total(
        m["vllm_gateway_preamble_plans"], "vllm_gateway_preamble_plans_total", model="alpha"
    )
    assert plans >= 1  # the first request with a popular preamble makes one
    moves = m["vllm_gateway_preamble_plan_moves"]
    assert [s.labels["model"] for s in moves if s.name.endswith("_total")] == ["alpha"]
    assert total(moves, "vllm_gateway_preamble_plan_moves_total", model="alpha") == 0


async def test_gauges_are_read_at_scrape_time(fake_worker, gateway, http):
    # Two slots: of three streams, the worker runs two and queues one, and says so.
    w = await fake_worker(models="m", tpot_ms=20, ttft_ms=1, max_num_seqs=2)
    gw = await gateway([w])
    worker = gw.app[REGISTRY].get(w.url)
    body = {"model": "m", "prompt": "x", "max_tokens": 200, "stream": True}
    responses = [await http.post(gw.url + "/v1/completions", json=body) for _ in range(3)]
    try:
        await wait_until(
            lambda: (
                worker.stats is not None and (worker.stats.running, worker.stats.waiting) == (2, 1)
            ),
            timeout=5,
        )
        m = await scrape(http, gw)

        def gauge(name: str) -> float:
            return total(m[name], name, worker=w.url)

        assert gauge("vllm_gateway_worker_inflight_requests") == 3
        assert gauge("vllm_gateway_worker_running_requests") == 2
        assert gauge("vllm_gateway_worker_waiting_requests") == 1
        assert 0 <= gauge("vllm_gateway_worker_kv_cache_usage_ratio") <= 1
        assert 0 <= gauge("vllm_gateway_worker_stats_age_seconds") < 3
        assert total(m["vllm_gateway_scrapes"], "vllm_gateway_scrapes_total") >= 1
    finally:
        for r in responses:
            r.close()
    # Streams the client left are counted as client_gone, not as the worker's failures.
    await wait_until(lambda: worker.inflight == 0)
    m = await scrape(http, gw)
    assert (
        total(m["vllm_gateway_requests"], "vllm_gateway_requests_total", outcome="client_gone") == 3
    )


async def test_retries_and_unreachable_attempts_are_counted(fake_worker, gateway, client, http):
    a = await fake_worker(models="m")
    b = await fake_worker(models="m")
    # Probes slow enough that `a` stays ready: a probe that marked it unhealthy before any
    # request went to it would leave nothing to retry (a race seen under load).
    gw = await gateway([a, b], policy="round_robin", probe=replace(FAST_PROBES, interval=30))
    await a.pause()
    c = client(gw)
    for _ in range(4):
        await c.completions.create(model="m", prompt="x", max_tokens=1)
    m = await scrape(http, gw)
    unreachable = total(
        m["vllm_gateway_requests"],
        "vllm_gateway_requests_total",
        worker=a.url,
        outcome="unreachable",
        status=0,
    )
    assert unreachable >= 1
    assert total(m["vllm_gateway_retries"], "vllm_gateway_retries_total") == unreachable
    assert (
        total(m["vllm_gateway_requests"], "vllm_gateway_requests_total", worker=b.url, outcome="ok")
        == 4
    )


async def test_label_values_are_escaped(gateway, http):
    gw = await gateway(workers=())
    gw.app[REGISTRY].add("http://127.0.0.1:9", models=('we"ird\\model\nname',))
    m = await scrape(http, gw)
    assert m["vllm_gateway_worker_model"][0].labels["model"] == 'we"ird\\model\nname'


def test_histogram_buckets_use_less_or_equal():
    h = Histogram(TTFB_BUCKETS)
    for v in (0.005, 0.0051, 0.0, 1000.0):
        h.observe(v)
    cumulative = dict(h.cumulative())
    assert cumulative["0.005"] == 2  # 0.0 and exactly 0.005
    assert cumulative["0.01"] == 3
    assert cumulative["60"] == 3 and cumulative["+Inf"] == 4
    assert h.count == 4 and h.sum == pytest.approx(1000.0101)


async def test_stats_endpoint_and_status_page(fake_worker, gateway, client, http):
    w = await fake_worker(models="m", tpot_ms=1, ttft_ms=1)
    gw = await gateway([w])
    for _ in range(3):
        await client(gw).completions.create(model="m", prompt="x", max_tokens=2)
    async with http.get(gw.url + "/stats") as r:
        doc = await r.json()
    assert doc["gateway"]["policy"] == gw.app[GATEWAY].config.policy
    (worker,) = doc["workers"]
    assert worker["url"] == w.url and worker["state"] == "ready" and worker["requests"] == 3
    (model,) = doc["models"]
    assert model["model"] == "m" and model["requests"] == 3 and model["ready"] == 1
    assert model["duration"]["count"] == 3 and model["duration"]["buckets"]["+Inf"] == 3
    for path in ("/", "/dashboard"):
        async with http.get(gw.url + path) as r:
            assert r.status == 200 and r.content_type == "text/html"
            page = await r.text()
        assert "<title>vllm-gateway</title>" in page and 'fetch("stats"' in page
    # Self-contained: nothing is loaded from elsewhere.
    for needle in ('src="http', "src='http", 'href="http', 'href="//', "@import", "url("):
        assert needle not in page
    assert all(
        link.startswith('<link rel="icon" href="data:')
        for link in page.split("\n")
        if "<link" in link
    )
    await asyncio.sleep(0)


async def test_metrics_and_page_can_be_switched_off(gateway, http):
    from vllm_gateway.config.gateway import TelemetryConfig

    gw = await gateway(workers=(), telemetry=TelemetryConfig(metrics=False, status_page=False))
    for path in ("/metrics", "/", "/dashboard"):
        async with http.get(gw.url + path) as r:
            assert r.status == 404


async def test_breaker_openings_and_circuit_are_exported(fake_worker, gateway, client, http):
    from vllm_gateway.config.gateway import BreakerConfig

    bad = await fake_worker(models="m", fault="status=500")
    good = await fake_worker(models="m")
    gw = await gateway(
        [bad, good], policy="round_robin", breaker=BreakerConfig(failures=2, open_seconds=60)
    )
    c = client(gw)
    for _ in range(6):
        with contextlib.suppress(openai.InternalServerError):
            await c.completions.create(model="m", prompt="x", max_tokens=1)
    m = await scrape(http, gw)
    openings = m["vllm_gateway_worker_breaker_openings"]
    assert total(openings, "vllm_gateway_worker_breaker_openings_total", worker=bad.url) == 1
    assert total(openings, "vllm_gateway_worker_breaker_openings_total", worker=good.url) == 0
    circuit = m["vllm_gateway_worker_circuit"]
    assert total(circuit, "vllm_gateway_worker_circuit", worker=bad.url, circuit="open") == 1
    assert total(circuit, "vllm_gateway_worker_circuit", worker=good.url, circuit="closed") == 1


async def test_stats_carry_the_autoscalers_demand_per_model(fake_worker, gateway, http):
    from vllm_gateway.config.gateway import AutoscaleConfig

    w = await fake_worker(models="m", tpot_ms=20, ttft_ms=1)
    gw = await gateway([w], autoscale=AutoscaleConfig(interval=0.05, target_per_worker=2))
    body = {"model": "m", "prompt": "x", "max_tokens": 200, "stream": True}
    streams = [await http.post(gw.url + "/v1/completions", json=body) for _ in range(3)]
    try:

        async def model_doc() -> dict:
            async with http.get(gw.url + "/stats") as r:
                return (await r.json())["models"][0]

        async with asyncio.timeout(5):
            while (doc := await model_doc())["demand"] != 3:
                await asyncio.sleep(0.05)
        assert doc["desired"] == 2  # ceil(3 requests / 2 per worker)
    finally:
        for r in streams:
            r.close()


async def test_admission_queue_and_learned_capacity_are_exported(fake_worker, gateway, http):
    from vllm_gateway.app import DISPATCHER
    from vllm_gateway.config.gateway import DispatchConfig, ScrapeConfig

    w = await fake_worker(models="m", ttft_ms=5, tpot_ms=40, max_num_seqs=1)
    gw = await gateway(
        [w],
        scrape=ScrapeConfig(interval=0.05, timeout=0.5, stale_after=1.0),
        dispatch=DispatchConfig(max_queued=2),
    )
    admission = gw.app[DISPATCHER].admission

    def body(tokens: int) -> dict:
        return {"model": "m", "prompt": "x", "max_tokens": tokens, "stream": True}

    # One runs, one waits in the worker: dispatch learns a capacity of 1; then two wait in
    # the gateway's queue and a third is refused.
    long_ones = [
        asyncio.create_task(http.post(gw.url + "/v1/completions", json=body(25))) for _ in range(2)
    ]
    dispatcher = gw.app[DISPATCHER]
    worker = gw.app[REGISTRY].get(w.url)

    def learned() -> float | None:
        bucket = dispatcher.buckets.by_worker.get(worker)
        return bucket.capacity if bucket else None

    await wait_until(lambda: learned() == 1, timeout=5)
    queued = [
        asyncio.create_task(http.post(gw.url + "/v1/completions", json=body(2))) for _ in range(2)
    ]
    await wait_until(lambda: admission.depth == 2, timeout=5)
    m = await scrape(http, gw)
    assert (
        total(
            m["vllm_gateway_admission_queue_depth"], "vllm_gateway_admission_queue_depth", model="m"
        )
        == 2
    )
    assert (
        total(m["vllm_gateway_worker_capacity"], "vllm_gateway_worker_capacity", worker=w.url) == 1
    )
    async with http.post(gw.url + "/v1/completions", json=body(2)) as r:
        assert r.status == 429
    for r in await asyncio.gather(*long_ones, *queued):
        await r.read()
    await wait_until(lambda: admission.depth == 0, timeout=10)
    m = await scrape(http, gw)
    results = m["vllm_gateway_admission_queue_requests"]
    name = "vllm_gateway_admission_queue_requests_total"
    assert total(results, name, result="rejected") == 1
    admitted = total(results, name, result="admitted")
    assert admitted == admission.admitted >= 2
    wait = m["vllm_gateway_admission_queue_wait_seconds"]
    assert total(wait, "vllm_gateway_admission_queue_wait_seconds_count", model="m") == admitted
    assert total(wait, "vllm_gateway_admission_queue_wait_seconds_sum", model="m") > 0


async def test_refused_malformed_http_is_counted(fake_worker, gateway, http):
    """Requests aiohttp's parser refuses never reach routing; they are counted all the same."""
    worker = await fake_worker(models="m")
    gw = await gateway([worker])
    smuggled = (
        b"POST /v1/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    for data in (smuggled, smuggled, request(b"{}", headers={"X-Big": "a" * 20_000})):
        answer = await exchange(gw.port, data)
        assert answer.status in (400, 431)
    errors = (await scrape(http, gw))["vllm_gateway_errors"]
    assert total(errors, "vllm_gateway_errors_total", status=400, code="malformed_request") == 2
    assert total(errors, "vllm_gateway_errors_total", status=431, code="malformed_request") == 1


def test_a_removed_workers_series_go_after_the_retention():
    m = RequestMetrics()
    for url in ("http://a:1", "http://b:1"):
        m.requests[("m", url, 200, "ok")] = 3
        m.duration[("m", url)] = Histogram(TTFB_BUCKETS)
        m.ttfb[("m", url)] = Histogram(TTFB_BUCKETS)
        m.response_bytes[("m", url)] = 10
    m.prune({"http://a:1"}, now=1000.0)  # b is gone: kept for now
    m.prune({"http://a:1"}, now=1000.0 + GONE_RETENTION_SECONDS - 1)
    assert {k[1] for k in m.requests} == {"http://a:1", "http://b:1"}
    m.prune({"http://a:1"}, now=1000.0 + GONE_RETENTION_SECONDS)
    for table in (m.requests, m.duration, m.ttfb, m.response_bytes):
        assert {k[1] for k in table} == {"http://a:1"}
    assert m.gone_since == {}
    # A worker that comes back within the retention keeps its series, and its clock restarts.
    m.requests[("m", "http://c:1", 200, "ok")] = 1
    m.prune({"http://a:1"}, now=5000.0)
    m.prune({"http://a:1", "http://c:1"}, now=5001.0)
    m.prune({"http://a:1"}, now=5000.0 + GONE_RETENTION_SECONDS + 1)
    assert ("m", "http://c:1", 200, "ok") in m.requests


async def test_metrics_of_a_removed_worker_leave_metrics(fake_worker, gateway, http, monkeypatch):
    a, b = await fake_worker(models="m"), await fake_worker(models="m")
    gw = await gateway([a, b], policy="round_robin")  # both get requests
    # Until both workers served one (a policy may send a few in a row to the same one).
    for _ in range(40):
        async with http.post(
            gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}
        ) as r:
            assert r.status == 200
        if await labelled_workers(http, gw) == {a.url, b.url}:
            break
    gw.app[REGISTRY].remove(b.url, "test")
    assert b.url in await labelled_workers(http, gw)  # its last counts are still scraped
    monkeypatch.setattr(telemetry, "GONE_RETENTION_SECONDS", 0.0)
    assert await labelled_workers(http, gw) == {a.url}


async def labelled_workers(http, gw) -> set[str]:
    return {s.labels["worker"] for s in (await scrape(http, gw))["vllm_gateway_requests"]}

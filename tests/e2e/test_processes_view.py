"""`serve --processes N`: /metrics and /stats answer for all processes, whichever is asked."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import FAST_PROBES
from tests.support.processes import sibling_apps
from vllm_gateway.config.gateway import GatewayConfig, WorkerSpec
from vllm_gateway.process.view import merge_expositions

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def two_processes(fake_worker):
    """Two gateway apps wired as siblings, as `serve --processes 2` runs them."""
    worker = await fake_worker(models="m", tpot_ms=1, ttft_ms=1)
    config = GatewayConfig(
        host="127.0.0.1", port=0, workers=(WorkerSpec(url=worker.url),), probe=FAST_PROBES
    )
    async with sibling_apps(config) as servers:
        yield worker, servers


def requests_by_process(text: str) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    out: dict[str, float] = {}
    for s in families["vllm_gateway_requests"].samples:
        out[s.labels["process"]] = out.get(s.labels["process"], 0) + s.value
    return out


async def test_metrics_and_stats_cover_every_process(two_processes, http):
    worker, (a, b) = two_processes
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    for server in (a, b, b, b):
        async with http.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200
    for server in (a, b):
        async with http.get(server.url + "/metrics") as r:
            assert requests_by_process(await r.text()) == {"0": 1, "1": 3}
        async with http.get(server.url + "/stats") as r:
            doc = await r.json()
        assert doc["gateway"]["processes"] == 2
        (w,) = doc["workers"]
        assert w["url"] == worker.url and w["requests"] == 4
        (m,) = doc["models"]
        assert m["requests"] == 4 and m["duration"]["count"] == 4
        assert m["duration"]["buckets"]["+Inf"] == 4


def test_merge_keeps_one_header_per_family():
    one = '# HELP x_total X.\n# TYPE x_total counter\nx_total{process="0"} 1\n'
    two = '# HELP x_total X.\n# TYPE x_total counter\nx_total{process="1"} 2\n'
    merged = merge_expositions([one, two])
    assert merged.count("# HELP") == 1 and merged.count("# TYPE") == 1
    (family,) = text_string_to_metric_families(merged)
    assert [s.value for s in family.samples] == [1, 2]

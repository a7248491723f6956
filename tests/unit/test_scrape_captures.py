"""The /metrics parser on pages published from real vLLM servers of several versions
(tests/data/README.md names each source): what the scraper reads from each, per model."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_gateway.config.gateway import ScrapeConfig
from vllm_gateway.fleet.scrape import MetricNames, parse_metrics

DATA = Path(__file__).parent.parent / "data"
NAMES = MetricNames.from_config(ScrapeConfig())  # the defaults, as a worker is scraped


def page(name: str) -> str:
    return (DATA / name).read_text()


@pytest.mark.parametrize(
    ("name", "model", "adapters"),
    [
        # vLLM 0.7, V0 engine: gpu_cache_usage_perc; the worker also serves LoRA adapters
        # (vllm:lora_requests_info is on the page; samples name the base model only).
        ("vllm_0.7_v0_aibrix.txt", "Qwen/Qwen2.5-Coder-1.5B-Instruct", {"lora-1", "lora-2"}),
        # vLLM 0.8, V1 engine, before the KV gauge was renamed.
        ("vllm_0.8_v1_production_stack_318.txt", "Qwen/Qwen2.5-Coder-32B-Instruct", set()),
    ],
)
def test_published_pages_give_their_models_load(name, model, adapters):
    text = page(name)
    stats = parse_metrics(text, NAMES, {model, *adapters}, at=3.0)
    # Both servers were idle when captured: 0 running, 0 waiting, KV cache at 0 (read from
    # the older gauge name, the first of the configured names that is on the page).
    assert stats is not None and (stats.running, stats.waiting, stats.at) == (0.0, 0.0, 3.0)
    assert stats.kv_cache_usage == 0.0
    # Agrees with the reference parser, which accepts the page.
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["vllm:num_requests_running"].samples
    assert sample.labels == {"model_name": model} and sample.value == stats.running
    # Another worker's model: its samples do not count (no KV figure at all).
    other = parse_metrics(text, NAMES, {"someone/else"})
    assert other is not None and other.kv_cache_usage is None


@pytest.mark.parametrize(
    ("name", "gauge_samples"),
    [
        # Gauges declared, no sample yet (vLLM 0.5/0.6 before its first stats).
        ("vllm_0.6_v0_no_samples_functionary_263.txt", 0),
        # vLLM 0.10 excerpt: the KV gauge and the `_created` gauges, no running/waiting.
        ("vllm_0.10_v1_production_stack_617.txt", 1),
        # Data parallelism, two engines: only the running gauge was published.
        ("vllm_dp_two_engines_gie_2950.txt", 2),
    ],
)
def test_pages_without_both_queue_gauges_give_no_snapshot(name, gauge_samples):
    """No made-up zeros: without running and waiting samples the worker has no snapshot, and
    dispatch falls back to the gateway's own in-flight counts."""
    text = page(name)
    assert parse_metrics(text, NAMES) is None
    read = {*NAMES.running, *NAMES.waiting, *NAMES.kv_cache}
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert len([s for s in samples if s.name in read]) == gauge_samples


def test_the_new_kv_gauge_name_is_read_with_engine_labels():
    """vLLM 0.10's page names the KV gauge vllm:kv_cache_usage_perc, labelled by engine: with
    the queue gauges of the same engine (as a full page has them), that is the figure read."""
    text = page("vllm_0.10_v1_production_stack_617.txt")
    engine = 'engine="0",model_name="zai-org/GLM-4.5"'
    full = (
        text
        + f"vllm:num_requests_running{{{engine}}} 1.0\nvllm:num_requests_waiting{{{engine}}} 0.0\n"
    )
    stats = parse_metrics(full, NAMES, {"zai-org/GLM-4.5"})
    assert stats is not None and stats.kv_cache_usage == pytest.approx(9.75010481363281e-06)
    assert parse_metrics(full, NAMES, {"zai-org/GLM-4.5", "glm-lora"}) == stats


@pytest.mark.parametrize(
    ("name", "model", "queries", "hits"),
    [
        # vLLM 0.10: the counters as vllm:prefix_cache_*_total, two engines of one model.
        ("vllm_metrics_v1.txt", "meta-llama/Llama-3.1-8B-Instruct", 246912.0, 246912.0),
        ("vllm_metrics_v1.txt", "Qwen/Qwen2.5-7B-Instruct", 123456.0, 123456.0),
        # vLLM 0.10 excerpt: queries under the new name, hits only under the older one
        # (vllm:gpu_prefix_cache_hits_total), which is read when the new one is absent.
        ("vllm_0.10_v1_production_stack_617.txt", "zai-org/GLM-4.5", 32.0, 0.0),
        # vLLM 0.7 (V0): no counters (a hit-rate gauge only): unknown, not 0.
        ("vllm_0.7_v0_aibrix.txt", "Qwen/Qwen2.5-Coder-1.5B-Instruct", None, None),
    ],
)
def test_the_prefix_cache_counters_are_read_per_model(name, model, queries, hits):
    stats = parse_metrics(page(name), NAMES, {model})
    if stats is None:  # a page without the queue gauges: add them, as a full page has them
        extra = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
        stats = parse_metrics(page(name) + extra, NAMES, {model})
    assert stats is not None
    assert (stats.cache_queries, stats.cache_hits) == (queries, hits)


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("vllm_metrics_v1.txt", "meta-llama/Llama-3.1-8B-Instruct"),
        ("vllm_metrics_v1.txt", "Qwen/Qwen2.5-7B-Instruct"),
        ("vllm_0.7_v0_aibrix.txt", "Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    ],
)
def test_the_prompt_tokens_and_requests_finished_are_summed_per_model(name, model):
    """vllm:prompt_tokens_total (one sample per engine) and vllm:request_success_total (per
    engine and finished_reason): their sums for the model are what the bytes per token
    are measured against (dispatch/kv_queue.py)."""
    text = page(name)

    def total(metric: str) -> float:
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == metric and s.labels.get("model_name") == model
        )

    tokens, done = total("vllm:prompt_tokens_total"), total("vllm:request_success_total")
    assert tokens > 0 and done > 0
    extra = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    stats = parse_metrics(text, NAMES, {model}) or parse_metrics(text + extra, NAMES, {model})
    assert stats is not None
    assert (stats.prompt_tokens, stats.requests_done) == (tokens, done)

"""What telemetry costs per request: the on_release hooks, and one /metrics scrape.

Runs each hook on prepared finished leases in a tight loop (no sockets; the relay itself
is measured by benchmarks.overhead) and prints the median µs per lease over --runs runs,
next to an empty hook as the baseline and to prometheus-client (the field's standard
library: one Counter and two Histograms with the same labels) for comparison. Then times
rendering /metrics for a fleet of --workers workers with traffic on every one.

Run it with scripts/bench_telemetry (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import time
from collections.abc import Callable

from vllm_gateway import log as logging_setup
from vllm_gateway.config.gateway import ScrapeConfig
from vllm_gateway.dispatch.dispatcher import Dispatcher, Lease
from vllm_gateway.dispatch.policies import make_policy
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.fleet.scrape import Scraper
from vllm_gateway.observe.access_log import AccessLog
from vllm_gateway.observe.telemetry import (
    DURATION_BUCKETS,
    TTFB_BUCKETS,
    ReloadCounters,
    RequestMetrics,
    render,
)
from vllm_gateway.workers import EngineStats, WorkerRegistry


def make_leases(n: int, workers: int, models: int) -> tuple[WorkerRegistry, Dispatcher, list]:
    registry = WorkerRegistry()
    ws = [
        # Never contacted: the addresses only label the series.
        registry.add(f"http://127.0.0.1:{20000 + i}", models=[f"model-{i % models}"])[0]
        for i in range(workers)
    ]
    for w in ws:
        registry.set_stats(w, EngineStats(running=3, waiting=1, kv_cache_usage=0.4, at=0.0))
    dispatcher = Dispatcher(registry, make_policy("round_robin", random.Random(1)))
    rng = random.Random(2)
    leases = []
    for i in range(n):
        w = ws[i % workers]
        model = next(iter(w.models))
        info = RequestInfo("/v1/chat/completions", b"{}", model, True, f"gw-bench-{i:x}")
        lease = Lease(dispatcher, w, info)
        lease.started -= rng.uniform(0.05, 3.0)
        lease.first_byte = lease.started + rng.uniform(0.01, 0.5)
        lease.status = 200
        lease.bytes = rng.randint(200, 20000)
        leases.append(lease)
    return registry, dispatcher, leases


def per_call_us(hook: Callable[[Lease], None], leases: list[Lease], runs: int) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for lease in leases:
            hook(lease)
        samples.append((time.perf_counter() - t0) / len(leases) * 1e6)
    return statistics.median(samples)


def prometheus_client_hook() -> Callable[[Lease], None]:
    from prometheus_client import CollectorRegistry, Counter, Histogram

    reg = CollectorRegistry()
    requests = Counter("r", "r", ["model", "worker", "status", "outcome"], registry=reg)
    ttfb = Histogram("t", "t", ["model", "worker"], buckets=TTFB_BUCKETS, registry=reg)
    duration = Histogram("d", "d", ["model", "worker"], buckets=DURATION_BUCKETS, registry=reg)

    def hook(lease: Lease) -> None:
        now = time.monotonic()
        model, url = lease.info.model, lease.worker.url
        requests.labels(model, url, lease.status, lease.outcome).inc()
        duration.labels(model, url).observe(now - lease.started)
        ttfb.labels(model, url).observe(lease.first_byte - lease.started)

    return hook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=50_000, help="leases per run")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--workers", type=int, default=100, help="fleet size for /metrics")
    parser.add_argument("--models", type=int, default=4)
    args = parser.parse_args()

    logging_setup.configure("json", "info", stream=io.StringIO())
    json_log = AccessLog()
    registry, dispatcher, leases = make_leases(args.leases, args.workers, args.models)
    metrics = RequestMetrics()
    logging_setup.configure("console", "info", stream=io.StringIO())
    console_log = AccessLog()

    def empty(lease: Lease) -> None:
        pass

    rows = [
        ("empty hook (baseline)", empty),
        ("RequestMetrics.observe (ours)", metrics.observe),
        ("prometheus-client, same series", prometheus_client_hook()),
        ("AccessLog, JSON lines", json_log.lease_done),
        ("AccessLog, console (structlog)", console_log.lease_done),
    ]
    print(f"per finished lease, median of {args.runs} runs of {args.leases} leases:")
    cost = {}
    for name, hook in rows:
        cost[name] = per_call_us(hook, leases, args.runs)
        print(f"  {name:34s} {cost[name]:6.2f} µs")
    ratio = cost["prometheus-client, same series"] / cost["RequestMetrics.observe (ours)"]
    print(f"  prometheus-client costs {ratio:.1f}x ours for the same counter and histograms")

    scraper = Scraper(registry, None, ScrapeConfig())  # type: ignore[arg-type]
    samples = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        text = render(metrics, registry, dispatcher, scraper, ReloadCounters(), time.time())
        samples.append((time.perf_counter() - t0) * 1e3)
    print(
        f"/metrics for {args.workers} workers x 1 model each, {text.count(chr(10))} lines, "
        f"{len(text) // 1024} KiB: {statistics.median(samples):.1f} ms (median)"
    )


if __name__ == "__main__":
    main()

"""The load view: how many requests a worker has running or queued, as best known right now.

A worker's own report (vLLM's running + waiting, from the last scrape) is corrected by what
the gateway did since: requests sent since the scrape count at once, so a burst never herds
onto the worker that looked idle a moment ago, and requests finished since then no longer
count. Never less than the gateway's own in-flight count to that worker (the report may
predate requests still on their way). Without a fresh report (never scraped, or stale),
the in-flight count is all there is.

Pure and cheap: policies call it for every candidate of every request. `held` is the
capacity gate's own measure (buckets.py), with what other senders had there.
`count_model` keeps each worker's in-flight count per model (the dispatcher's leases).
"""

from __future__ import annotations

from vllm_gateway.workers import Worker


def load(worker: Worker) -> float:
    """Requests running or waiting on `worker` right now, as best the gateway knows."""
    stats = worker.stats
    inflight = worker.inflight
    if stats is None:
        return inflight
    estimate = (
        stats.running + stats.waiting + worker.sent_since_scrape - worker.finished_since_scrape
    )
    return estimate if estimate > inflight else inflight


def held(worker: Worker) -> float:
    """What `worker` holds by the capacity gate's measure (buckets.py `is_full`): this
    process's in-flight requests and what other senders had on it at its last scrape
    (`Worker.others`: replicas, sibling processes, direct clients)."""
    return worker.inflight + worker.others


def count_model(worker: Worker, model: str, delta: int) -> None:
    """Count a lease in (+1) or out (-1) of the worker's in-flight requests for `model`."""
    by_model = worker.inflight_by_model
    n = by_model.get(model, 0) + delta
    if n > 0:
        by_model[model] = n
    else:
        by_model.pop(model, None)

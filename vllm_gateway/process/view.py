"""One /metrics and one /stats for all the processes of `serve --processes N`.

The kernel hands each connection to any one of the processes, so a scrape or a status page
poll would otherwise see one process's counters this time and another's the next. The
process that is asked collects its siblings' answers (siblings.py's unix sockets) and
merges them:

- /metrics: every sample carries a `process` label, so the families are concatenated, each
  under one HELP and TYPE; `sum without (process) (...)` in PromQL adds them up.
- /stats: counters (requests, failures, in-flight, histogram buckets, errors, retries, the
  admission queues) are summed per worker, model and error; the rest is the asked
  process's own view.
"""

from __future__ import annotations

from typing import Any

# Per-worker fields of /stats that are counts of this process's own requests.
WORKER_COUNTS = ("inflight", "completed", "failed", "requests", "request_failures")
MODEL_COUNTS = ("requests", "failed", "inflight")


def merge_expositions(texts: list[str]) -> str:
    """Concatenate text expositions family by family (HELP/TYPE once, samples of all)."""
    order: list[str] = []
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for text in texts:
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP "):
                family = line.split(" ", 3)[2]
                if family not in headers:
                    order.append(family)
                    headers[family] = [line]
                    samples[family] = []
            elif line.startswith("# TYPE "):
                if len(headers.get(family, ())) == 1:
                    headers[family].append(line)
            elif line and family:
                samples[family].append(line)
    out: list[str] = []
    for family in order:
        out.extend(headers[family])
        out.extend(samples[family])
    return "\n".join(out) + "\n"


def merge_stats(mine: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    """Add the siblings' /stats counters into this process's document (changed in place)."""
    workers = {w["url"]: w for w in mine["workers"]}
    models = {m["model"]: m for m in mine["models"]}
    errors = {(e["status"], e["code"]): e for e in mine["errors"]}
    gateway = mine["gateway"]
    for doc in others:
        gateway["retries"] += doc["gateway"]["retries"]
        gateway["started"] = min(gateway["started"], doc["gateway"]["started"])
        for w in doc["workers"]:
            if (own := workers.get(w["url"])) is not None:
                for key in WORKER_COUNTS:
                    own[key] += w[key]
        for m in doc["models"]:
            own = models.get(m["model"])
            if own is None:
                models[m["model"]] = own = m
                mine["models"].append(m)
                continue
            for key in MODEL_COUNTS:
                own[key] += m[key]
            for hist in ("duration", "ttfb"):
                _add_histogram(own[hist], m[hist])
        for e in doc["errors"]:
            ekey = (e["status"], e["code"])
            if ekey in errors:
                errors[ekey]["count"] += e["count"]
            else:
                errors[ekey] = e
                mine["errors"].append(e)
        _add_queue(mine.get("admission_queue"), doc.get("admission_queue"))
    mine["models"].sort(key=lambda m: m["model"])
    gateway["processes"] = 1 + len(others)
    return mine


QUEUE_COUNTS = ("depth", "admitted", "rejected", "timed_out", "abandoned", "wait_seconds")


def _add_queue(into: dict[str, Any] | None, other: dict[str, Any] | None) -> None:
    """Each process has its own admission queue: add them up."""
    if not into or not other:
        return
    for key in QUEUE_COUNTS:
        into[key] += other[key]
    into["max_wait_seen"] = max(into["max_wait_seen"], other["max_wait_seen"])
    by_model = into["by_model"]
    for model, n in other["by_model"].items():
        by_model[model] = by_model.get(model, 0) + n


def _add_histogram(into: dict[str, Any], other: dict[str, Any]) -> None:
    into["count"] += other["count"]
    into["sum"] += other["sum"]
    buckets = into["buckets"]
    for le, n in other["buckets"].items():
        buckets[le] = buckets.get(le, 0) + n

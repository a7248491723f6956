"""How the gateway placed a run's requests: the access log's `placed`, counted.

`bench_dispatch --placements` starts each gateway with its access log on (one JSON line
per finished request, into the gateway's log file) and counts the lines' `placed` values
(cache_aware's steps: history, back, preamble, overflow, home, only, load; docs/dispatch.md)
and how many waited in the gateway. Warm-up requests count too: the log has no phases.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path


def count(lines: Iterable[str]) -> Counter[str]:
    """`placed` values of the access log lines among `lines` (others are skipped), and
    `waited`: the lines whose request waited in the admission queue."""
    out: Counter[str] = Counter()
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or entry.get("event") != "request" or "worker" not in entry:
            continue
        out[str(entry.get("placed"))] += 1
        if entry.get("waited"):
            out["waited"] += 1
    return out


def of_files(paths: Iterable[Path]) -> Counter[str]:
    """`count` over the log files that exist among `paths`."""
    out: Counter[str] = Counter()
    for path in paths:
        if path.exists():
            with path.open(errors="replace") as f:
                out += count(f)
    return out


def brief(counts: Counter[str]) -> str:
    """One token for a result line: placed=history:812/home:110/...;waited:3 (most first)."""
    placed = "/".join(f"{k}:{v}" for k, v in counts.most_common() if k != "waited")
    return f"{placed or 'none'};waited:{counts['waited']}"

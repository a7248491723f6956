"""The workers' prefix-cache counters, read from their /metrics as a gateway would scrape them.

vLLM counts tokens: `vllm:prefix_cache_queries_total` (prompt tokens looked up) and
`vllm:prefix_cache_hits_total` (of which were cached). The hit rate over a window is
the ratio of the two counters' increases, summed over the workers.
"""

from __future__ import annotations

import re

import aiohttp

_SAMPLE = re.compile(r"^(vllm:prefix_cache_(?:queries|hits)_total)(?:\{[^}]*\})? (\S+)$", re.M)


async def cache_counters(
    session: aiohttp.ClientSession, workers: list[str]
) -> list[tuple[float, float]]:
    """(tokens queried, tokens hit) of each of `workers`, right now."""
    out = []
    for url in workers:
        queries = hits = 0.0
        async with session.get(url + "/metrics") as r:
            page = await r.text()
        for name, value in _SAMPLE.findall(page):
            if name.endswith("queries_total"):
                queries += float(value)
            else:
                hits += float(value)
        out.append((queries, hits))
    return out


def total(readings: list[tuple[float, float]]) -> tuple[float, float]:
    """The readings of several workers summed."""
    return sum(q for q, _ in readings), sum(h for _, h in readings)


def per_worker(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> list[dict]:
    """Each worker's tokens queried and hit rate between two readings: where the fleet's
    misses are (a worker whose cache thrashes shows a lower rate than its peers)."""
    return [
        {"queried": a[0] - b[0], "hit_rate": hit_rate(b, a)}
        for b, a in zip(before, after, strict=True)
    ]


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Hits / queries between two readings (NaN if nothing was queried)."""
    queries = after[0] - before[0]
    return (after[1] - before[1]) / queries if queries > 0 else float("nan")

"""The workers' prefix-cache counters, read from their /metrics as a gateway would scrape them.

vLLM counts tokens: `vllm:prefix_cache_queries_total` (prompt tokens looked up) and
`vllm:prefix_cache_hits_total` (of which were cached). The hit rate over a window is
the ratio of the two counters' increases, summed over the workers.
"""

from __future__ import annotations

import re

import aiohttp

_SAMPLE = re.compile(r"^(vllm:prefix_cache_(?:queries|hits)_total)(?:\{[^}]*\})? (\S+)$", re.M)


async def cache_counters(session: aiohttp.ClientSession, workers: list[str]) -> tuple[float, float]:
    """(tokens queried, tokens hit), summed over `workers`, right now."""
    queries = hits = 0.0
    for url in workers:
        async with session.get(url + "/metrics") as r:
            page = await r.text()
        for name, value in _SAMPLE.findall(page):
            if name.endswith("queries_total"):
                queries += float(value)
            else:
                hits += float(value)
    return queries, hits


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Hits / queries between two readings (NaN if nothing was queried)."""
    queries = after[0] - before[0]
    return (after[1] - before[1]) / queries if queries > 0 else float("nan")

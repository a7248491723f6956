"""Which workers each popular preamble goes to: one share-balanced plan, alike in replicas.

    plan.among(preamble, share, samples, candidates, counts, ranks_for) -> list[int] | None

A preamble (a system prompt many conversations share) goes to as many workers as its
traffic needs: `want = ceil(n x share / load_bound)` of the n workers, since each may carry
`load_bound` times its fair part; that also spreads the caching, each worker holding about
its part of the preambles and their conversations' histories. Chosen one preamble at a
time, each the first workers of its own rendezvous order, popular preambles collide: 4 of
them over 4 workers put two or more on one worker more often than not (1 - 4!/4^4 = 91%),
and that worker then caches all of them and their conversations' histories, past its KV
cache, and prefills them again and again, while another worker caches none.

The plan places the popular preambles (each at least `1 / (2n)` of the recent requests,
so at most 2n of them) together: no worker is planned more than `load_bound` x its fair
part of the traffic (by weight), unless it has nothing planned. In the order of their
hashes (the same in every replica, whatever order each saw them in), each preamble first
keeps the workers it was planned before, where they have room (a new plan moves no
preamble that need not move: a moved one is prefilled again on its new worker), then
takes the first workers of its own rendezvous order with room, else the least planned.
Two replicas see about the same shares (requests alternate between them) and start from
the same plan, so they make the same plan.

A share is measured over the last requests (`samples` of them), so it wanders: a preamble
changes its number of workers only when the measurement says so with confidence (`Z`
standard errors), not when a few conversations of one system prompt happen to start
together; until then it keeps what it has, and then moves only as far as it must. A new
preamble starts from the fewest workers its share may need.

The plan is made again only when it no longer fits: a popular preamble not in it, one
whose number of workers must change, or a candidate it was not made over; and at most
once per `4n` requests (a plan costs O(hot x n log n)). Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from vllm_gateway.workers import Worker

# Standard errors a share must move before its preamble's number of workers follows: 3, as
# a conversation's turns are not independent samples (6 turns of one conversation count as
# 6 requests), so the plain binomial error understates how much a share wanders.
Z = 3.0

RanksFor = Callable[[int, Sequence[Worker]], list[float]]


def wanted(share: float, n: int, bound: float) -> int:
    """Workers a preamble with `share` of the traffic needs: ceil(n x share / bound)."""
    return min(n, max(1, math.ceil(n * share / bound - 1e-9)))


def want_range(share: float, samples: int, n: int, bound: float) -> tuple[int, int]:
    """The fewest and most workers a measured share may need, at `Z` standard errors."""
    error = Z * math.sqrt(share * (1.0 - share) / samples) if samples > 0 else 1.0
    return wanted(share - error, n, bound), wanted(share + error, n, bound)


class PreamblePlan:
    """The planned workers (URLs) of each popular preamble, remade when it no longer fits."""

    def __init__(self, load_bound: float) -> None:
        self._bound = load_bound
        self._planned: dict[int, tuple[int, frozenset[str]]] = {}  # preamble -> (want, URLs)
        self._urls: frozenset[str] = frozenset()  # the workers the plan was made over
        self._since = 1 << 30  # requests since the plan was made (none yet: make one)
        self.builds = 0  # plans made (for tests and telemetry)

    def among(
        self,
        preamble: int,
        share: float,
        samples: int,
        candidates: Sequence[Worker],
        counts: Mapping[int, int],
        ranks_for: RanksFor,
    ) -> list[int] | None:
        """Indexes of the candidates planned for `preamble`; None when it is not planned
        (not popular, or no plan could be made yet): the caller takes its own order."""
        n = len(candidates)
        self._since += 1
        if share * 2 * n < 1:
            return None
        entry = self._planned.get(preamble)
        stale = (
            entry is None
            or not want_range(share, samples, n, self._bound)[0]
            <= entry[0]
            <= want_range(share, samples, n, self._bound)[1]
            or n > len(self._urls)
        )
        if stale and self._since >= 4 * n:
            self._build(candidates, counts, ranks_for)
            entry = self._planned.get(preamble)
        if entry is None:
            return None
        urls = entry[1]
        found = [j for j, w in enumerate(candidates) if w.url in urls]
        return found or None

    def forget(self) -> None:
        """Workers left the registry: make the plan again at the next request."""
        self._planned.clear()
        self._urls = frozenset()
        self._since = 1 << 30

    def _build(
        self, candidates: Sequence[Worker], counts: Mapping[int, int], ranks_for: RanksFor
    ) -> None:
        n = len(candidates)
        total = sum(counts.values())
        weights = [max(0.0, w.weight) for w in candidates]
        planned: dict[int, tuple[int, frozenset[str]]] = {}
        self._urls, self._since = frozenset(w.url for w in candidates), 0
        self.builds += 1
        if total <= 0 or sum(weights) <= 0:
            self._planned = planned
            return
        bins = _Bins(self._bound, weights)
        index = {w.url: j for j, w in enumerate(candidates)}
        hot = sorted(p for p, c in counts.items() if c * 2 * n >= total)
        wants: dict[int, int] = {}
        chosen: dict[int, list[int]] = {}
        for preamble in hot:  # first, each keeps the workers it had, where there is room
            share = counts[preamble] / total
            low, high = want_range(share, total, n, self._bound)
            want, had = self._planned.get(preamble, (0, frozenset()))
            # What it had while the measurement allows it; else the nearest it allows (a
            # new preamble starts from the fewest: it grows as its share is known).
            want = wants[preamble] = min(max(want, low), high)
            ranks = ranks_for(preamble, candidates)
            kept = sorted((index[u] for u in had if u in index), key=ranks.__getitem__)
            part = share / want
            chosen[preamble] = bins.take([j for j in kept if bins.fits(j, part)], want, part)
        for preamble in hot:  # then from its own order: first with room, else least planned
            want, kept = wants[preamble], chosen[preamble]
            if len(kept) < want:
                part = counts[preamble] / total / want
                ranks = ranks_for(preamble, candidates)
                order = [j for j in sorted(range(n), key=ranks.__getitem__) if j not in kept]
                fits = [j for j in order if bins.fits(j, part)][: want - len(kept)]
                rest = bins.least_planned([j for j in order if j not in fits])
                kept += bins.take(fits + rest, want - len(kept), part)
            planned[preamble] = (want, frozenset(candidates[j].url for j in kept))
        self._planned = planned


class _Bins:
    """What each worker is planned at most, and what it is planned so far: its fair part of
    the traffic (by weight) x load_bound, whatever the load. This spreads the caching, not
    the compute: each worker's cache holds its preambles and their conversations' histories.
    A worker with nothing planned takes any one preamble."""

    def __init__(self, bound: float, weights: list[float]) -> None:
        total = sum(weights)
        self.room = [bound * x / total for x in weights]
        self.used = [0.0] * len(weights)

    def fits(self, j: int, part: float) -> bool:
        return not self.used[j] or self.used[j] + part <= self.room[j] + 1e-9

    def least_planned(self, order: list[int]) -> list[int]:
        room, used = self.room, self.used
        return sorted(order, key=lambda j: used[j] / room[j] if room[j] > 0 else math.inf)

    def take(self, order: list[int], count: int, part: float) -> list[int]:
        """The first `count` of `order`, each planned `part` more."""
        taken = order[:count]
        for j in taken:
            self.used[j] += part
        return taken

"""Which workers each popular preamble goes to: one share-balanced plan, alike in replicas.

    plan.among(preamble, share, samples, candidates, counts, ranks_for) -> list[int] | None
    plan.order(preamble, candidates, ranks_for) -> list[int]   a rare one's (filled last)
    plan.forget_missing(urls)   workers left the registry
    Shares(load_bound)          the preambles' shares of one model's traffic, and its plan

A preamble (a system prompt many conversations share) goes to as many workers as its
traffic needs: `want = ceil(n x share / load_bound)` of the n workers (of weight > 0),
since each may carry `load_bound` times its fair part; that also spreads the caching, each
worker holding about its part of the preambles and their conversations' histories.
Chosen one preamble at a time, each the first workers of its own rendezvous order, popular
preambles collide: 4 of them over 4 workers put two or more on one worker more often than
not (1 - 4!/4^4 = 91%), and that worker then caches all of them and their conversations'
histories, past its KV cache, and prefills them again and again, while another worker
caches none.

The plan places the popular preambles (each at least `1 / (HOT x n)` of the recent
conversations; once planned, until below half that) together, dealt in rounds: in each, every
preamble that wants one worker more, in the order of their hashes, takes the least
planned worker (for its part) it does not have, the first of its own rendezvous order
among equals, within each worker's part of all the slots the popular preambles want: by
its weight x its KV cache (as the workers report it, so a fleet of two GPU generations
puts three times the preambles where three times the cache holds them; a worker that
reports none counts at the median report, and unless most workers report, the parts go
by weight). So each worker caches about its part of them, and none two while another has
none; and a preamble planned one worker more takes it after every preamble's first, so
it seldom moves another (with equal parts, never while the others want one worker each;
with one worker of three times the others' cache, in 18 of 300 random cases). When
the round's last picks leave room only on workers a preamble has, another preamble makes
way (moves from a full worker it lacks to one with room), or past that the preamble takes
the least planned of the rest over its slots: it gets the workers it wants.
A plan is a function of the shares and the workers (their weights and the caches they
report now) only, made from scratch each time, so
two replicas (requests alternate between them, so they measure about the same shares)
make the same plan, and any difference lasts until the next; and counted in preambles,
not in their exact shares, so shares wandering do not move preambles (each move a
prefill) while the popular ones and their numbers of workers stay the same.

Each popular preamble is planned the fewest workers its measured share surely needs (at
`Z` standard errors): a preamble near a boundary (a third of the traffic on 4 workers)
gets the fewer, and its overflow goes past its planned workers at dispatch, rather than
every worker caching two preambles where one would do for most of the time.

When it is made: when a popular preamble is not in it; when a preamble's planned number
of workers falls outside what its measured share allows at `Z` standard errors (a share
wandering around a boundary, or a few conversations of one system prompt starting
together, move nothing); when it was made over other workers; and on a schedule counted
in requests, the same in every replica: after 32, 64, 128, ... `SHARE_WINDOW` requests,
then every `SHARE_WINDOW`, so the first plans, made from few samples, are soon made again
from more. At most once per `4n` requests otherwise (a plan costs O(HOT n^2 log n)). A
worker left out for a moment (full, so not a candidate) changes nothing: the plan is
made over the workers it knew, and the request takes those of them that are candidates.
A planned preamble's fit is checked once per `4n` requests. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from vllm_gateway.dispatch.plan_bins import Bins
from vllm_gateway.workers import Worker

# A preamble is planned from `1 / (HOT x n)` of the recent conversations (and stays planned
# until below half that): at most HOT x n of them. Low enough that one of n equally
# popular preambles is planned soon after its first conversations, not after they have
# settled on a worker its own rendezvous order gave it, possibly another preamble's.
HOT = 4
# Standard errors a share must move before its preamble's number of workers follows: 3.
# Two replicas count nearly the same conversations, but not at the same moments (one sees
# a conversation a turn after the other), and each plan that follows a share's wobble
# moves preambles (each a prefill); simulated (`scripts/bench_plan`), 2 rather than 3 let
# the replicas' plans differ more often on four shapes of six (flat: 0.115 against 0.068
# of the requests), for a better balance on three (docs/dispatch-rounds.md).
Z = 3.0
# Conversations over which shares are measured (cache_aware's window), and the schedule's
# period in requests.
SHARE_WINDOW = 1024
# A worker's KV cache counts in the plan's slots up to this many times the median report.
CACHE_SPAN = 8.0
FIRST_SCHEDULED = 32

RanksFor = Callable[[int, Sequence[Worker]], list[float]]


def wanted(share: float, n: int, bound: float) -> int:
    """Workers a preamble with `share` of the traffic needs, ceil(n x share / bound), or
    all those the rest of the traffic does not need (it needs ceil(n x rest x bound) at
    most): a preamble with all the traffic has every worker, none left idle."""
    need = math.ceil(n * share / bound - 1e-9)
    spare = n - math.ceil(n * (1.0 - share) * bound - 1e-9)
    return min(n, max(1, need, spare))


def _error(share: float, samples: int) -> float:
    """`Z` standard errors of a share measured over `samples` conversations."""
    return Z * math.sqrt(share * (1.0 - share) / samples) if samples > 0 else 1.0


def _fewest(share: float, samples: int, n: int, bound: float) -> int:
    """The fewest workers a share measured over `samples` surely needs (at `Z` errors)."""
    return wanted(share - _error(share, samples), n, bound)


def _allowed(want: int, share: float, samples: int, n: int, bound: float) -> bool:
    """Whether `want` workers fit a share measured over `samples`, at `Z` standard errors."""
    error = _error(share, samples)
    return wanted(share - error, n, bound) <= want <= wanted(share + error, n, bound)


class PreamblePlan:
    """The planned workers (URLs) of each popular preamble, made again when it no longer fits."""

    def __init__(self, load_bound: float) -> None:
        self._bound = load_bound
        self._planned: dict[int, tuple[int, frozenset[str]]] = {}  # preamble -> (want, URLs)
        self._urls: frozenset[str] = frozenset()  # the workers the plan was made over
        self._known: dict[str, Worker] = {}  # them, less those that left the registry
        self._n = 0  # of them, with weight > 0
        self._seen = 0  # requests seen (count(): the schedule counts them)
        self._checked = 0  # requests seen when a planned preamble's fit was last checked
        self._next = FIRST_SCHEDULED  # the next scheduled plan, in requests seen
        self._since = 1 << 30  # requests since the last plan (none yet: one may be made)
        self.builds = 0  # plans made
        # Preambles a plan gave a worker the last plan with any did not give them (moved, or
        # one worker more): each a prefill of the preamble there, and of the histories of
        # the conversations sent there (/metrics: vllm_gateway_preamble_plan_moves_total).
        self.moves = 0
        self._last: dict[int, tuple[int, frozenset[str]]] = {}  # that last plan (for moves)
        # The workers the plan sends their fair part of the traffic or more (`order`).
        self._filled: frozenset[str] = frozenset()

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
        (not popular, no plan made yet, or none of its workers is a candidate): the caller
        takes the preamble's own order."""
        entry = self._planned.get(preamble)
        n = self._n or len(candidates)
        if entry is None and share * HOT * n < 1:
            # Too rare to plan. The schedule still runs while the plan fills a worker, which
            # rare preambles pass over (`order`): once the popular preambles are gone (their
            # conversations over), a plan made again gives that worker back to them.
            if self._filled and self._due():
                self._build(candidates, counts, ranks_for)
            return None
        if self._stale(entry, share, samples, candidates):
            self._build(candidates, counts, ranks_for)
            entry = self._planned.get(preamble)
        if entry is None:
            return None
        urls = entry[1]
        found = [j for j, w in enumerate(candidates) if w.url in urls]
        return found or None

    def order(self, preamble: int, candidates: Sequence[Worker], ranks_for: RanksFor) -> list[int]:
        """Indexes of `candidates` in the order an unplanned `preamble` tries them, and a
        planned one's overflow past its planned workers: its own rendezvous order, but the
        workers the plan fills (`_filled`) last. A preamble too rare to plan, sent
        to the worker of a hot one, copies itself into a cache the hot preamble's many
        conversations need, and both thrash (ragchat, traced: a fast worker planned the
        document of 23% of the requests took two rare ones too, and prefilled them again
        13 times); elsewhere it finds traffic to spare."""
        ranks = ranks_for(preamble, candidates)
        order = sorted(range(len(candidates)), key=ranks.__getitem__)
        if filled := self._filled:
            # The few filled moved to the end, in their order: one pass over the candidates
            # (a sort by (filled, rank) keys cost 20 us more at 64 workers).
            last = [j for j, w in enumerate(candidates) if w.url in filled]
            for j in sorted(last, key=ranks.__getitem__):
                order.remove(j)
                order.append(j)
        return order

    def urls_of(self, preamble: int) -> frozenset[str] | None:
        """The URLs planned for `preamble` now (None: not planned); no plan is made."""
        entry = self._planned.get(preamble)
        return entry[1] if entry is not None else None

    def narrowed(self, preamble: int) -> frozenset[str]:
        """The URLs planned for `preamble` when the plan gives it fewer workers than it was
        made over (empty otherwise): where it lives, as every replica's plan says."""
        entry = self._planned.get(preamble)
        return entry[1] if entry is not None and entry[0] < self._n else frozenset()

    def count(self) -> None:
        """One more request of the model with prompt text, whichever way it is placed."""
        self._seen += 1
        self._since += 1

    def forget_missing(self, present: Iterable[str]) -> None:
        """Workers left the registry: if the plan used any, make it again soon."""
        present = set(present)
        for url in [u for u in self._known if u not in present]:
            del self._known[url]
        if self._urls - present:
            self._urls = frozenset()  # no longer made over the workers there are
            self._since = 1 << 30

    def _stale(
        self,
        entry: tuple[int, frozenset[str]] | None,
        share: float,
        samples: int,
        candidates: Sequence[Worker],
    ) -> bool:
        """Whether to make the plan again now (see the module docstring)."""
        if self._due():
            return True
        gap = 4 * max(1, len(self._urls))
        if self._since < gap:
            return False
        if entry is None:
            return True
        if self._seen < self._checked + gap:  # a planned preamble's fit: now and then
            return False
        self._checked = self._seen
        if not _allowed(entry[0], share, samples, self._n, self._bound):
            return True
        # A worker it was not made over (one joined, or replaced another).
        return any(w.url not in self._urls for w in candidates)

    def _due(self) -> bool:
        """Whether the schedule (in requests seen) makes a plan now; if so, its next time."""
        if self._seen < self._next:
            return False
        self._next = self._seen + min(self._seen, SHARE_WINDOW)
        return True

    def _build(
        self, candidates: Sequence[Worker], counts: Mapping[int, int], ranks_for: RanksFor
    ) -> None:
        # Over the workers it knew that are not candidates now (full for a moment), too.
        known = self._known
        for url in [u for u, w in known.items() if not w.available]:
            del known[url]  # out (unhealthy, draining, circuit open): not planned
        known.update((w.url, w) for w in candidates)
        workers = sorted(known.values(), key=lambda w: w.url)
        total = sum(counts.values())
        weighted = sum(1 for w in workers if w.weight > 0 and math.isfinite(w.weight))
        before = self._planned
        planned: dict[int, tuple[int, frozenset[str]]] = {}
        self._urls, self._n, self._since = frozenset(known), weighted, 0
        self.builds += 1
        if total <= 0 or weighted == 0:
            self._planned, self._filled = planned, frozenset()
            return
        hot = sorted(
            p
            for p, c in counts.items()
            if p  # 0: the requests with no preamble, counted in the total only
            and (c * HOT * weighted >= total or (p in before and c * 2 * HOT * weighted >= total))
        )
        wants = [_fewest(counts[p] / total, total, weighted, self._bound) for p in hot]
        slot_weights = self._slot_weights(workers)
        bins = Bins(sum(wants), slot_weights)
        ranks = [ranks_for(p, workers) for p in hot]
        taken: list[set[int]] = [set() for _ in hot]
        # Dealt in rounds, one worker per preamble each (in hash order, as every replica):
        # a preamble planned one worker more (its share crossed a boundary) takes it in a
        # later round, after every preamble's first, so the others' first workers stay
        # (with equal parts: the parts share the slots out by their total). Dealt a
        # preamble at a time, its extra worker would be taken before the next preambles'
        # first, and push them onto other workers: each such move a prefill of every
        # conversation there, and behind two replicas, whose shares cross the boundary at
        # different times, conversations sent back and forth until both have.
        for round_ in range(max(wants, default=0)):
            for i, want in enumerate(wants):
                if round_ < want:
                    # Room left only on workers it has (the round's last picks filled the
                    # others): another preamble makes way, else past the slots on the least
                    # planned of the rest, so a preamble gets the workers it wants (not its
                    # traffic squeezed onto fewer than it needs).
                    got = (bins.take(ranks[i], taken[i]) or bins.make_way(ranks, taken, i)
                           or bins.take(ranks[i], taken[i], True))  # fmt: skip
                    taken[i].update(got)
        last = self._last
        for preamble, want, has in zip(hot, wants, taken, strict=True):
            urls = frozenset(workers[j].url for j in has)
            planned[preamble] = (want, urls)
            old = last.get(preamble)
            if old is not None and not urls <= old[1]:
                self.moves += 1
        self._planned = planned
        self._filled = _filled(workers, slot_weights, planned, counts, total)
        if planned:  # (a plan with no popular preamble is no baseline for the next)
            self._last = planned

    def _slot_weights(self, workers: Sequence[Worker]) -> list[float]:
        """Each worker's part of the plan's slots: its weight x the KV cache it reports now
        (`vllm:cache_config_info`, which every replica scrapes alike), relative to the
        median report, at most `CACHE_SPAN` times it. A worker reporting none, or nonsense
        (below a token, not finite), counts at the median. With reports from no more than
        half the workers of weight > 0, the parts go by weight: the median is then a
        truthful worker's report whenever most are truthful, so a false claim moves its
        own part only (a claim below the median costs only the claimant)."""
        sizes = []
        for w in workers:
            stats = w.stats
            tokens = stats.cache_tokens if stats is not None else None
            sizes.append(tokens if tokens is not None and 1.0 <= tokens < math.inf else 0.0)
        weighted = [x for w, x in zip(workers, sizes, strict=True) if w.weight > 0]
        known = sorted(x for x in weighted if x)
        if 2 * len(known) <= len(weighted):
            return [w.weight for w in workers]
        mid = known[(len(known) - 1) // 2]  # (the lower median: of two, the smaller)
        # (`or`: a weight of 5e-324 x a small ratio underflows to 0, which would take its
        # slot away)
        return [
            w.weight * (min(CACHE_SPAN, x / mid) if x else 1.0) or w.weight
            for w, x in zip(workers, sizes, strict=True)
        ]


def _filled(
    workers: Sequence[Worker],
    slot_weights: list[float],
    planned: Mapping[int, tuple[int, frozenset[str]]],
    counts: Mapping[int, int],
    total: int,
) -> frozenset[str]:
    """The URLs of the workers the plan sends at least their fair part of all the traffic
    (their part of the plan's slots, `slot_weights`), each planned preamble's share split
    evenly over its workers. Empty when nothing is planned. No margin: a share wobbling
    around a worker's part moves about 1/n of the rare preambles at a plan that crosses it
    (behind two replicas, until both have planned again); a margin of `Z` standard errors
    below it kept the workers an early plan from few samples filled for a thousand
    requests, and the rare preambles piled onto the others (docs/dispatch-rounds.md)."""
    if not planned or total <= 0:
        return frozenset()
    usable = [x if x > 0 and math.isfinite(x) else 0.0 for x in slot_weights]
    top = max(usable, default=0.0)
    parts = [x / top for x in usable] if top > 0 else usable
    whole = sum(parts)
    sent: dict[str, float] = {}
    for preamble, (_, urls) in planned.items():
        each = counts.get(preamble, 0) / total / max(1, len(urls))
        for url in urls:
            sent[url] = sent.get(url, 0.0) + each
    filled = set()
    for w, x in zip(workers, parts, strict=True):
        if not x > 0:
            continue
        # (sums of a few floats: a hair of tolerance at equality)
        if sent.get(w.url, 0.0) * whole >= x * (1.0 - 1e-9):
            filled.add(w.url)
    return frozenset(filled)


class Shares:
    """Each preamble's share of the model's last `SHARE_WINDOW` conversations (0: those
    with none), and the plan of where the popular ones go: cache_aware keeps one per model.

    Counted in conversations (cache_aware counts every first turn, and a later turn only
    when its conversation is new here), not in requests: behind an L4 balancer each
    replica sees about half of the requests, but both see nearly every conversation of
    several turns (its turns alternate between them), so the two count nearly the same
    samples, and their popular sets and wants differ far less than from two halves of the
    requests (simulated, `scripts/bench_plan`: requests at which two replicas send a
    preamble to different workers 0.135 against 0.205 on a docchat-like shape, 0.180
    against 0.372 on a ragchat-like one). And conversations are independent samples,
    where a conversation's turns are not. Behind N replicas a one-turn conversation is
    counted by one of them, a long one by all: shares lean toward the preambles of long
    conversations, alike in every replica (they carry more of the load, too)."""

    def __init__(self, load_bound: float) -> None:
        self._ring: deque[int] = deque()
        self._counts: dict[int, int] = {}
        self.plan = PreamblePlan(load_bound)

    @property
    def counts(self) -> dict[int, int]:
        return self._counts

    @property
    def samples(self) -> int:
        return len(self._ring)

    def add(self, preamble: int, new: bool = True) -> float:
        """One more request with `preamble`, of a conversation `new` here (else it is not
        counted again, but for the plan's schedule); return its share now."""
        self.plan.count()
        ring, counts = self._ring, self._counts
        if not new:
            return counts.get(preamble, 0) / len(ring) if ring else 0.0
        ring.append(preamble)
        counts[preamble] = counts.get(preamble, 0) + 1
        if len(ring) > SHARE_WINDOW:
            old = ring.popleft()
            left = counts[old] - 1
            if left:
                counts[old] = left
            else:
                del counts[old]
        return counts[preamble] / len(ring)

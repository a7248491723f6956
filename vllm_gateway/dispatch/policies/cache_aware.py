"""cache_aware (the default): the worker where the request costs least, prefill included.

What a request costs on a worker: the prefill of the part of its prompt the worker does
not hold in its prefix cache, plus the wait its load implies. The capacity gate
(buckets.py) already leaves out the workers that are full, so no candidate adds a queue
wait; what is left to weigh is the prefill saved against the balance given up:

1. **History** (the prefill saved is large): the candidates that were sent this
   conversation's earlier turns hold its history, which only its own turns share
   (prefix_index.py: the conversation key, then the blocks after it). Of those holding
   the most, the first in the key's rendezvous order takes it, unless its load is past a
   looser bound (`HISTORY_SLACK`): there the history is prefilled again elsewhere rather
   than pile onto one worker.
2. **Otherwise** (a new conversation, or its history is not known here): the first
   worker in the key's rendezvous order whose load stays within the load bound, among
   the workers its preamble needs. The key is the conversation's stable start
   (prefix_hash.py: the messages up to the first user message), so every turn of a
   conversation, and every replica of the gateway, gets the same home without sharing
   any state. The preamble (the system prompt) is shared by many conversations: they go
   to the first `ceil(workers x its share of recent requests x load_bound)` workers in
   the preamble's own rendezvous order (all of them for a preamble with most of the
   traffic), so each worker caches few preambles and has room for histories, while no
   preamble draws more conversations onto a worker than its traffic warrants. Past the
   bound, or outside those workers when all of them are past it, a hot worker sheds new
   conversations to the next in their order.

The load bound, per worker: `load + 1 <= ceil(fair + (load_bound - 1) x max(fair,
capacity))`, where `fair` is its share of the total load (this request included) in
proportion to its speed, pace x weight (pace: requests finished per second per running
request, learned; a worker without one yet counts with the best pace), `capacity` what
it runs at once (buckets.py; 0 while unknown) and load the load view (load.py). Near
capacity this is the classic bound (`load_bound` x fair); lightly loaded, a worker may
run a quarter of its capacity (for the default 1.25) above an even split before it sheds
new conversations, since a few requests more matter nothing to a worker with room for
many. A worker twice as fast may hold twice the requests. Rendezvous weighs by `weight`
only (pace differs slightly between replicas; the order must not).

Requests without prompt text (token ids) go to the least expected wait, as with `queue`.
Every request's blocks are recorded on the worker chosen, so its next turn finds them.
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from collections import deque
from collections.abc import Iterable, Sequence

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.load import load
from vllm_gateway.dispatch.policies.queue import QueuePolicy
from vllm_gateway.dispatch.prefix_hash import PrefixBlocks
from vllm_gateway.dispatch.prefix_index import PrefixIndex
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker

# A worker holding a conversation's history keeps it while its load is within
# 1 + HISTORY_SLACK x (load_bound - 1) of its fair share (1.5 for the default 1.25):
# elsewhere the whole history is prefilled again, so it tolerates more imbalance than a
# new conversation, which costs the same anywhere; but still bounded, so one hot
# conversation (or a flood of identical prompts) spreads.
HISTORY_SLACK = 2.0
_M64 = (1 << 64) - 1
# Requests over which each preamble's share of the traffic is counted.
SHARE_WINDOW = 1024
# Preambles whose rendezvous ranks are kept (then the cache starts over).
MAX_PREAMBLES = 4096


class _Shares:
    """Each preamble's share of the last SHARE_WINDOW requests (that had one)."""

    def __init__(self) -> None:
        self._ring: deque[int] = deque()
        self._counts: dict[int, int] = {}

    def add(self, preamble: int) -> float:
        """Count one more request with `preamble`; return its share now."""
        ring, counts = self._ring, self._counts
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


def rendezvous_rank(key: int, worker: Worker, seed: int) -> float:
    """Lower first: weighted rendezvous (-ln u / weight), `u` in (0, 1) from (key, seed).

    Integer arithmetic (a splitmix64-style finalizer of key ^ seed), the same in every
    process; Python's hash() of a tuple of ints would be too, but orders workers unevenly.
    """
    weight = worker.weight
    if weight <= 0:
        return math.inf
    x = ((key ^ seed) * 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & _M64
    u = ((x >> 11) + 0.5) / (1 << 53)
    return -math.log(u) / weight


class CacheAware:
    """History where it is, else the conversation's rendezvous home within the bound."""

    name = "cache_aware"
    load_aware = True

    def __init__(self, rng: random.Random, config: DispatchConfig | None = None) -> None:
        config = config or DispatchConfig()
        self._bound = config.load_bound
        self._fallback = QueuePolicy(rng)
        self.index = PrefixIndex()
        self._seeds: dict[str, int] = {}  # worker URL -> its rendezvous seed
        self._shares = _Shares()
        self._preamble_ranks: dict[int, dict[str, float]] = {}  # preamble -> URL -> rank

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        blocks = info.prefix_blocks()
        if blocks is None or not candidates:
            return self._fallback.select(candidates, info)
        share = self._shares.add(blocks.preamble) if blocks.preamble else 1.0
        one = len(candidates) == 1
        worker = candidates[0] if one else self._choose(candidates, blocks, share)
        self.index.record(worker, blocks)
        return worker

    def forget_missing(self, present: set[Worker]) -> None:
        """Forget the workers that left the registry (what they were sent, their ranks)."""
        self.index.forget_missing(present)
        urls = {w.url for w in present}
        for url in [u for u in self._seeds if u not in urls]:
            del self._seeds[url]
        self._preamble_ranks.clear()

    def _choose(self, candidates: Sequence[Worker], blocks: PrefixBlocks, share: float) -> Worker:
        loads = []
        best_pace = 0.0
        for w in candidates:
            loads.append(load(w))
            if w.pace > best_pace:
                best_pace = w.pace
        best_pace = best_pace or 1.0
        speeds = [(w.pace or best_pace) * w.weight for w in candidates]
        total_speed = sum(speeds)
        if total_speed <= 0:
            return candidates[0]
        # The fair load per unit of speed (this request included): a worker's limit is its
        # fair share plus (bound - 1) x that share, or x its capacity when the fleet is
        # lightly loaded (a few requests over an even split matter nothing to a worker
        # with room for many; they matter once it nears its capacity). History gets twice
        # the slack.
        per_speed = (sum(loads) + 1.0) / total_speed
        n = len(candidates)
        holders, _ = self.index.deepest(blocks.blocks, candidates)
        if holders:
            extra = HISTORY_SLACK * (self._bound - 1.0)
            ids = {id(w) for w in holders}
            among = [i for i, w in enumerate(candidates) if id(w) in ids]
            best = self._home(blocks.key, among, candidates, loads, speeds, per_speed, extra)
            if best is not None:
                return best
        extra = self._bound - 1.0
        everyone = range(n)
        want = math.ceil(n * share * self._bound)  # workers the preamble's traffic needs
        if want < n:
            ranks = self._ranks_for(blocks.preamble, candidates)
            among = heapq.nsmallest(want, everyone, key=ranks.__getitem__)
            best = self._home(blocks.key, among, candidates, loads, speeds, per_speed, extra)
            if best is not None:
                return best
        best = self._home(blocks.key, everyone, candidates, loads, speeds, per_speed, extra)
        if best is not None:
            return best
        # Nobody within the bound (cannot happen with a finite load; kept for safety).
        return min(candidates, key=lambda w: self._rank(blocks.key, w))

    def _home(
        self,
        key: int,
        among: Iterable[int],
        candidates: Sequence[Worker],
        loads: list[float],
        speeds: list[float],
        per_speed: float,
        extra: float,
    ) -> Worker | None:
        """Of the candidates at indexes `among`, the first in the key's rendezvous order
        within its load limit, `load + 1 <= ceil(fair + extra x max(fair, capacity))`."""
        best: Worker | None = None
        best_rank = math.inf
        seeds = self._seeds
        for j in among:
            w = candidates[j]
            fair = per_speed * speeds[j]
            capacity = w.capacity or w.max_num_seqs
            if loads[j] + 1.0 > math.ceil(fair + extra * (capacity if capacity > fair else fair)):
                continue
            seed = seeds.get(w.url)
            if seed is None:
                seed = seeds[w.url] = zlib.crc32(w.url.encode())
            rank = rendezvous_rank(key, w, seed)
            if rank < best_rank:
                best, best_rank = w, rank
        return best

    def _ranks_for(self, preamble: int, candidates: Sequence[Worker]) -> list[float]:
        """The candidates' rendezvous ranks for a preamble (cached: preambles are few)."""
        cached = self._preamble_ranks.get(preamble)
        if cached is None:
            if len(self._preamble_ranks) >= MAX_PREAMBLES:
                self._preamble_ranks.clear()
            cached = self._preamble_ranks[preamble] = {}
        ranks = []
        for w in candidates:
            r = cached.get(w.url)
            if r is None:
                r = cached[w.url] = self._rank(preamble, w)
            ranks.append(r)
        return ranks

    def _rank(self, key: int, worker: Worker) -> float:
        seed = self._seeds.get(worker.url)
        if seed is None:
            seed = self._seeds[worker.url] = zlib.crc32(worker.url.encode())
        return rendezvous_rank(key, worker, seed)

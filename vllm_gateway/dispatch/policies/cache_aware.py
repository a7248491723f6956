"""cache_aware (the default): the worker where the request costs least, prefill included.

What a request costs on a worker: the prefill of the part of its prompt the worker does
not hold in its prefix cache, plus the wait its load implies. The capacity gate
(buckets.py) already leaves out the workers that are full, so no candidate adds a queue
wait; what is left to weigh is the prefill saved against the balance given up:

1. **History** (the prefill saved is large): the candidates the index (prefix_index.py)
   says hold the most of this conversation's own history; the first in the key's
   rendezvous order within a looser bound (`HISTORY_SLACK`), else, for a later turn, the
   least loaded holder with a batch slot free. Only when no holder has room is the
   history prefilled again elsewhere (after waiting for a full holder's slot when that
   comes sooner: patience.py, via `preferred` and `RequestInfo.saved`). A stray (its
   history on none of its preamble's planned workers, shorter than the preamble) goes
   back to one within its fair share (`_back_home`).
2. **Otherwise** (a new conversation, or its history is not known here): the first
   worker in the key's rendezvous order within the load bound, among the workers its
   preamble needs. The key is the conversation's stable start (prefix_hash.py), so every
   turn and every replica gets the same home without sharing any state; a later turn
   whose history this process does not know (another replica placed it) takes that home
   past the bound while it has a batch slot free. A preamble (a system prompt, or a
   shared start of the first user message: `_shared`) is shared by many conversations:
   they go to the `ceil(workers x share / load_bound)` workers its share needs, as the
   plan deals them (preamble_plan.py; else the first of its own order, the workers the
   plan fills last), so each worker caches few preambles and has room for histories;
   past the bound on all of those, its next worker in that order with room (overflow).
   A holder of the preamble gets the history's looser bound. A first turn with no
   preamble leaves a home owing far more prefill than the others (`_leave_congested`).

Rendezvous weighs by `weight`, never by pace (each replica's own reading); a lone gateway
also weighs a preamble's choices by cache pressure (pressure.py). The load bound is
`LoadView.fits` (load_view.py). Without prompt text (token ids): the least expected wait,
as `queue`. Every request's blocks are recorded on the worker chosen; the step that
chose is `RequestInfo.placed` (the access log's), one of `PLACED` (docs/dispatch.md).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.backlog import congested as congested_of
from vllm_gateway.dispatch.backlog import uncached, worth_checking
from vllm_gateway.dispatch.kv_queue import BYTES_PER_TOKEN, has_kv_room
from vllm_gateway.dispatch.policies.cache_wait import history_saved, wanted_holders
from vllm_gateway.dispatch.policies.load_view import LoadView
from vllm_gateway.dispatch.policies.pressure import weighed_rank
from vllm_gateway.dispatch.policies.queue import QueuePolicy
from vllm_gateway.dispatch.policies.rendezvous import Ranks, rendezvous_rank
from vllm_gateway.dispatch.preamble_plan import Shares, wanted
from vllm_gateway.dispatch.prefix_hash import PrefixBlocks
from vllm_gateway.dispatch.prefix_index import PrefixIndex
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import Worker

# A worker holding a conversation's history keeps it while its load is within
# 1 + HISTORY_SLACK x (load_bound - 1) of its fair share (1.5 for the default 1.25):
# elsewhere the whole history is prefilled again, so it tolerates more imbalance than a
# new conversation, which costs the same anywhere; but still bounded, so a flood of
# identical prompts spreads. A later turn of a conversation stays past it while a holder
# has a batch slot free (`LoadView.least_loaded_with_room`): there the saving is the whole
# history.
HISTORY_SLACK = 2.0
# Models whose preamble shares are kept (then they start over).
MAX_MODELS = 1024
# `RequestInfo.placed`, the step that chose (docs/dispatch.md, "cache_aware"): 1, 1a, 2 among
# the preamble's workers, 2 past them, 2 by the key; one candidate; by load alone.
PLACED = ("history", "back", "preamble", "overflow", "home", "only", "load")


class CacheAware:
    """History where it is, else the conversation's rendezvous home within the bound."""

    name = "cache_aware"
    load_aware = True

    def __init__(self, rng: random.Random, config: DispatchConfig | None = None) -> None:
        config = config or DispatchConfig()
        self._bound = config.load_bound
        self._fallback = QueuePolicy(rng)
        self.index = PrefixIndex()
        self._ranks = Ranks()
        self.shares: dict[str, Shares] = {}  # model -> its preambles' shares and plan (/metrics)
        # The last request's deepest holders among its candidates, and the depth they hold.
        self._holders: list[Worker] = []
        self._depth = 0
        self.shared = 0  # what the last request shared with many, as counted (`_shared`)
        self.new = True  # whether it was its conversation's first request here (counted)
        self._step = "preamble"  # which of `_preamble_home`'s choices it made last
        self._weigh = False  # whether `_home` may weigh by cache pressure (a preamble shared)

    def select(self, candidates: Sequence[Worker], info: RequestInfo) -> Worker | None:
        blocks = info.prefix_blocks()
        self._holders, self._depth = [], 0
        if blocks is None or not candidates:
            info.placed = "load"
            return self._fallback.select(candidates, info)
        shares = self._shares_of(info.model)
        self.shared = preamble = self._shared(blocks, shares.counts)
        # Every first turn with prompt text counts (preamble 0: none), so a preamble's
        # share is of all the model's traffic, and a later turn only when its conversation
        # is new here (its key not in the index: preamble_plan.py `Shares`, so replicas
        # count alike). A first turn always: prompts that share their key (a flood, or
        # completions under one template) are as many samples as requests.
        self.new = new = not blocks.continued or not self.index.known(blocks.key)
        share = shares.add(preamble, new)
        self._weigh = bool(preamble)
        if len(candidates) == 1:
            worker: Worker | None = candidates[0]
            info.placed = "only"
            if info.stream:
                self._holders, self._depth = self.index.deepest(blocks.blocks, candidates)
        else:
            worker = self._choose(candidates, blocks, preamble, share, shares, info)
        if worker is not None:
            if info.stream:  # only a streamed answer's first byte says its prefill ended
                info.prefill = self._uncached(worker, blocks, preamble)
                info.cold = self._cold(worker, blocks, preamble)
            self.index.record(worker, blocks)
        return worker

    def told(
        self, model: str, worker: Worker | None, shared: int, preamble: int, names: Sequence[int]
    ) -> None:
        """A sibling process (`serve --processes N`) sent a request for `model` that shared
        `shared` (as counted; < 0: its conversation was not new, `self.new`), with these
        `preamble` and block `names`, to `worker` (None: not known here yet)
        (process/placement_feed.py): count and record it as `select` does its own, so the
        processes' shares, plans and indexes are alike."""
        self._shares_of(model).add(shared, shared >= 0)
        if worker is not None:
            self.index.record_names(worker, preamble, names)

    def _shares_of(self, model: str) -> Shares:
        shares = self.shares.get(model)
        if shares is None:
            if len(self.shares) >= MAX_MODELS:
                self.shares.clear()
            shares = self.shares[model] = Shares(self._bound)
        return shares

    def _uncached(self, worker: Worker, blocks: PrefixBlocks, preamble: int) -> int:
        """Prompt bytes `worker` probably lacks (backlog.py), by this request's holders."""
        depth = self._depth if worker in self._holders else 0
        return uncached(worker, blocks, preamble, depth, self.index)

    def _cold(self, worker: Worker, blocks: PrefixBlocks, preamble: int) -> bool:
        """Whether `worker` surely holds no part of the prompt (prefill_rate.py learns from
        it): by the index none of its names nor preambles; for a later turn, its history
        known on a candidate (if nowhere, another replica may have placed it there)."""
        names, index, own = blocks.blocks, self.index, blocks.preamble
        if not names or worker in self._holders or (blocks.continued and not self._holders):
            return False
        if (preamble and index.holds(preamble, worker)) or (own and index.holds(own, worker)):
            return False  # (the shared start counted may be a document, not its preamble)
        return not index.deepest(names, (worker,))[1]  # (eviction drops a prompt's head)

    def preferred(
        self, gated: Sequence[Worker], candidates: Sequence[Worker], info: RequestInfo
    ) -> list[Worker]:
        """Of the workers the capacity gate left out, those this request would rather have
        had than any candidate, as it goes elsewhere and prefills again what they hold
        (cache_wait.py). Their capacity is worth probing; the others' is not (base.py)."""
        blocks = info.prefix_blocks()
        info.saved = 0
        if blocks is None:
            return []
        shares = self.shares.get(info.model)
        preamble = self._shared(blocks, shares.counts if shares is not None else {})
        plan = shares.plan if shares is not None else None
        liked = wanted_holders(self.index, plan, self._ranks, blocks, preamble, gated, candidates)
        if liked and blocks.continued:
            info.saved = history_saved(self.index, blocks, preamble, liked, candidates)
        return liked

    def stretches(self, info: RequestInfo) -> bool:
        """Whether a worker `preferred` names, held back only by its probing limit, should
        take this request as the probe (buckets.py `stretch`): for a later turn, whose
        history elsewhere is prefilled again whole. Not for a first turn: sent past the
        limit to its preamble's or document's worker, docqa's hit rate fell (median of 6
        runs 0.745 to 0.718, TTFT p99 alike; docs/dispatch-rounds.md)."""
        blocks = info.prefix_blocks()
        return blocks is not None and blocks.continued

    def _shared(self, blocks: PrefixBlocks, counted: Mapping[int, int]) -> int:
        """What this request shares with many: the deepest prefix inside its key that is
        known, if it runs `MIN_PREAMBLE_BYTES` past the preamble (a document quoted in the
        first user message, few-shot examples, a system prompt sent as a user message):
        its name then stands for the preamble. Else the preamble (0: none).

        Known: counted as a preamble among the model's recent conversations (`counted`), or
        sent to some worker (candidate or not, so the name does not change as workers fill
        and free) that the index still remembers. The first request with it seeds the
        index; from the second on, its share keeps it known while the index forgets it
        under the requests' own blocks. But when the index knows this request's own key
        (an earlier turn of its conversation, or a retry, was sent), what it knows inside
        the key may be that turn's own names: only counted ones are shared then, so a
        conversation's later turns are placed under what its first turn counted under."""
        if not blocks.first:  # nothing named inside the key (most requests)
            return blocks.preamble
        hashes = blocks.blocks
        known = self.index.known
        own = known(blocks.key)
        for i in range(blocks.first - 1, -1, -1):  # the blocks inside the key, deepest first
            h = hashes[i]
            if h in counted or (not own and known(h)):
                return h
        return blocks.preamble

    def forget_missing(self, present: set[Worker]) -> None:
        """Forget the workers that left the registry (what they were sent, their ranks)."""
        self.index.forget_missing(present)
        urls = {w.url for w in present}
        self._ranks.forget_missing(urls)
        for shares in self.shares.values():
            shares.plan.forget_missing(urls)

    def _choose(
        self,
        candidates: Sequence[Worker],
        blocks: PrefixBlocks,
        preamble: int,
        share: float,
        shares: Shares,
        info: RequestInfo,
    ) -> Worker | None:
        holders, depth = self.index.deepest(blocks.blocks, candidates)
        self._holders, self._depth = holders, depth
        view = LoadView.of(candidates)
        if view is None or view.kv_least * BYTES_PER_TOKEN < blocks.size:  # (a cache held)
            roomy = self._with_kv_room(candidates, blocks, preamble)
            if len(roomy) < len(candidates):
                candidates, holders = roomy, [w for w in holders if w in roomy]
                depth = depth if holders else 0
                self._holders, self._depth = holders, depth
                view = LoadView.of(candidates)
        if view is None:  # all of weight 0 (or nonsense): by load alone
            info.placed = "load"
            return self._fallback.select(candidates, info)
        view.stretched = info.stretched
        if blocks.continued and view.owed:
            self._leave_congested(view, blocks, preamble)
        held = HISTORY_SLACK * (self._bound - 1.0)
        if depth > blocks.first:  # they hold the key: this conversation's own history
            if blocks.continued and preamble:
                best = self._back_home(view, blocks, preamble, share, shares, holders)
                if best is not None:
                    info.placed = self._step
                    return best
            # Few holders (a conversation's history is on one worker or two): a C scan each.
            among = [candidates.index(w) for w in holders]
            best = self._home(blocks.key, among, view, held)
            if best is None and blocks.continued:
                best = view.least_loaded_with_room(among, lambda w: self._ranks.rank(blocks.key, w))
            if best is not None:
                info.placed = "history"
                return best
        # Holders of the preamble get the history's looser bound (sent away, it is prefilled
        # again). A later turn with no history known here (another replica placed it, or
        # its holders were full): most likely on the first choice below, alike in every
        # replica but for the load bound (each replica's own view): it goes by the gate.
        extra = (self._bound - 1.0, held, preamble)
        sticky = blocks.continued
        best = self._preamble_home(view, blocks, preamble, share, shares, extra, sticky)
        step = self._step
        if best is None:  # (no preamble, or one every candidate needs)
            if not (sticky or preamble) and view.owed:  # a first turn with nothing shared
                self._leave_congested(view, blocks, preamble)
            best, step = self._home(blocks.key, range(len(candidates)), view, extra, sticky), "home"
        if best is not None:
            info.placed = step
            return best
        # Nobody within the bound (a figure not finite; a first turn's fits congested): by load.
        if congested := view.congested:
            candidates = [w for j, w in enumerate(candidates) if j not in congested]
        info.placed = "load"
        return self._fallback.select(candidates, info)

    def _with_kv_room(
        self, candidates: Sequence[Worker], blocks: PrefixBlocks, preamble: int
    ) -> Sequence[Worker]:
        """The candidates whose free KV blocks hold what the request would prefill there
        (`has_kv_room`), else all. Elsewhere vLLM keeps it waiting for blocks, and every
        request behind it: a copy into a full cache stalls a worker (its holder: a block)."""
        n, u, p = blocks.size, self._uncached, preamble  # (room for all of it first: cheap)
        room = [w for w in candidates if has_kv_room(w, n) or has_kv_room(w, u(w, blocks, p))]
        return room or candidates

    def _back_home(
        self,
        view: LoadView,
        blocks: PrefixBlocks,
        preamble: int,
        share: float,
        shares: Shares,
        holders: list[Worker],
    ) -> Worker | None:
        """A later turn whose history strayed from its preamble's planned workers, shorter
        past the preamble than the preamble: back to one within its fair share (`_step`
        back; history when back already), not the stray's copy kept for good (dispatch.md)."""
        end = blocks.shared_end(preamble)
        if blocks.size - end >= end:
            return None
        candidates, plan = view.candidates, shares.plan
        urls = plan.urls_of(preamble)  # first the few holders, not a scan of every candidate
        if urls is not None and any(w.url in urls for w in holders):
            # Back already, and the stray holds as much: not by the key's order.
            kept = [candidates.index(w) for w in holders if w.url in urls]
            self._step = "history"
            return self._home(blocks.key, kept, view, HISTORY_SLACK * (self._bound - 1.0))
        planned = plan.among(
            preamble, share, shares.samples, candidates, shares.counts, self._ranks.cached
        )
        # Within its fair share: past it, the preamble needs more workers than planned.
        self._step = "back"
        return None if planned is None else self._home(blocks.key, planned, view, 0.0)

    def _preamble_home(
        self,
        view: LoadView,
        blocks: PrefixBlocks,
        preamble: int,
        share: float,
        shares: Shares,
        extra: tuple[float, float, int],
        sticky: bool = False,
    ) -> Worker | None:
        """A new conversation among the workers its preamble needs, or its overflow worker
        (`_step` says which); None when it needs every worker. `sticky`: see `_home`."""
        candidates, key = view.candidates, blocks.key
        ranks_for = self._ranks.cached
        order: list[int] | None = None
        # The popular preambles: where the plan puts them (preamble_plan.py).
        planned = None
        if preamble:
            planned = shares.plan.among(
                preamble, share, shares.samples, candidates, shares.counts, ranks_for
            )
        if planned is None:
            if not preamble:  # nothing shared to cache: spread by the key
                return None
            # The others: each may carry `load_bound` x its fair share, so a preamble with
            # share s needs n x s / load_bound workers, the first of its own order.
            weighted = sum(1 for x in view.speeds if x > 0)  # candidates that may be chosen
            want = wanted(share, weighted, self._bound)
            if want >= weighted:
                return None
            order = shares.plan.order(preamble, candidates, ranks_for)
            planned = order[:want]
        best = self._home(key, planned, view, extra, sticky)
        if best is not None:
            self._step = "preamble"
            return best
        if order is None:  # (a planned preamble's: its overflow takes the plan's order too)
            order = shares.plan.order(preamble, candidates, ranks_for)
        return self._overflow(view, blocks, preamble, planned, order, extra)

    def _overflow(
        self,
        view: LoadView,
        blocks: PrefixBlocks,
        preamble: int,
        planned: list[int],
        order: list[int],
        extra: tuple[float, float, int],
    ) -> Worker | None:
        """A new conversation whose preamble's workers (`planned`) are all past the bound:
        the preamble's next worker in its `order` (`PreamblePlan.order`) with room, so
        its overflow lands where its earlier overflow went (alike in every replica), not
        wherever each conversation's key says. `_step` says which it chose."""
        candidates = view.candidates
        self._step = "overflow"
        congested = view.congested or ()
        need, full = blocks.shared_end(preamble), False  # what a worker without it prefills
        for j in order:
            if j in planned or not view.speeds[j] > 0 or j in congested:
                continue
            w = candidates[j]
            if view.fits(j, self._slack(j, candidates, extra)):
                if has_kv_room(w, need) or self.index.holds(preamble, w):
                    return w
                full = True
        if not full:
            return None
        # Where it would fit, no free KV blocks for a copy of the preamble: it would wait
        # there, and hold up those behind it. The least loaded of its own takes it instead.
        loads, speeds = view.loads, view.speeds
        fast = [j for j in planned if speeds[j] > 0 and j not in congested]
        self._step = "preamble"
        return candidates[min(fast, key=lambda j: loads[j] / speeds[j])] if fast else None

    def _home(
        self,
        key: int,
        among: Sequence[int],
        view: LoadView,
        extra: float | tuple[float, float, int],
        sticky: bool = False,
    ) -> Worker | None:
        """Of the candidates at indexes `among`, the first in the key's rendezvous order
        within its load limit (`LoadView.fits`; `extra`: a number, or (extra, for holders of
        the preamble, the preamble)). `sticky`: a candidate with a batch slot free
        (`LoadView.has_room`) needs nothing more. Under a shared preamble, the ranks
        weighed by cache pressure where they may be (pressure.py)."""
        best, best_rank, seeds, seed_of = None, math.inf, self._ranks.seeds, self._ranks.seed
        candidates, congested = view.candidates, view.congested or ()
        alone = len(among) == 1  # (a conversation's one holder, most often: no order to take)
        extra = extra if isinstance(extra, float) or extra[2] else extra[0]  # (no preamble)
        weigh, weighed, low = self._weigh, None, math.inf  # (a preamble shared)
        for j in among:
            if j in congested:
                continue
            w = candidates[j]
            if not (sticky and view.has_room(j)):
                e = extra if isinstance(extra, float) else self._slack(j, candidates, extra)
                if not view.fits(j, e):
                    continue
            if alone and w.weight > 0:  # (weight 0: a last resort; its rank is inf)
                return w
            rank = rendezvous_rank(key, w, seeds.get(w.url) or seed_of(w))
            if rank < best_rank:
                best, best_rank = w, rank
            if weigh:  # (under a preamble: by cache pressure, pressure.py)
                r = weighed_rank(w, rank)
                if r is None:
                    weigh = False
                elif r < low:
                    weighed, low = w, r
        return weighed if weigh and weighed is not None else best

    def _leave_congested(self, view: LoadView, blocks: PrefixBlocks, preamble: int) -> None:
        """Mark the candidates a request should leave for their prefill backlog (backlog.py):
        a later turn's (its history, once moved, moves with it), or a first turn's with no
        preamble (it costs the same prefill anywhere). Not a first turn's with a preamble or
        shared document: sent away from their workers, it would copy that prefix into one
        more cache, a cost to every request sharing it that this comparison misses."""
        speeds, size = view.speeds, blocks.size
        if worth_checking(view.owed, view.least, speeds, size):
            c, known = view.candidates, preamble or self._holders  # (else each prefills it all)
            of = (lambda j: self._uncached(c[j], blocks, preamble)) if known else None
            view.congested = congested_of(c, speeds, size, of)

    def _slack(
        self, j: int, candidates: Sequence[Worker], extra: tuple[float, float, int]
    ) -> float:
        """The slack of candidate `j`: the larger if the index says it holds the preamble."""
        base, held, preamble = extra
        return held if preamble and self.index.holds(preamble, candidates[j]) else base

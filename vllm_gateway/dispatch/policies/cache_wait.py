"""Which full workers a request would rather wait for than go elsewhere (cache_aware's
`preferred`): those that hold what it would prefill again anywhere else.

    wanted_holders(index, plan, ranks, blocks, preamble, gated, candidates) -> list[Worker]
    history_saved(index, blocks, preamble, liked, candidates) -> bytes

In order: the holders of a deeper part of its history (a later turn); else, for a later
turn whose history no worker is known here to hold (another replica placed its earlier
turns) and whose preamble the plan puts on fewer workers than all, those planned workers
(unless one is a candidate; if none is here, as below): every replica sends such a turn
among them while one has room (cache_aware `_choose`), so its history is most likely
there, where another holder of the preamble (a worker its overflow went to) has only the
preamble, and each turn sent there keeps one more copy of it cached; else the preamble's
holders (indexed or planned) if no candidate holds it; else, for a later turn with no
preamble, its key's home. Their capacity is worth probing; the others' is not (base.py).
And for a later turn, how many bytes of its history those hold that no candidate does:
what it would prefill again elsewhere (patience.py weighs it against a slot's wait).
Pure: reads the index and the plan, changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_gateway.dispatch.policies.rendezvous import Ranks
from vllm_gateway.dispatch.preamble_plan import PreamblePlan
from vllm_gateway.dispatch.prefix_hash import PrefixBlocks
from vllm_gateway.dispatch.prefix_index import PrefixIndex
from vllm_gateway.workers import Worker


def wanted_holders(
    index: PrefixIndex,
    plan: PreamblePlan | None,
    ranks: Ranks,
    blocks: PrefixBlocks,
    preamble: int,
    gated: Sequence[Worker],
    candidates: Sequence[Worker],
) -> list[Worker]:
    """The gated workers this request would rather have had than any candidate (see the
    module docstring); empty when a candidate is as good."""
    if blocks.continued:
        held, depth = index.deepest(blocks.blocks, gated)
        _, there = index.deepest(blocks.blocks, candidates)
        first = blocks.first  # deeper than the blocks inside the key: its own history
        if depth > max(there, first):
            return held
        if there > first:
            return []
    if preamble:
        # Held by this process's index, or planned: another replica put it on the
        # workers every replica's plan names (a plan of every worker names none).
        mine = plan.narrowed(preamble) if plan is not None else frozenset()
        if blocks.continued and mine:  # its history is most likely on them
            if any(w.url in mine for w in candidates):
                return []
            # (None here, all out or of weight 0 now: the preamble's holders, as below.)
            if here := [w for w in gated if w.url in mine and w.weight > 0]:
                return here
        if any(w.url in mine or index.holds(preamble, w) for w in candidates):
            return []
        return [w for w in gated if w.url in mine or index.holds(preamble, w)]
    if blocks.continued:
        return _home_of(ranks, blocks.key, gated, candidates)
    return []


def _home_of(
    ranks: Ranks, key: int, gated: Sequence[Worker], candidates: Sequence[Worker]
) -> list[Worker]:
    """[the first worker in the key's rendezvous order] if the gate left it out, else []."""
    home = min((*gated, *candidates), key=lambda w: ranks.rank(key, w))
    return [home] if home in gated else []  # (Worker equality is identity)


def history_saved(
    index: PrefixIndex,
    blocks: PrefixBlocks,
    preamble: int,
    liked: Sequence[Worker],
    candidates: Sequence[Worker],
) -> int:
    """Bytes of a later turn's prompt that `liked` hold as its own history and no
    candidate does (the best candidate holds its deepest part the index knows, or its
    preamble): what it would prefill again elsewhere. 0 when `liked` do not hold its
    history (a preamble's holders, its key's home)."""
    _, depth = index.deepest(blocks.blocks, liked)
    if depth <= blocks.first:
        return 0
    _, there = index.deepest(blocks.blocks, candidates)
    held = blocks.held_bytes(there)
    if preamble and any(index.holds(preamble, w) for w in candidates):
        held = max(held, blocks.shared_end(preamble))
    return max(0, blocks.held_bytes(depth) - held)

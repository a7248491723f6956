"""The prefill backlog: which candidates a request should leave for the prefill they owe.

    uncached(worker, blocks, preamble, depth, index) -> bytes   (what a request would owe)
    worth_checking(owed, least, speeds, size) -> bool           (a cheap bound first)
    congested(candidates, speeds, size, uncached_of) -> set | None

`Worker.backlog` is the prompt bytes a worker probably lacks of this process's streamed
requests that have not had their first byte (the dispatcher adds a request's part,
`RequestInfo.prefill`, when it leases the worker; the relay takes it off at the answer's
first body byte, which vLLM sends with the first token). docs/dispatch.md "The prefill
backlog" gives the rule and why. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from math import frexp

from vllm_gateway.dispatch.prefix_hash import BLOCK_BYTES, PrefixBlocks
from vllm_gateway.dispatch.prefix_index import PrefixIndex
from vllm_gateway.workers import Worker

# Speed classes are powers of two of the speed ratio, capped (a weight near 0 would
# overflow log2 and pow; past this a class says nothing more).
MAX_CLASS = 30
POW2 = tuple(2.0**k for k in range(MAX_CLASS + 1))  # each class's multiplier
LIMIT = 2.0 ** (MAX_CLASS - 0.5)  # the ratio past which a class rounds to MAX_CLASS
SQRT2 = math.sqrt(2.0)


def uncached(
    worker: Worker, blocks: PrefixBlocks, preamble: int, depth: int, index: PrefixIndex
) -> int:
    """Bytes of the prompt `worker` probably does not cache: past the deepest part the
    index says it holds (`depth`: the entries it holds, when it is among the deepest
    holders, else 0; then the preamble or shared start it holds), and at least the share
    of prompts it has lately missed by its own counters (Worker.miss): the index is a
    guess from what was sent, and a worker that evicts what the index thinks it holds
    (more conversations than its cache) prefills far more."""
    size = blocks.size
    if depth:
        held = blocks.held_bytes(depth)
        if depth == len(blocks.blocks) and size - held > BLOCK_BYTES:
            # It holds the deepest name, and the prompt runs past the names (32 KiB after
            # the key): counted held but for its last block, rather than a long history
            # counted uncached on the worker that has it.
            held = size - BLOCK_BYTES
    elif preamble and index.holds(preamble, worker):
        held = blocks.shared_end(preamble)
    else:
        held = 0
    return max(size - held, int(worker.miss * size))


def worth_checking(owed: float, least: float, speeds: Sequence[float], size: int) -> bool:
    """Whether any candidate may be left out (`congested` would find one): the largest
    backlog `owed`, at the largest speed class, past the least by more than `size` (a
    typical candidate owes at least the least). A speed class is at most 1.5x the ratio it
    rounds; speed 0 (weight 0) never counts."""
    low = min(speeds)
    if low <= 0:  # (rare: a candidate of weight 0)
        low = min((x for x in speeds if x > 0), default=0.0)
    return low > 0 and owed * 1.5 * max(speeds) / low - least > size


def congested(
    candidates: Sequence[Worker],
    speeds: Sequence[float],
    size: int,
    uncached_of: Callable[[int], int] | None,
) -> set[int] | None:
    """The candidates a request of `size` prompt bytes (a later turn, or a first turn
    with no preamble: cache_aware.py) should leave for their backlog, counted per speed
    class (pace x weight to the fastest candidate's, rounded to a power of two, so one
    kind of GPU is one class whatever its learned paces). Candidate `j` is left out when
    its backlog exceeds what a typical candidate owes (the lower median) by more than
    moving costs: the whole prompt prefilled elsewhere (`size`, the turn's own wait
    there), plus the work the move adds to that worker's queue for the requests behind
    it (`size - uncached_of(j)`: what `j` would not have had to prefill; `uncached_of(j)`
    is at least 0, and None when none holds any of it). So a holder that has the history
    is left only behind about two prompts' worth more prefill than elsewhere, one that
    evicts it behind one. The typical candidate, not the least: the turn goes to its key's home
    among the rest (cache_aware.py), which may owe up to a prompt more than the least
    (past that, one without the history is left out too), so from the least a move could
    save next to nothing while paying what this comparison does not count (the history
    copied into one more cache, its old copy dead); when every worker is busy
    prefilling, one owing nothing for a moment moved many histories (docs/dispatch.md
    "The prefill backlog"). None when there are none."""
    top, low = max(speeds), min(speeds)
    # A class, round(log2(top / speed)), is the exponent of top / speed x sqrt(2) less one
    # (frexp: m x 2^e, m in [0.5, 1)): one C call, not log2, round and pow.
    pairs = zip(candidates, speeds, strict=True)
    if low * SQRT2 > top:  # (one kind of worker: every class the fastest's, 2 ** 0)
        owed: list[float] = [w.backlog for w, _ in pairs]
        ordered = sorted(owed)
    elif low * LIMIT > top:  # (none of weight 0, no class past the cap)
        scaled = top * SQRT2
        owed = [w.backlog * POW2[frexp(scaled / s)[1] - 1] for w, s in pairs]
        ordered = sorted(owed)
    else:
        owed = [w.backlog * _class(top / s) if s > 0 else math.inf for w, s in pairs]
        # (weight 0: never chosen but as a last resort; owes nothing comparable)
        ordered = sorted(x for x in owed if x != math.inf)
    if not ordered:
        return None
    bar = ordered[(len(ordered) - 1) // 2] + size  # the typical candidate's, plus the prompt
    if uncached_of is None:  # every candidate would prefill the whole prompt
        out = {j for j, x in enumerate(owed) if x > bar}
    else:  # (past bar + size, left whatever it holds: uncached_of only between)
        far = bar + size
        out = {j for j, x in enumerate(owed) if x > far or (x > bar and x > far - uncached_of(j))}
    return out or None


def _class(ratio: float) -> float:
    """2 ** round(log2(ratio)) for a speed ratio >= 1, capped at 2 ** MAX_CLASS."""
    return POW2[frexp(ratio * SQRT2)[1] - 1] if ratio < LIMIT else POW2[MAX_CLASS]

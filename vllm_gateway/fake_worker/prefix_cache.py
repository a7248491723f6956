"""vLLM's automatic prefix cache, in blocks: lookup, pinning, LRU eviction, usage.

Pure bookkeeping (no asyncio, no clock), shaped after vLLM V1's KV-cache manager:

- A prompt is cut into blocks of `block_size` tokens. Each full block is named by a
  chained hash, hash(parent's hash, the block's token ids), seeded with the model name,
  so two prompts share exactly the blocks of their common block-aligned prefix.
- `claim` looks the prompt's blocks up in order and stops at the first miss. As in
  vLLM, at least the prompt's last token is always computed, so a prompt that is
  cached whole still misses its last block (or its only one). With a capacity, it
  refuses (None) a prompt whose blocks do not fit beside those running sequences hold,
  as vLLM's scheduler leaves a request waiting when `allocate_slots` finds too few free
  blocks (cached blocks nobody uses count as free: they are evicted for it).
  `refresh`, when the prefill starts, takes as hits the blocks other sequences computed
  since, and counts the prompt's tokens as queried and the cached ones as hits
  (vllm:prefix_cache_queries/hits). `admit` is both at once, never refused.
- A running sequence pins its blocks: the cached ones it hit, and blocks for the rest
  of its prompt and for every token it generates. The new full prompt blocks become
  visible to other requests only once computed (`commit`, after prefill), as in vLLM,
  where blocks are cached at the end of the step that fills them.
- Generated tokens extend the same chain, as in vLLM V1: `grow` is told which new
  tokens' KV is computed (a token's KV is computed in the step after it is sampled, so
  the answer's last token never is), and each block they fill is published under its
  chained hash. The next turn of a conversation, whose prompt quotes the answer, then
  hits the answer's full blocks where the answer was made. A partial last block is
  held without a hash: it counts toward usage and is freed when the sequence ends.
- A block no running sequence uses stays cached, in LRU order, until space is needed.
  Released sequences give their blocks back tail first, so a prompt's tail is evicted
  before its head (as vLLM's free queue does).
- With `capacity=None` nothing is ever evicted. With a capacity, a running sequence's
  generated tokens still get blocks past it (the fake does not preempt, where vLLM
  would); usage then reads 1.0. A sequence holds its blocks until it ends: one whose
  client stalls (the `stall_midstream` fault, a slow reader) holds them for as long,
  and a request whose blocks do not fit waits that long (vLLM would finish generating).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


def _seed(model: str) -> int:
    """The chain's root: blocks of different models never share a hash."""
    return zlib.crc32(model.encode())


def block_hashes(model: str, token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks: hash(parent, block tokens)."""
    # Tuples of ints hash the same in every process (only str/bytes hashes are salted).
    parent = _seed(model)
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        out.append(parent)
    return out


@dataclass(eq=False)
class Sequence:
    """One running request's hold on the cache."""

    pinned: list[int]  # hashes of the cached prompt blocks it holds, in prompt order
    pending: list[int]  # hashes of prompt blocks it is computing (held privately until commit)
    private: int  # blocks held without a hash: pending ones, a partial block, generated tokens
    tokens: int  # tokens the sequence holds (prompt + generated so far)
    hit_tokens: int  # prompt tokens found in the cache (at the claim, then at `refresh`)
    parent: int  # chained hash of the last full block (the model's seed before any)
    tail: list[int]  # computed token ids after that block, fewer than a block
    released: bool = field(default=False)

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens this sequence must prefill itself."""
        return self.tokens - self.hit_tokens


class PrefixCache:
    """The block pool of one worker: cached blocks by hash, pinned or evictable."""

    def __init__(self, block_size: int, capacity: int | None, overcommit: bool = False) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.overcommit = overcommit  # claims never refused (--kv-overcommit)
        self._refs: dict[int, int] = {}  # cached block hash -> sequences pinning it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refs == 0, LRU first
        self._private = 0  # blocks held by sequences without a hash
        self.queries = 0  # prompt tokens looked up, since start
        self.hits = 0  # of which found cached

    # --- what /metrics reports ---------------------------------------------------------

    @property
    def blocks_in_use(self) -> int:
        """Blocks some running sequence holds (pinned or private)."""
        return len(self._refs) - len(self._evictable) + self._private

    @property
    def blocks_cached(self) -> int:
        """Blocks that hold a prompt's KV, pinned or evictable."""
        return len(self._refs)

    def usage(self) -> float | None:
        """Fraction of the capacity in use (0..1), or None without a capacity."""
        if self.capacity is None:
            return None
        return min(1.0, self.blocks_in_use / self.capacity)

    # --- a sequence's life -------------------------------------------------------------

    def admit(self, model: str, token_ids: list[int]) -> Sequence:
        """Claim the prompt's blocks even past the capacity, and count its lookup."""
        seq = self.claim(model, token_ids, force=True)
        assert seq is not None  # forced
        self.refresh(seq)
        return seq

    def claim(self, model: str, token_ids: list[int], force: bool = False) -> Sequence | None:
        """Pin what hits and hold blocks for the rest of the prompt; None (nothing held)
        when those do not fit in the capacity beside the blocks running sequences hold,
        unless `force` (the caller runs nothing else: the prompt could wait for good) or
        the cache over-commits."""
        size = self.block_size
        hashes = block_hashes(model, token_ids, size)
        # vLLM computes at least the last prompt token, so it never hits the whole prompt.
        limit = min((len(token_ids) - 1) // size, len(hashes))
        refs = self._refs
        hit = 0
        while hit < limit and hashes[hit] in refs:
            hit += 1
        rest = -(-len(token_ids) // size) - hit
        if self.capacity is not None and not (force or self.overcommit):
            # Cached blocks nobody uses are free to evict, but not the ones it hits:
            # pinning those takes them out of the free pool (as vLLM's allocate_slots).
            revived = sum(1 for h in hashes[:hit] if h in self._evictable)
            if self.blocks_in_use + revived + rest > self.capacity:
                return None
        for h in hashes[:hit]:
            self._pin(h)
        seq = Sequence(
            pinned=hashes[:hit],
            pending=hashes[hit:],
            private=0,
            tokens=len(token_ids),
            hit_tokens=hit * size,
            parent=hashes[-1] if hashes else _seed(model),
            tail=token_ids[len(hashes) * size :],
        )
        self._hold(seq, rest)
        return seq

    def refresh(self, seq: Sequence) -> None:
        """The prefill starts: prompt blocks other sequences computed since the claim are
        hits now (their private blocks go back); count the prompt as looked up."""
        size = self.block_size
        limit = (seq.tokens - 1) // size
        refs, pending = self._refs, seq.pending
        taken = 0
        while taken < len(pending) and len(seq.pinned) < limit and pending[taken] in refs:
            self._pin(pending[taken])
            seq.pinned.append(pending[taken])
            taken += 1
        if taken:
            del pending[:taken]
            seq.private -= taken
            self._private -= taken
            seq.hit_tokens += taken * size
        self.queries += seq.tokens
        self.hits += seq.hit_tokens

    def commit(self, seq: Sequence) -> None:
        """The prompt is computed: its full blocks become cached and visible to others."""
        for h in seq.pending:
            self._publish(seq, h)
        seq.pending = []

    def grow(self, seq: Sequence, tokens: int, computed: Iterable[int] = ()) -> None:
        """The sequence now holds `tokens` tokens: hold blocks for the new ones, and
        publish each block that the newly `computed` token ids (in order) fill."""
        size = self.block_size
        have = -(-seq.tokens // size)
        seq.tokens = max(seq.tokens, tokens)
        self._hold(seq, -(-seq.tokens // size) - have)
        tail = seq.tail
        for token in computed:
            tail.append(token)
            if len(tail) == size:
                seq.parent = hash((seq.parent, tuple(tail)))
                self._publish(seq, seq.parent)
                tail.clear()

    def release(self, seq: Sequence) -> None:
        """The sequence ended (finished or aborted): unpin its blocks, free the rest."""
        if seq.released:
            return
        seq.released = True
        self._private -= seq.private
        seq.private = 0
        for h in reversed(seq.pinned):  # tail first: evicted before the head
            self._refs[h] -= 1
            if self._refs[h] == 0:
                self._evictable[h] = None
        seq.pinned = []
        self._evict(0)

    # --- the pool ----------------------------------------------------------------------

    def _publish(self, seq: Sequence, h: int) -> None:
        """One of the sequence's private blocks is computed: cache it under `h`."""
        seq.private -= 1
        self._private -= 1
        if h in self._refs:  # computed meanwhile by another sequence: share theirs
            self._pin(h)
        else:
            self._refs[h] = 1
        seq.pinned.append(h)

    def _pin(self, h: int) -> None:
        self._refs[h] += 1
        self._evictable.pop(h, None)

    def _hold(self, seq: Sequence, blocks: int) -> None:
        if blocks <= 0:
            return
        self._evict(blocks)
        seq.private += blocks
        self._private += blocks

    def _evict(self, room: int) -> None:
        """Evict least recently used unpinned blocks until `room` more blocks fit."""
        if self.capacity is None:
            return
        excess = len(self._refs) + self._private + room - self.capacity
        while excess > 0 and self._evictable:
            h, _ = self._evictable.popitem(last=False)
            del self._refs[h]
            excess -= 1

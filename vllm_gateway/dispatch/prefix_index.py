"""Which worker was sent which prompt blocks: the gateway's guess of each worker's prefix cache.

    index.record(worker, blocks)       after a request for `blocks` was sent to `worker`
    index.record_names(worker, p, hs)  the same, told by a sibling process
    index.deepest(blocks, candidates)  the candidates holding the longest prefix of `blocks`
    index.holds(h, worker)             whether `worker` holds hash `h` (e.g. a preamble's)
    index.known(h)                     whether any worker does
    index.forget_missing(present)      drop the workers that left the registry

Per worker, the block names sent there (prefix_hash.py), with the preamble's CRC-32 as one
more entry, in least-recently-sent order (of one prompt, its head first: what stays longest
is its deepest names, which tell the latest holder of a conversation that moved from an
earlier one; vLLM itself evicts a prompt's tail first, but the index is a guess for routing),
bounded like a cache: past `capacity` blocks the least recently sent is evicted, as vLLM
evicts the least recently used free block. `capacity` is the worker's KV cache in our
blocks when it reports one (`vllm:cache_config_info`: num_gpu_blocks x block_size
tokens, counted at the bytes per token measured for it, or `BYTES_PER_TOKEN` until one
is, at most `DEFAULT_CAPACITY`), else `DEFAULT_CAPACITY`.
Beside it, block hash -> the workers holding it, so finding the deepest match is a walk
from the request's last block back towards its first, one dict lookup per block,
stopping at the first block any candidate holds: a conversation's next turn finds its
history after a block or two.

Pure (no I/O, no clock); a guess, not a mirror: a worker that evicted sooner, or restarted,
just costs a prefill where a hit was expected.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from vllm_gateway.dispatch.prefix_hash import BLOCK_BYTES, PrefixBlocks
from vllm_gateway.workers import Worker

# Bytes of prompt text per token, to size the index from a worker's KV cache in tokens
# while no figure is measured for the worker. English with the usual tokenizers is ~4,
# chat JSON adds its keys and quotes, and code, numbers or identifiers run to 8-12.
# Counted high: with nothing measured, forgetting a history the worker still holds sends
# its next turn elsewhere to prefill all of it again (and makes replicas disagree).
BYTES_PER_TOKEN = 16
# Once measured for the worker (`Worker.token_bytes`, dispatch/kv_queue.py), its cache is
# counted at that figure, within these bounds (never past BYTES_PER_TOKEN). A KV cache
# evicts its least recently used free blocks long before it binds (keeps requests waiting
# for blocks), silently; counted high, the index kept naming a worker the holder of
# documents and histories it had evicted, so their conversations, new ones too, kept
# going there (with a holder's looser load bound) to prefill them again, each copy
# evicting the next (docchat: docs/dispatch-rounds.md "The index sized at the measured bytes
# per token"). The other error, forgetting what the worker still holds, is the smaller at
# the measured figure (the cache keeps about what fits), if the figure is right: other
# senders' longer prompts, or requests vLLM aborts without counting them, read it low.
MIN_BYTES_PER_TOKEN = 2.0
# Blocks remembered per worker that reports no cache size: 16384 x 1 KiB = 16 MiB of
# prompt text, 1-4M tokens; larger than most workers' KV cache, so a worker that does not
# report its size is credited with what it was sent recently, rather than forgotten early.
DEFAULT_CAPACITY = 16384


def capacity_of(worker: Worker) -> int:
    """Blocks the index remembers for `worker`: like its KV cache, when it reports one."""
    stats = worker.stats
    tokens = stats.cache_tokens if stats is not None else None
    if not tokens:
        return DEFAULT_CAPACITY
    # Never more than a worker that does not report: the gateway's memory stays bounded
    # (a few hundred bytes per block remembered) whatever a worker claims.
    per_token = float(BYTES_PER_TOKEN)
    if worker.token_bytes > 0:
        per_token = min(per_token, max(MIN_BYTES_PER_TOKEN, worker.token_bytes))
    return max(1, min(DEFAULT_CAPACITY, int(tokens * per_token // BLOCK_BYTES)))


class PrefixIndex:
    """Per worker, the prompt blocks recently sent to it."""

    def __init__(self) -> None:
        self._sent: dict[Worker, OrderedDict[int, None]] = {}
        self._where: dict[int, set[Worker]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def blocks_of(self, worker: Worker) -> int:
        """Blocks remembered for `worker` now."""
        sent = self._sent.get(worker)
        return len(sent) if sent is not None else 0

    def record(self, worker: Worker, blocks: PrefixBlocks) -> None:
        """`worker` was sent a prompt with these blocks: it holds them now."""
        self.record_names(worker, blocks.preamble, blocks.blocks)

    def record_names(self, worker: Worker, preamble: int, hashes: Sequence[int]) -> None:
        """`worker` was sent a prompt with these block names (`PrefixBlocks.blocks`) and
        `preamble` (0: none), by this process or, with `serve --processes N`, a sibling
        (process/placement_feed.py)."""
        sent = self._sent.get(worker)
        if sent is None:
            sent = self._sent[worker] = OrderedDict()
        where = self._where
        touch = sent.move_to_end
        if preamble:  # its own entry, so a new conversation finds who holds it
            hashes = [preamble, *hashes]
        for h in hashes:
            if h in sent:
                touch(h)
            else:
                sent[h] = None
                holders = where.get(h)
                if holders is None:
                    where[h] = {worker}
                else:
                    holders.add(worker)
        excess = len(sent) - capacity_of(worker)
        for _ in range(excess):
            self._drop(worker, sent.popitem(last=False)[0])

    def holds(self, h: int, worker: Worker) -> bool:
        """Whether `worker` was sent block (or preamble) hash `h` and holds it still."""
        holders = self._where.get(h)
        return holders is not None and worker in holders

    def deepest(
        self, hashes: Sequence[int], candidates: Sequence[Worker]
    ) -> tuple[list[Worker], int]:
        """The candidates holding the longest prefix of `hashes` (chained: each stands for
        all before it), and its length; ([], 0) when none holds even the first."""
        where = self._where
        for depth in range(len(hashes), 0, -1):
            holders = where.get(hashes[depth - 1])
            if holders:
                found = [w for w in holders if w in candidates]
                if found:
                    return found, depth
        return [], 0

    def known(self, h: int) -> bool:
        """Whether some worker (whichever) was sent block hash `h` and holds it still."""
        return h in self._where

    def forget_missing(self, present: set[Worker]) -> None:
        """Forget what was sent to workers no longer in the registry."""
        for worker in [w for w in self._sent if w not in present]:
            for h in self._sent.pop(worker):
                self._drop(worker, h)

    def _drop(self, worker: Worker, h: int) -> None:
        holders = self._where.get(h)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._where[h]

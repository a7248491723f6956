"""A request's prompt as hashes of its block-aligned prefixes, and its stable key.

    prefix_blocks(doc) -> PrefixBlocks | None        (pure; None: no text to hash)

The prompt text is the completion `prompt` (a string, or the first of a list of strings)
encoded as UTF-8, or the chat `messages` as JSON (orjson's, so the same messages are the
same bytes; one C call, cheaper than walking the messages in Python). It is cut into
blocks of `BLOCK_BYTES`; each block-aligned prefix is named, so equal names mean equal
prefixes, as in vLLM's own prefix cache, and a conversation's next turn (the same
messages plus new ones) repeats every name of the turn before. A name is the CRC-32 of
all of the prefix (one pass, each CRC going on from the one before: CRC-32 chains) tagged
with its length in blocks: the same in every process and replica, so replicas name a
shared prefix, and a conversation's history, alike, and may tell each other where they
sent it (process/placement_feed.py).

The **preamble** is what many conversations share: for chat, the messages before the first
user message (the system prompt); its CRC-32 lets dispatch keep the conversations that
share it on as few workers as their traffic needs (policies/cache_aware.py). A completion
prompt has none, nor does a chat whose preamble is shorter than `MIN_PREAMBLE_BYTES`.
What else many requests share (a document quoted at the start of the first user message,
few-shot examples, a system prompt sent as a user message) shows as blocks inside the key
that were seen before; only those that end at least `MIN_PREAMBLE_BYTES` past the
preamble are named (a match inside the preamble would say nothing the preamble does not).

The **key** is the part that stays the same for every turn of one conversation and
differs between conversations: for chat, the messages up to and including the first user
message (the system prompt alone is shared by many conversations; with the first user
message it is one conversation's); for a completion prompt, its first `KEY_BYTES`. Its
CRC-32 is what a rendezvous choice keys on.

`blocks` lists the names of those blocks inside the key (up to `MAX_BLOCKS` deep), then
the key's own CRC (untagged: a name no block has), then the blocks after the key (at most
`MAX_BLOCKS` more, the one holding the key's end read from its start): each stands for
the whole prefix up to its end, so the later an entry a worker holds, the more of the
prompt it holds.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import orjson

# 1 KiB: about 256 tokens of English text (16 of vLLM's default 16-token blocks), a turn
# or two of a conversation. Each block costs a CRC call (~0.3-1 us), so the
# size trades the depth resolution of a match for CPU per request.
BLOCK_BYTES = 1024
# Blocks named inside the key, and again after it: 32 x 1 KiB = 32 KiB each; a longer
# prompt is matched on its first 32 KiB of each (they tell it apart well enough).
MAX_BLOCKS = 32
# The key of a completion prompt (no message structure to tell a conversation by).
KEY_BYTES = 1024
# A preamble shorter than one block (~256 tokens) is not one: its prefill is a few
# milliseconds wherever it runs, not worth gathering its conversations (and their load)
# onto few workers; they spread by their keys. Likewise a shared part of the first user
# message counts only when it runs at least this far past the preamble.
MIN_PREAMBLE_BYTES = BLOCK_BYTES
_TAG = 32  # a block's name: its prefix's CRC-32 | (its length in blocks << _TAG)


class PrefixBlocks:
    """One request's prefix names: `blocks[:first]` the blocks inside the key a shared
    match could end at (`MIN_PREAMBLE_BYTES` past the preamble and on), `blocks[first]` the
    key's, the rest the blocks after it; each stands for a whole prefix."""

    __slots__ = (
        "blocks",
        "continued",
        "first",
        "key",
        "key_end",
        "preamble",
        "preamble_end",
        "size",
    )

    def __init__(
        self,
        key: int,
        first: int,
        blocks: list[int],
        preamble: int = 0,
        continued: bool = False,
        size: int = 0,
        key_end: int = 0,
        preamble_end: int = 0,
    ) -> None:
        self.key = key  # CRC-32 of the key: the same in every process
        self.first = first  # names of blocks wholly inside the key, before the key's own
        self.blocks = blocks
        self.preamble = preamble  # CRC-32 of the preamble; 0: none
        # A later turn of a chat: messages follow the first user message (its history was
        # sent somewhere before, by this process or another replica).
        self.continued = continued
        self.size = size  # bytes of prompt text
        self.key_end = key_end  # where the key ends in them
        self.preamble_end = preamble_end  # where the preamble ends (0: no preamble)

    def shared_end(self, name: int) -> int:
        """Where the preamble, or a shared start named inside the key (its name carries
        its end, in blocks), ends in the prompt."""
        return self.preamble_end if name == self.preamble else (name >> _TAG) * BLOCK_BYTES

    def held_bytes(self, depth: int) -> int:
        """Bytes of the prompt that `blocks[:depth]` stand for (a worker holding entry
        `depth - 1` holds that much of it)."""
        if depth <= 0:
            return 0
        i = depth - 1
        first = self.first
        if i < first:  # a block inside the key: its name carries its end, in blocks
            return (self.blocks[i] >> _TAG) * BLOCK_BYTES
        key_end = self.key_end
        if i == first:
            return key_end
        return min(self.size, (key_end // BLOCK_BYTES + i - first) * BLOCK_BYTES)


def _chat(messages: list[Any]) -> tuple[bytes, int, int, bool] | None:
    """The messages as bytes (their JSON, as orjson writes it: the same messages always
    give the same bytes, whatever the client's spacing), where the preamble (the messages
    before the first user message) ends in them (0 for a chat shorter than a block: it has
    none), where the key ends, and whether messages follow the key (a later turn)."""
    if not messages:
        return None
    key = len(messages)  # no user message: all of it is the key
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            key = i + 1
            break
    whole = key == len(messages)
    try:
        data = orjson.dumps(messages)
        if whole and len(data) < BLOCK_BYTES:  # no block and no preamble: the key alone
            return data, 0, len(data) - 1, False
        # The JSON of the first k messages is the whole's prefix but for its "]": "[", then
        # the messages joined by ",", so it ends at k + their lengths summed. Each of the
        # key's messages is dumped once more (not the key and the preamble, each whole).
        end = 0
        ends = [0]
        for m in messages[: key - 1 if whole else key]:
            end += len(orjson.dumps(m)) + 1
            ends.append(end)
    except TypeError:  # e.g. an integer beyond 64 bits: not worth hashing
        return None
    key_end = len(data) - 1 if whole else ends[key]
    return data, ends[key - 1], key_end, not whole


def prefix_blocks(doc: Mapping[str, Any]) -> PrefixBlocks | None:
    """The request's prefix hashes; None when it has no prompt text (e.g. token ids)."""
    prompt = doc.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
    if isinstance(prompt, str):
        data = prompt.encode()
        key_end, preamble_end, continued = min(len(data), KEY_BYTES), 0, False
    else:
        messages = doc.get("messages")
        found = _chat(messages) if isinstance(messages, list) else None
        if found is None:
            return None
        data, preamble_end, key_end, continued = found
    return _named(data, preamble_end, key_end, continued)


def _named(data: bytes, preamble_end: int, key_end: int, continued: bool) -> PrefixBlocks:
    """Name the prefixes of `data`. Up to the key's end, one CRC pass (the CRC of a prefix
    goes on from that of the prefix before it), cut at the preamble's end, at each block's
    end inside the key that lies `MIN_PREAMBLE_BYTES` past it, and at the key's end; after
    it, the CRC chained on over each block from the key's."""
    size = BLOCK_BYTES
    crc32 = zlib.crc32
    if len(data) < size:  # no block, and no preamble (shorter than one): the key alone
        key = crc32(data[:key_end])
        return PrefixBlocks(key, 0, [key], 0, continued, len(data), key_end)
    view = memoryview(data)  # slices without copies
    crc = crc32(view[:preamble_end]) if preamble_end else 0
    preamble = crc if preamble_end >= MIN_PREAMBLE_BYTES else 0
    pos = preamble_end
    blocks: list[int] = []
    # Inside the key, only blocks a shared match could end at are named (the preamble is
    # named as a whole, and a match inside it would be nothing more).
    shared_from = -(-(preamble_end + MIN_PREAMBLE_BYTES) // size)
    # A block ending where the key ends would name the key again: only those before it.
    for b in range(shared_from, min((key_end - 1) // size, MAX_BLOCKS) + 1):
        end = b * size
        crc = crc32(view[pos:end], crc)
        pos = end
        blocks.append(crc | b << _TAG)
    first = len(blocks)
    crc = key = crc32(view[pos:key_end], crc)  # CRC-32 of data[:key_end]
    blocks.append(key)
    # After the key, the CRC goes on over each block (the one holding the key's end read
    # from its start), tagged with its end in blocks (so not the key's untagged name): the
    # same in every process and replica, so a sibling or a peer told these names reads
    # them as its own (placement_feed.py). Python's hash() was ~0.1 us a block cheaper,
    # but salted per interpreter: two replicas would name the same history apart.
    start = key_end // size * size
    stop = min(len(data) // size, start // size + MAX_BLOCKS) * size
    for begin in range(start, stop, size):
        end = begin + size
        crc = crc32(view[begin:end], crc)
        blocks.append(crc | (end // size) << _TAG)
    return PrefixBlocks(
        key, first, blocks, preamble, continued, len(data), key_end, preamble_end if preamble else 0
    )

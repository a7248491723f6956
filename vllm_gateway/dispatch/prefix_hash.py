"""A request's prompt as chained hashes of its block-aligned prefixes, and its stable key.

    prefix_blocks(doc) -> PrefixBlocks | None        (pure; None: no text to hash)

The prompt text is the completion `prompt` (a string, or the first of a list of strings)
encoded as UTF-8, or the chat `messages` as JSON (orjson's, so the same messages are the
same bytes; one C call, cheaper than walking the messages in Python). It is cut into
blocks of `BLOCK_BYTES`; the hash of a block is that of the block before it and its own
bytes (chained), so equal hashes mean equal prefixes, as in vLLM's own prefix cache, and a
conversation's next turn (the same messages plus new ones) repeats every hash of the turn
before. Block hashes are Python's `hash()` (fast; salted per process, which is fine: each
process keeps its own index of them).

The **preamble** is what many conversations share: for chat, the messages before the first
user message (the system prompt); its CRC-32 lets dispatch keep the conversations that
share it on as few workers as their traffic needs (policies/cache_aware.py). A completion
prompt has none, nor does a chat whose preamble is shorter than `MIN_PREAMBLE_BYTES`.

The **key** is the part that stays the same for every turn of one conversation and
differs between conversations: for chat, the messages up to and including the first user
message (the system prompt alone is shared by many conversations; with the first user
message it is one conversation's); for a completion prompt, its first `KEY_BYTES`. Its
hash (CRC-32, the same in every process and every replica, unlike Python's salted
`hash()` of text) is what a rendezvous choice keys on.

Only the blocks after the key are hashed one by one, chained from the key's hash: they
are what tells one turn of a conversation from the next, and the blocks inside the key
add nothing the key does not say (the key's own hash stands first among them). So a
single-turn request costs one CRC over its key, and a long conversation one more call per
block of history, at most `MAX_BLOCKS` of them. The block that holds the key's end is
hashed from its start, key bytes included: equal either way for turns of one
conversation.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import orjson

# 1 KiB: about 256 tokens of English text (16 of vLLM's default 16-token blocks), a turn
# or two of a conversation. Each block costs a hash call (~0.3-1 us with its slice), so
# the size trades the depth resolution of a match for CPU per request.
BLOCK_BYTES = 1024
# Blocks hashed beyond the key: 32 x 1 KiB = 32 KiB of history; a longer prompt is
# matched on its first 32 KiB after the key (its first turns tell it apart well enough).
MAX_BLOCKS = 32
# The key of a completion prompt (no message structure to tell a conversation by).
KEY_BYTES = 1024
# A preamble shorter than one block (~256 tokens) is not one: its prefill is a few
# milliseconds wherever it runs, not worth gathering its conversations (and their load)
# onto few workers; they spread by their keys.
MIN_PREAMBLE_BYTES = BLOCK_BYTES


class PrefixBlocks:
    """One request's prefix hashes: `blocks[0]` is the key's, `blocks[i]` (i >= 1) that of
    the key and everything up to the end of block `first + i - 1`: each stands for a
    whole prefix."""

    __slots__ = ("blocks", "continued", "first", "key", "preamble")

    def __init__(
        self, key: int, first: int, blocks: list[int], preamble: int = 0, continued: bool = False
    ) -> None:
        self.key = key  # CRC-32 of the key: the same in every process
        self.first = first  # blocks wholly inside the key (not hashed one by one)
        self.blocks = blocks  # the key's hash, then the chained hashes of the blocks after
        self.preamble = preamble  # CRC-32 of the preamble; 0: none
        # A later turn of a chat: messages follow the first user message (its history was
        # sent somewhere before, by this process or another replica).
        self.continued = continued


def _chat(messages: list[Any]) -> tuple[bytes, int, int, bool] | None:
    """The messages as bytes (their JSON, as orjson writes it: the same messages always
    give the same bytes, whatever the client's spacing), where the preamble (the messages
    before the first user message) ends in them, where the key ends, and whether messages
    follow the key (a later turn)."""
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
    size = BLOCK_BYTES
    first = key_end // size
    end = min(len(data) // size, first + MAX_BLOCKS)
    # The key's CRC goes on from the preamble's (CRC-32 chains): its bytes are read once.
    preamble = zlib.crc32(data[:preamble_end]) if preamble_end else 0
    key = zlib.crc32(data[preamble_end:key_end], preamble)
    if preamble_end < MIN_PREAMBLE_BYTES:
        preamble = 0
    blocks = [key]
    h = key
    for start in range(first * size, end * size, size):
        h = hash((h, data[start : start + size]))
        blocks.append(h)
    return PrefixBlocks(key, first, blocks, preamble, continued)

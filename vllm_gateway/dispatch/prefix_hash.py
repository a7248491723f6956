"""A request's prompt as chained hashes of its block-aligned prefixes, and its stable key.

    prefix_blocks(doc) -> PrefixBlocks | None        (pure; None: no text to hash)

The prompt text is the completion `prompt` (a string, or the first of a list of strings),
or the chat `messages` in order, each as `role NUL content SOH` (content parts: their
text), encoded as UTF-8. It is cut into blocks of `BLOCK_BYTES`; the hash of block j is
the CRC-32 of everything up to its end (zlib.crc32 carried over from block to block), so
equal hashes mean equal prefixes, as in vLLM's own prefix cache, and a conversation's
next turn (the same messages plus new ones) repeats every hash of the turn before.

The **key** is the part that stays the same for every turn of one conversation and
differs between conversations: for chat, the messages up to and including the first user
message (the system prompt alone is shared by many conversations; with the first user
message it is one conversation's); for a completion prompt, its first `KEY_BYTES`. Its
hash (CRC-32, the same in every process and every replica, unlike Python's salted
`hash()` of text) is what a rendezvous choice keys on.

Only the blocks after the key are hashed one by one: they are what tells one turn of a
conversation from the next, and the blocks inside the key add nothing the key does not
say (the key's own hash stands first among them: a prefix hash like the others). So a
single-turn request costs one CRC over its bytes, and a long conversation one more call
per block of history, at most `MAX_BLOCKS` of them (from the key on).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

# 512 bytes: about 128 tokens of English text (8 of vLLM's default 16-token blocks). A
# conversation turn (a question and its answer) is usually longer, so each turn adds a
# block or more; smaller blocks would cost a CRC call (~0.3 us) more each.
BLOCK_BYTES = 512
# Blocks hashed beyond the key: 64 x 512 bytes = 32 KiB of history; a longer prompt is
# matched on its first 32 KiB after the key (its first turns tell it apart well enough).
MAX_BLOCKS = 64
# The key of a completion prompt (no message structure to tell a conversation by).
KEY_BYTES = 1024


class PrefixBlocks:
    """One request's prefix hashes: `blocks[0]` is the key's, `blocks[i]` (i >= 1) that of
    everything up to the end of block `first + i - 1`: each a hash of a whole prefix."""

    __slots__ = ("blocks", "first", "key")

    def __init__(self, key: int, first: int, blocks: list[int]) -> None:
        self.key = key  # CRC-32 of the key: the same in every process
        self.first = first  # blocks wholly inside the key (not hashed one by one)
        self.blocks = blocks  # the key's hash, then the chained hashes of the blocks after


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: its text parts
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return None


def _chat(messages: list[Any]) -> tuple[bytes, int] | None:
    """The messages as bytes, and where the key ends in them."""
    parts: list[str] = []
    key_parts = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = _text(m.get("content"))
        if content is None:
            continue
        role = m.get("role")
        role = role if isinstance(role, str) else ""
        parts.append(f"{role}\x00{content}\x01")
        if not key_parts and role == "user":
            key_parts = len(parts)
    if not parts:
        return None
    if not key_parts:
        key_parts = len(parts)  # no user message: all of it is the key
    head = "".join(parts[:key_parts]).encode()
    if key_parts == len(parts):
        return head, len(head)
    return head + "".join(parts[key_parts:]).encode(), len(head)


def prefix_blocks(doc: Mapping[str, Any]) -> PrefixBlocks | None:
    """The request's prefix hashes; None when it has no prompt text (e.g. token ids)."""
    prompt = doc.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
    if isinstance(prompt, str):
        data = prompt.encode()
        key_end = min(len(data), KEY_BYTES)
    else:
        messages = doc.get("messages")
        found = _chat(messages) if isinstance(messages, list) else None
        if found is None:
            return None
        data, key_end = found
    size = BLOCK_BYTES
    first = key_end // size
    end = min(len(data) // size, first + MAX_BLOCKS)
    crc = zlib.crc32
    h = crc(data[: first * size]) if first else 0
    key = crc(data[first * size : key_end], h)
    blocks = [key]
    for start in range(first * size, end * size, size):
        h = crc(data[start : start + size], h)
        blocks.append(h)
    return PrefixBlocks(key, first, blocks)

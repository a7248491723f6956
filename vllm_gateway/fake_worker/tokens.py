"""The fake's tokenizer: a prompt's token ids, one per whitespace-separated word.

Deterministic across processes and runs (CRC-32 of the word, never Python's salted
`hash` of a string), so two workers, or one worker restarted, give the same ids for
the same text, which is what a prefix cache keyed on token ids needs.

The prompt text is, in order:

- chat: each message's content (a string, or the `text` of its content parts). A
  message's role is folded into the id of its first word and adds no token, so the
  same words said by "system" and by "user" are different prompts while the token
  count (the answer's `usage.prompt_tokens`) stays the number of words;
- completions: `prompt` (a string, a list of strings, or token ids, which are taken
  as they are), else `input`;
- responses: `instructions` as a system message, then `input` (a string, or items with
  a role and content, as chat messages).

An empty prompt still counts one token, as vLLM never sees a zero-length prompt.

The fake's answer of n tokens is the text " w0 w1 ... w{n-1}"; `answer_token_id` gives
the ids that text has when a later prompt quotes it (as an assistant message in chat,
as plain text in a completion prompt), so the worker can cache the answer's blocks
under the hashes the next turn will look up.
"""

from __future__ import annotations

import zlib
from typing import Any


def _word_id(word: str, role: str = "") -> int:
    return zlib.crc32(f"{role}\x00{word}".encode() if role else word.encode())


def _words(value: Any) -> list[str]:
    """The words of a string, of a list of them, or of a chat content part."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, dict):  # a chat content part: {"type": "text", "text": ...}
        return _words(value.get("text"))
    if isinstance(value, list):
        return [w for v in value for w in _words(v)]
    return []


def _ids(value: Any) -> list[int]:
    """Token ids of a completion prompt: text is split into words, ints are ids."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [i for v in value for i in _ids(v)]
    return [_word_id(w) for w in _words(value)]


def prompt_token_ids(body: dict[str, Any]) -> list[int]:
    """The token ids of a request's prompt (chat messages, `prompt` or `input`)."""
    if "messages" in body:
        ids: list[int] = []
        for message in body["messages"]:
            if not isinstance(message, dict):
                continue
            words = _words(message.get("content"))
            if words:
                ids.append(_word_id(words[0], str(message.get("role", ""))))
                ids.extend(_word_id(w) for w in words[1:])
    else:
        ids = _ids(body.get("prompt", body.get("input", "")))
    return ids or [0]


def responses_token_ids(body: dict[str, Any]) -> list[int]:
    """The token ids of a /v1/responses request: `instructions`, then `input`."""
    value = body.get("input")
    items = value if isinstance(value, list) else [value]
    messages = [{"role": "system", "content": body.get("instructions") or ""}]
    messages += [i if isinstance(i, dict) else {"role": "user", "content": i} for i in items]
    return prompt_token_ids({"messages": messages})


def answer_token_id(i: int, role: str = "") -> int:
    """The id of token i of the fake's answer as a later prompt quotes it (said by `role`:
    folded into the first word, as for any message). One at a time, as tokens are made:
    a client's max_tokens must not size anything up front."""
    return _word_id(f"w{i}", role if i == 0 else "")

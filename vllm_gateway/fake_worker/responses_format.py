"""vLLM's /v1/responses wire format (OpenAI's Responses API as vLLM serves it): the request
fields the fake reads, the whole answer, and the events of a streamed one. Pure, no I/O.

A streamed answer is SSE with an `event:` line naming each event's type, in OpenAI's
order: response.created, response.in_progress, response.output_item.added,
response.content_part.added, one response.output_text.delta per token,
response.output_text.done, response.content_part.done, response.output_item.done,
response.completed; each with a growing `sequence_number`, and no `[DONE]` at the end.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from vllm_gateway.fake_worker.protocol import ApiError, invalid, optional_int


def input_words(body: dict[str, Any]) -> int:
    """The prompt's token count (one per word, at least 1) of `input` and `instructions`;
    `input` is a string or a list of items (messages with string or part-list content)."""
    if "input" not in body:
        raise invalid("input", "missing", body)
    value = body["input"]
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list):
        texts = []
        for item in value:
            content = item.get("content") if isinstance(item, dict) else item
            if isinstance(content, list):
                texts += [p.get("text", "") for p in content if isinstance(p, dict)]
            elif isinstance(content, str):
                texts.append(content)
    else:
        raise invalid("input", "string_type", value)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "string_type", instructions)
    texts.append(instructions or "")
    return max(1, sum(len(t.split()) for t in texts if isinstance(t, str)))


def max_output_tokens(body: dict[str, Any], default: int) -> int:
    value = optional_int(body, "max_output_tokens")
    if value is None:
        return default
    if value < 1:
        raise ApiError(400, f"max_output_tokens must be at least 1, got {value}.",
                       "max_output_tokens")  # fmt: skip
    return value


class ResponseFormat:
    """One answer's documents: the response object, its message item, and the events."""

    def __init__(
        self, given_id: str | None, model: str, body: dict[str, Any], prompt: int, limit: int
    ) -> None:
        self.id = f"resp_{given_id or uuid.uuid4().hex}"  # vLLM: the X-Request-Id if given
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.prompt = prompt
        self.limit = limit
        self.instructions = body.get("instructions")
        self.sequence = 0

    def message(self, text: str, done: bool) -> dict[str, Any]:
        """The assistant message output item."""
        content = [self.part(text)] if done else []
        return {"id": self.item_id, "type": "message", "role": "assistant",
                "status": "completed" if done else "in_progress", "content": content}  # fmt: skip

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(self, text: str | None, completion: int) -> dict[str, Any]:
        """The response object: in progress (`text` None) or completed."""
        done = text is not None
        usage = None
        if done:
            # cache_write_tokens: newer OpenAI schemas require it; the SDK parses it.
            cached = {"cached_tokens": 0, "cache_write_tokens": 0}
            usage = {"input_tokens": self.prompt, "input_tokens_details": cached,
                     "output_tokens": completion,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": self.prompt + completion}  # fmt: skip
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "model": self.model, "status": "completed" if done else "in_progress",
            "output": [self.message(text, True)] if text is not None else [],
            "usage": usage, "error": None, "incomplete_details": None,
            "instructions": self.instructions, "metadata": None,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "temperature": 1.0, "top_p": 1.0, "max_output_tokens": self.limit,
            "max_tool_calls": None, "previous_response_id": None, "prompt": None,
            "reasoning": None, "service_tier": "auto", "text": None, "top_logprobs": None,
            "truncation": "disabled", "user": None, "background": False,
        }  # fmt: skip

    def body(self, text: str, completion: int) -> bytes:
        """The whole non-streamed answer."""
        return orjson.dumps(self.response(text, completion))

    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE event of type `kind`, numbered."""
        doc = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(doc) + b"\n\n"

    def opening(self) -> list[bytes]:
        """The events before the first token."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.created", response=self.response(None, 0)),
            self.event("response.in_progress", response=self.response(None, 0)),
            self.event("response.output_item.added", output_index=0, item=self.message("", False)),
            self.event("response.content_part.added", **where, part=self.part("")),
        ]

    def delta(self, i: int) -> bytes:
        """The event carrying token i (the text " w{i}")."""
        return self.event("response.output_text.delta", item_id=self.item_id, output_index=0,
                          content_index=0, delta=f" w{i}", logprobs=[])  # fmt: skip

    def closing(self, text: str, completion: int) -> list[bytes]:
        """The events after the last token."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=self.part(text)),
            self.event("response.output_item.done", output_index=0, item=self.message(text, True)),
            self.event("response.completed", response=self.response(text, completion)),
        ]

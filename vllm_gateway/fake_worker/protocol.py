"""vLLM's OpenAI wire format: request fields, response bodies and pre-built SSE chunks.

Pure functions and small classes, no I/O. Token i of every answer is the text
f" w{i}", so a client can check each chunk arrived, in order, exactly once.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
import uuid
from http import HTTPStatus
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"

# The OpenAI SDK's exception name for each status, which is what vLLM puts in `type`.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class ApiError(Exception):
    """An error answer: HTTP status plus an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """vLLM's current error shape: {"error": {"message", "type", "param", "code"}}."""
    try:
        default_type = HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        default_type = "Error"
    err = {
        "message": message,
        "type": _ERROR_TYPES.get(status, default_type),
        "param": param,
        "code": status,
    }
    return orjson.dumps({"error": err})


def invalid(field: str, kind: str, value: Any) -> ApiError:
    """A 400 worded as vLLM words a body that fails its schema: FastAPI's validation error
    (pydantic's `type`, `loc` and `msg` for the field), e.g. `"messages": 5` ->
    "Input should be a valid list", not "Field required"."""
    messages = {
        "missing": "Field required",
        "list_type": "Input should be a valid list",
        "string_type": "Input should be a valid string",
        "int_type": "Input should be a valid integer",
        "bool_type": "Input should be a valid boolean",
        "dict_type": "Input should be a valid dictionary",
    }
    detail = {"type": kind, "loc": ("body", field), "msg": messages[kind], "input": value}
    return ApiError(400, f"1 validation error:\n  {detail}\n", field)


def require(body: dict[str, Any], field: str, kind: str) -> Any:
    """`body[field]`, which must be present and of `kind` (a pydantic error type)."""
    if field not in body:
        raise invalid(field, "missing", body)
    value = body[field]
    ok = {
        "list_type": isinstance(value, list),
        "string_type": isinstance(value, str),
        "dict_type": isinstance(value, dict),
    }[kind]
    if not ok:
        raise invalid(field, kind, value)
    return value


def optional_int(body: dict[str, Any], field: str) -> int | None:
    """An optional integer field (None when absent or null); a bool is no integer here."""
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(field, "int_type", value)
    return value


def request_id(prefix: str, given: str | None) -> str:
    """vLLM uses the caller's X-Request-Id as the base of the response id when given."""
    return f"{prefix}-{given or uuid.uuid4().hex}"


# --- reading a request ---------------------------------------------------------------


def max_tokens(body: dict[str, Any], default: int, chat: bool) -> int:
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"  # fmt: skip
    value = optional_int(body, field)
    if value is None:
        return default
    if value < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {value}.", "max_tokens")
    return value


# vLLM's default --max-logprobs: the most `top_logprobs` (chat) or `logprobs` (completions).
MAX_LOGPROBS = 20


def choice_count(body: dict[str, Any]) -> int:
    """`n`: how many choices to answer with (vLLM: an integer, at least 1)."""
    n = optional_int(body, "n")
    if n is None:
        return 1
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}.", "n")
    return n


def logprobs_wanted(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives to list per token, or None for no logprobs at all.

    Chat: `logprobs: true`, with `top_logprobs: k` (0..20) alternatives; completions:
    `logprobs: k`. Checked as vLLM checks them.
    """
    if not chat:
        k = optional_int(body, "logprobs")
    else:
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise invalid("logprobs", "bool_type", on)
        k = optional_int(body, "top_logprobs")
        if k is not None and not on:
            raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                           "top_logprobs")  # fmt: skip
        if not on:
            return None
        k = k or 0
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        field = "top_logprobs" if chat else "logprobs"
        raise ApiError(400, f"{field} must be between 0 and {MAX_LOGPROBS}, got {k}.", field)
    return k


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage), validated like vLLM does."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean.", "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                       "stream_options")  # fmt: skip
    include_usage = bool(stream and isinstance(options, dict) and options.get("include_usage"))
    return stream, include_usage


def output_text(n: int) -> str:
    return "".join(f" w{i}" for i in range(n))


# --- streaming chunks ----------------------------------------------------------------
# Each chunk's constant bytes are built once per request, so a token costs one bytes
# concatenation: the fake must stay far cheaper than the gateway it benchmarks.

_COMPLETION_TAIL = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
_COMPLETION_LAST = b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
_CHAT_ROLE = b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
_CHAT_TAIL = b'},"logprobs":null,"finish_reason":null}]}\n\n'
_CHAT_LAST = b'},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'


# --- logprobs ------------------------------------------------------------------------
# Deterministic: token i's logprob depends on i alone; its alternatives are " alt{j}",
# each one nat less likely than the one before. The sampled token ranks first.


def _logprob(i: int) -> float:
    return -round(0.05 + (i % 7) * 0.1, 4)


def _alternatives(i: int, k: int) -> list[tuple[str, float]]:
    lp = _logprob(i)
    return [(f" w{i}", lp)] + [(f" alt{j}", round(lp - j, 4)) for j in range(1, k)]


def chat_logprob(i: int, k: int) -> dict[str, Any]:
    """Chat's entry for token i: token, logprob, bytes and `k` top_logprobs."""
    token = f" w{i}"
    top = [{"token": t, "logprob": lp, "bytes": list(t.encode())}
           for t, lp in _alternatives(i, k)] if k else []  # fmt: skip
    return {"token": token, "logprob": _logprob(i), "bytes": list(token.encode()),
            "top_logprobs": top}  # fmt: skip


def completion_logprobs(first: int, count: int, k: int) -> dict[str, Any]:
    """Completions' logprobs for tokens first..first+count-1 (parallel lists)."""
    tokens = range(first, first + count)
    return {
        "text_offset": [len(output_text(i)) for i in tokens],
        "token_logprobs": [_logprob(i) for i in tokens],
        "tokens": [f" w{i}" for i in tokens],
        "top_logprobs": [dict(_alternatives(i, max(k, 1))) for i in tokens],
    }


def answer_logprobs(n: int, k: int | None, chat: bool) -> dict[str, Any] | None:
    """A whole answer's logprobs (None when not asked for)."""
    if k is None:
        return None
    if chat:
        return {"content": [chat_logprob(i, k) for i in range(n)]}
    return completion_logprobs(0, n, k)


class ChunkFormat:
    """The SSE events of one streamed answer, for /v1/completions or /v1/chat/completions:
    one choice (`index`), with logprobs when `logprobs` (alternatives per token) is set."""

    def __init__(
        self, rid: str, model: str, chat: bool, index: int = 0, logprobs: int | None = None
    ) -> None:
        self.chat = chat
        self.logprobs = logprobs
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        self.id = rid
        self.model = model
        head = (
            b'data: {"id":' + orjson.dumps(rid)
            + b',"object":"' + self.object.encode()
            + b'","created":' + str(self.created).encode()
            + b',"model":' + orjson.dumps(model)
        )  # fmt: skip
        self._head = head + (b',"choices":[{"index":%d,"delta":' % index if chat
                             else b',"choices":[{"index":%d,"text":' % index)  # fmt: skip

    def role(self) -> bytes | None:
        """Chat's first event, `delta: {"role": "assistant", "content": ""}`."""
        return self._head + _CHAT_ROLE if self.chat else None

    def token(self, i: int, last: bool) -> bytes:
        event = self.text(b'" w%d"' % i, last)
        if self.logprobs is None:
            return event  # the common case: constant bytes only
        if self.chat:
            lp: dict[str, Any] = {"content": [chat_logprob(i, self.logprobs)]}
        else:
            lp = completion_logprobs(i, 1, self.logprobs)
        return event.replace(b'"logprobs":null', b'"logprobs":' + orjson.dumps(lp), 1)

    def text(self, quoted: bytes, last: bool = False) -> bytes:
        """An event carrying `quoted`, a JSON string literal (quotes included)."""
        if self.chat:
            return self._head + b'{"content":' + quoted + (_CHAT_LAST if last else _CHAT_TAIL)
        return self._head + quoted + (_COMPLETION_LAST if last else _COMPLETION_TAIL)

    def usage(self, prompt: int, completion: int) -> bytes:
        return b"data: " + orjson.dumps({
            "id": self.id, "object": self.object, "created": self.created, "model": self.model,
            "choices": [], "usage": _usage(prompt, completion),
        }) + b"\n\n"  # fmt: skip

    def malformed(self, i: int) -> bytes:
        """An event that is not valid SSE JSON: truncated JSON, then a field-less line."""
        return self._head + b'" w%d"\n\nnot-an-sse-field w%d\n\n' % (i, i)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion}  # fmt: skip


# --- whole answers -------------------------------------------------------------------


def completion_body(
    rid: str, model: str, text: str, prompt: int, completion: int,
    choices: int = 1, logprobs: dict[str, Any] | None = None,
) -> bytes:  # fmt: skip
    """A whole /v1/completions answer: `choices` alike ones, each of `completion` tokens."""
    return orjson.dumps({
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": j, "text": text, "logprobs": logprobs, "finish_reason": "length",
                     "stop_reason": None, "prompt_logprobs": None} for j in range(choices)],
        "usage": {**_usage(prompt, completion * choices), "prompt_tokens_details": None},
        "kv_transfer_params": None,
    })  # fmt: skip


def chat_body(
    rid: str, model: str, text: str, prompt: int, completion: int,
    choices: int = 1, logprobs: dict[str, Any] | None = None,
) -> bytes:  # fmt: skip
    """A whole /v1/chat/completions answer: `choices` alike ones of `completion` tokens."""
    message: dict[str, object] = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [],
        "reasoning_content": None,
    }
    return orjson.dumps({
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": j, "message": message, "logprobs": logprobs,
                     "finish_reason": "length", "stop_reason": None} for j in range(choices)],
        "service_tier": None, "system_fingerprint": None,
        "usage": {**_usage(prompt, completion * choices), "prompt_tokens_details": None},
        "prompt_logprobs": None, "kv_transfer_params": None,
    })  # fmt: skip


def embedding(text: str, dim: int) -> list[float]:
    """A deterministic unit vector for `text` (vLLM normalizes embeddings by default)."""
    seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    rng = random.Random(seed)
    vec = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


def embeddings_body(rid: str, model: str, inputs: list[str], dim: int) -> bytes:
    data = [{"index": i, "object": "embedding", "embedding": embedding(t, dim)}
            for i, t in enumerate(inputs)]  # fmt: skip
    tokens = max(1, sum(len(t.split()) for t in inputs))
    return orjson.dumps({
        "id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data,
        "usage": {**_usage(tokens, 0), "prompt_tokens_details": None},
    })  # fmt: skip


def similarity(a: str, b: str) -> float:
    """A deterministic score in (0, 1) for a pair of texts."""
    digest = hashlib.blake2b(f"{a}\x00{b}".encode(), digest_size=4).digest()
    return (int.from_bytes(digest, "big") + 1) / (2**32 + 2)


def token_ids(text: str) -> list[int]:
    """One stable id per word, in a 32k vocabulary."""
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=2).digest(), "big") % 32000
            for w in text.split()]  # fmt: skip


def as_texts(value: Any, field: str) -> list[str]:
    """`input`-like fields: a string or a list of strings (token-id lists become text)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) for v in value):
            return [" ".join(map(str, value))]
        if all(isinstance(v, str) for v in value):
            return value
        if all(isinstance(v, list) for v in value):
            return [" ".join(map(str, v)) for v in value]
    raise ApiError(400, f"{field} must be a string or a non-empty list of strings.", field)


def model_list(models: tuple[str, ...], loras: tuple[str, ...], max_model_len: int) -> bytes:
    """/v1/models: served names share the base model's root; adapters name it as parent."""
    created = int(time.time())
    base = models[0]

    def card(name: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
        permission = {
            "id": request_id("modelperm", None), "object": "model_permission",
            "created": created, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False,
        }  # fmt: skip
        return {"id": name, "object": "model", "created": created, "owned_by": "vllm",
                "root": root, "parent": parent, "max_model_len": max_len,
                "permission": [permission]}  # fmt: skip

    data = [card(m, base, None, max_model_len) for m in models]
    data += [card(a, f"/adapters/{a}", base, None) for a in loras]
    return orjson.dumps({"object": "list", "data": data})

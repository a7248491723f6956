"""Reading the small JSON bodies of control requests (admin and registration APIs).

Each getter returns a field of the expected type or raises `BadRequest` naming the field,
so every handler validates its input in one line per field and a client always learns
which field was wrong.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from aiohttp import web

from vllm_gateway.config.load import check_worker_url, normalize_url, worker_url_note
from vllm_gateway.errors import BadRequest
from vllm_gateway.log import get_logger

log = get_logger("vllm_gateway.control")

# Control bodies are a few hundred bytes; refuse anything that is not.
MAX_CONTROL_BODY_BYTES = 64 * 1024


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body; an empty body is an empty object."""
    try:
        declared = request.content_length
    except ValueError:  # more digits (leading zeros) than int() takes: judge the body itself
        declared = None
    if declared is not None and declared > MAX_CONTROL_BODY_BYTES:
        raise BadRequest(f"Control request bodies are limited to {MAX_CONTROL_BODY_BYTES} bytes.")
    # request.read(), not request.content: with `--processes N` the siblings middleware has
    # already read the body to fan it out, and only read() returns it again (cached). A
    # chunked body without a length is bounded by the app's client_max_size meanwhile.
    raw = await request.read()
    if len(raw) > MAX_CONTROL_BODY_BYTES:
        raise BadRequest(f"Control request bodies are limited to {MAX_CONTROL_BODY_BYTES} bytes.")
    if not raw.strip():
        return {}
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"The request body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest("The request body must be a JSON object.")
    return doc


def get_str(doc: dict[str, Any], key: str, default: str | None = None) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"`{key}` must be a non-empty string.", param=key)
    return value


def get_url(doc: dict[str, Any], key: str = "url") -> str:
    """A worker base URL, normalized (the registry's key); a respelling is logged."""
    given = get_str(doc, key)
    problem = check_worker_url(given)
    if problem:
        raise BadRequest(f"`{key}`: {problem}.", param=key)
    if note := worker_url_note(given):
        log.warning("worker URL normalized", field=key, problem=note)
    return normalize_url(given)


def get_bool(doc: dict[str, Any], key: str, default: bool) -> bool:
    value = doc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"`{key}` must be true or false.", param=key)
    return value


def get_number(
    doc: dict[str, Any],
    key: str,
    default: float | None,
    minimum: float = 0.0,
    maximum: float = math.inf,
    null: bool = True,
) -> float | None:
    """The number at `key` within `minimum`..`maximum`, or `default` when it is missing
    (or null, unless `null` is False: a client's inf or NaN, which JSON cannot carry,
    arrives as null from orjson, and should not pass for "not given")."""
    value = doc.get(key, default)
    if value is None and (null or key not in doc):
        return default
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"`{key}` must be a number.", param=key)
    if not minimum <= value <= maximum:
        if math.isinf(maximum):
            raise BadRequest(f"`{key}` must be a number of at least {minimum:g}.", param=key)
        raise BadRequest(f"`{key}` must be a number from {minimum:g} to {maximum:g}.", param=key)
    return float(value) + 0.0  # (-0.0 is 0)


def get_str_list(doc: dict[str, Any], key: str) -> list[str]:
    value = doc.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BadRequest(f"`{key}` must be a list of strings.", param=key)
    return value

"""A cheap, pure reading of one client request: just what dispatch needs, nothing more.

The body is parsed once (orjson) to read `model` and `stream`; it is forwarded to the worker
as the same bytes. Everything a policy may want (a session key, a prompt prefix) is derived
here, lazily, so a new policy input means a new field or method on `RequestInfo` and no
change to the request path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from vllm_gateway.config.load import check_model_name
from vllm_gateway.dispatch.prefix_hash import PrefixBlocks, prefix_blocks
from vllm_gateway.errors import BadRequest

if TYPE_CHECKING:
    from vllm_gateway.workers import Worker

SESSION_HEADERS = ("x-session-id", "x-user-id")
PRIORITY_HEADER = "x-priority"


class RequestInfo:
    """What the gateway knows of one request before choosing a worker."""

    __slots__ = (
        "_blocks",
        "_doc",
        "body",
        "cold",
        "headers",
        "model",
        "path",
        "placed",
        "prefill",
        "request_id",
        "saved",
        "stream",
        "stretched",
    )

    def __init__(
        self,
        path: str,
        body: bytes,
        model: str,
        stream: bool,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        doc: dict[str, Any] | None = None,
    ) -> None:
        self.path = path  # path and query, as the client sent them
        self.body = body  # the exact bytes to forward
        self.model = model
        self.stream = stream
        self.request_id = request_id
        self.headers = headers if headers is not None else {}
        self._doc = doc if doc is not None else {}
        self._blocks: PrefixBlocks | bool | None = False  # False: not computed yet
        # Prompt bytes the chosen worker probably does not cache (set by a policy that
        # knows, cache_aware; 0: unknown): what it owes the worker's prefill backlog.
        self.prefill = 0
        # The policy knows the worker holds none of the prompt (cache_aware `_cold`): its
        # prefill is the whole prompt, bytes as good as known (prefill_rate.py learns them).
        self.cold = False
        # Workers the capacity gate would let this request past their probing limit, as
        # the probe the policy asked for (buckets.py `can_stretch`; the limit is raised,
        # `stretch`, only for the one chosen): a batch slot it may take.
        self.stretched: Sequence[Worker] = ()
        # Prompt bytes the full workers the policy would rather have (its `preferred`)
        # hold and no worker with room does: what it would prefill again elsewhere (set
        # by cache_aware for a later turn's history; 0: none, or unknown).
        self.saved = 0
        # How the policy chose the worker, for the access log (cache_aware's `PLACED`
        # names; "" for the other policies).
        self.placed = ""

    @property
    def session_key(self) -> str | None:
        """A key that keeps one user's requests together: a session header or body `user`."""
        for name in SESSION_HEADERS:
            value = self.headers.get(name)
            if value:
                return value
        user = self._doc.get("user")
        return user if isinstance(user, str) and user else None

    @property
    def priority(self) -> int:
        """Admission priority from `X-Priority` (lower goes first; default 0)."""
        value = self.headers.get(PRIORITY_HEADER)
        if not value:
            return 0
        try:
            return max(-100, min(100, int(value)))
        except ValueError:
            return 0

    def prefix_text(self, chars: int) -> str:
        """The first `chars` characters of the prompt (or the concatenated messages)."""
        doc = self._doc
        prompt = doc.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
        if isinstance(prompt, str):
            return prompt[:chars]
        parts: list[str] = []
        size = 0
        messages = doc.get("messages")
        if isinstance(messages, list):
            for m in messages:
                if not isinstance(m, dict):
                    continue
                content = m.get("content")
                if isinstance(content, list):  # multi-part content: take the text parts
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                if isinstance(content, str):
                    piece = f"{m.get('role', '')}:{content}\n"
                    parts.append(piece)
                    size += len(piece)
                    if size >= chars:
                        break
        return "".join(parts)[:chars]

    def prefix_blocks(self) -> PrefixBlocks | None:
        """The prompt's prefix hashes and conversation key (prefix_hash.py), computed once
        per request however often dispatch asks (retries, the admission queue)."""
        blocks = self._blocks
        if blocks is False:
            blocks = self._blocks = prefix_blocks(self._doc)
        return blocks  # type: ignore[return-value]

    def release_body(self) -> None:
        """Drop the body and its parsed JSON: once a worker's answer is being relayed, no
        retry can need them, and a long prompt would otherwise stay in memory for the
        whole stream (its size again in parsed form), and its prefix hashes (dispatch is
        over). What telemetry and the access log read (model, stream, path, request id)
        stays."""
        self.body = b""
        self._doc = {}
        self._blocks = None

    def with_model(self, model: str) -> RequestInfo:
        """A copy that asks for `model` instead, with the body rewritten to match."""
        doc = dict(self._doc)
        doc["model"] = model
        return RequestInfo(
            self.path, orjson.dumps(doc), model, self.stream, self.request_id, self.headers, doc
        )


def parse_request(
    path: str, body: bytes, request_id: str, headers: Mapping[str, str] | None = None
) -> RequestInfo:
    """Read `model` and `stream` from a JSON request body; raise `BadRequest` when unusable."""
    if not body:
        raise BadRequest("The request body is empty; expected a JSON object.")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"The request body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"The request body must be a JSON object, not {type(doc).__name__}.")
    model = doc.get("model")
    if model is None:
        raise BadRequest("The request has no `model`.", param="model")
    if not isinstance(model, str):
        raise BadRequest("`model` must be a string.", param="model")
    problem = check_model_name(model)
    if problem:
        raise BadRequest(f"Invalid `model`: {problem}.", param="model")
    stream = doc.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("`stream` must be true or false.", param="stream")
    return RequestInfo(path, body, model, stream, request_id, headers, doc)

"""The vLLM HTTP endpoints: each handler reads a request, runs the engine, shapes the answer.

Bookkeeping (records, outcomes, auth, fault selection) happens in the server's
middleware before a handler runs; it hands over a `Call`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from vllm_gateway.fake_worker import protocol as p
from vllm_gateway.fake_worker import responses_format as r
from vllm_gateway.fake_worker.config import FakeWorkerConfig, Fault
from vllm_gateway.fake_worker.engine import Engine
from vllm_gateway.fake_worker.faults import BodyWriter, StreamEnded, before_headers, send_body
from vllm_gateway.fake_worker.stats import RequestRecord
from vllm_gateway.fake_worker.tokens import prompt_token_ids, responses_token_ids

CALL = web.RequestKey("fake_call", object)
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}


@dataclass
class Call:
    """What the middleware learnt about one request before its handler runs."""

    record: RequestRecord
    fault: Fault | None
    arrival: float  # loop.time() when the request was read


def _id(request: web.Request) -> str | None:
    """The caller's X-Request-Id (the gateway's request id), for the request log."""
    return request.headers.get("X-Request-Id")


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


# How a handler reports an outcome the fake caused itself: finish(record, "faulted").
Finish = Callable[[RequestRecord, str], None]


class OpenAIApi:
    """vLLM's OpenAI-compatible routes, served from one Engine."""

    def __init__(self, config: FakeWorkerConfig, engine: Engine, finish: Finish) -> None:
        self.config = config
        self.engine = engine
        self.finish = finish

    def add_routes(self, app: web.Application) -> None:
        get, post = app.router.add_get, app.router.add_post
        get("/health", self.health)
        get("/metrics", self.metrics)
        get("/version", self.version)
        get("/v1/models", self.models)
        post("/v1/completions", self.completions)
        post("/v1/chat/completions", self.chat)
        post("/v1/responses", self.responses)
        post("/v1/embeddings", self.embeddings)
        post("/tokenize", self.tokenize)
        post("/detokenize", self.detokenize)
        for path in ("/score", "/v1/score"):
            post(path, self.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            post(path, self.rerank)

    def _parse(self, request: web.Request) -> tuple[Call, dict[str, Any], str]:
        """The request's Call, its JSON body and the served model it names (or ApiError)."""
        call: Call = request[CALL]  # type: ignore[assignment]
        try:
            body = orjson.loads(call.record.body)
        except orjson.JSONDecodeError as exc:
            raise p.ApiError(400, f"JSON decode error: {exc}") from None
        if not isinstance(body, dict):
            raise p.ApiError(400, "The request body must be a JSON object.")
        model = body.get("model") or self.config.base_model  # vLLM defaults a missing model
        if not isinstance(model, str) or model not in self.config.served_names:
            raise p.ApiError(404, f"The model `{model}` does not exist.", "model")
        return call, body, model

    def _on_fault(self, call: Call) -> Callable[[], None]:
        return lambda: self.finish(call.record, "faulted")

    async def _reply(self, request: web.Request, call: Call, body: bytes) -> web.StreamResponse:
        return await send_body(request, body, call.fault, self._on_fault(call))

    # --- generation --------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        call, body, model = self._parse(request)
        if chat:
            p.require(body, "messages", "list_type")
        elif body.get("prompt") is None:
            raise p.invalid("prompt", "missing", body)
        elif not isinstance(body["prompt"], str | list):
            raise p.invalid("prompt", "string_type", body["prompt"])
        n = p.max_tokens(body, self.config.max_tokens, chat)
        choices = p.choice_count(body)
        logprobs = p.logprobs_wanted(body, chat)
        stream, include_usage = p.stream_flags(body)
        token_ids = prompt_token_ids(body)
        prompt = len(token_ids)
        rid = p.request_id("chatcmpl" if chat else "cmpl", request.headers.get("X-Request-Id"))
        fault = call.fault
        huge = int(fault.param or 0) if fault and fault.name == "huge_event" else 0
        # The role a next turn quoting the answer gives it (its blocks are cached under those
        # ids); none for n > 1 choices (which would it quote?) or a fault that changes it.
        answer = None if huge or choices > 1 else ("assistant" if chat else "")
        await before_headers(fault)
        if not stream:
            await self.engine.generate(
                call.arrival, model, token_ids, n, None, answer, _id(request)
            )
            text = "x" * huge + p.output_text(n)
            make = p.chat_body if chat else p.completion_body
            lp = p.answer_logprobs(n, logprobs, chat)
            return await self._reply(request, call, make(rid, model, text, prompt, n, choices, lp))

        # One format per choice: each event carries one choice, with its index (vLLM's).
        formats = [p.ChunkFormat(rid, model, chat, j, logprobs) for j in range(choices)]
        malformed = fault is not None and fault.name == "malformed_sse"

        def events(i: int) -> list[bytes]:
            out = []
            for fmt in formats:
                if i == 0:
                    if (role := fmt.role()) is not None:
                        out.append(role)
                    if huge:
                        out.append(fmt.text(orjson.dumps("x" * huge)))
                out.append(fmt.malformed(i) if malformed else fmt.token(i, i == n - 1))
            return out

        usage = [formats[0].usage(prompt, n * choices)] if include_usage else []
        done = [*usage, p.DONE]
        return await self._stream(request, call, model, (token_ids, n, answer), events, done)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """/v1/responses: OpenAI's Responses API as vLLM serves it, streamed or not."""
        call, body, model = self._parse(request)
        prompt = r.input_words(body)  # validates `input`; the answer's usage
        token_ids = responses_token_ids(body)
        n = r.max_output_tokens(body, self.config.max_tokens)
        stream, _ = p.stream_flags(body)
        fmt = r.ResponseFormat(request.headers.get("X-Request-Id"), model, body, prompt, n)
        text = p.output_text(n)
        answer = "assistant"
        await before_headers(call.fault)
        if not stream:
            await self.engine.generate(
                call.arrival, model, token_ids, n, None, answer, _id(request)
            )
            return await self._reply(request, call, fmt.body(text, n))

        def events(i: int) -> list[bytes]:
            return [*fmt.opening(), fmt.delta(i)] if i == 0 else [fmt.delta(i)]

        size = (token_ids, n, answer)
        return await self._stream(request, call, model, size, events, fmt.closing, text)

    async def _stream(
        self,
        request: web.Request,
        call: Call,
        model: str,
        size: tuple[list[int], int, str | None],
        events: Callable[[int], list[bytes]],
        closing: list[bytes] | Callable[[str, int], list[bytes]],
        text: str = "",
    ) -> web.StreamResponse:
        """Answer as an event stream: `events(i)` as token i is made, then `closing` (or
        what it makes of the whole text); `size` is (prompt token ids, answer tokens, the
        role a later prompt quoting the answer gives it, or None)."""
        # Like vLLM (Starlette), the status line goes out at once, before the queue.
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        out = BodyWriter(request, call.fault, self._on_fault(call))

        async def on_token(i: int) -> None:
            for event in events(i):
                await out.event(resp, event)

        token_ids, n, answer = size
        try:
            await self.engine.generate(
                call.arrival, model, token_ids, n, on_token, answer, _id(request)
            )
            for event in closing if isinstance(closing, list) else closing(text, n):
                await out.event(resp, event)
        except StreamEnded:
            pass
        except ConnectionResetError:  # a write found the client gone
            self.finish(call.record, "aborted")
        return resp

    # --- pooling and tokenizer endpoints -----------------------------------------------

    async def _prefill(self, call: Call, model: str, prompt: int) -> None:
        await before_headers(call.fault)
        await self.engine.prefill(model, prompt)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        call, body, model = self._parse(request)
        inputs = p.as_texts(body.get("input"), "input")
        await self._prefill(call, model, sum(len(t.split()) for t in inputs))
        rid = p.request_id("embd", request.headers.get("X-Request-Id"))
        dim = self.config.embedding_dim
        return await self._reply(request, call, p.embeddings_body(rid, model, inputs, dim))

    async def score(self, request: web.Request) -> web.StreamResponse:
        call, body, model = self._parse(request)
        left = p.as_texts(body.get("text_1"), "text_1")
        right = p.as_texts(body.get("text_2"), "text_2")
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise p.ApiError(400, "text_1 and text_2 must have the same length.", "text_2")
        pairs = list(zip(left, right, strict=True))
        tokens = sum(len(a.split()) + len(b.split()) for a, b in pairs)
        await self._prefill(call, model, tokens)
        data = [{"index": i, "object": "score", "score": p.similarity(a, b)}
                for i, (a, b) in enumerate(pairs)]  # fmt: skip
        return await self._reply(request, call, orjson.dumps({
            "id": p.request_id("score", request.headers.get("X-Request-Id")), "object": "list",
            "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }))  # fmt: skip

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        call, body, model = self._parse(request)
        query = body.get("query")
        if not isinstance(query, str):
            raise p.ApiError(400, "Field required: query", "query")
        docs = p.as_texts(body.get("documents"), "documents")
        tokens = sum(len(query.split()) + len(d.split()) for d in docs)
        await self._prefill(call, model, tokens)
        results = sorted(
            ({"index": i, "document": {"text": d}, "relevance_score": p.similarity(query, d)}
             for i, d in enumerate(docs)),
            key=lambda r: -float(r["relevance_score"]),  # type: ignore[arg-type]
        )  # fmt: skip
        top_n = body.get("top_n") or len(results)
        return await self._reply(request, call, orjson.dumps({
            "id": p.request_id("rerank", request.headers.get("X-Request-Id")), "model": model,
            "usage": {"total_tokens": tokens}, "results": results[:top_n],
        }))  # fmt: skip

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        call, body, _ = self._parse(request)
        if isinstance(body.get("messages"), list):
            text = " ".join(str(m.get("content", "")) for m in body["messages"])
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise p.ApiError(400, "Field required: prompt or messages", "prompt")
        await before_headers(call.fault)
        tokens = p.token_ids(text)
        return await self._reply(request, call, orjson.dumps({
            "count": len(tokens), "max_model_len": self.config.max_model_len,
            "tokens": tokens, "token_strs": None,
        }))  # fmt: skip

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        call, body, _ = self._parse(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise p.ApiError(400, "tokens must be a list of integers.", "tokens")
        await before_headers(call.fault)
        prompt = " ".join(f"t{t}" for t in tokens)
        return await self._reply(request, call, orjson.dumps({"prompt": prompt}))

    # --- server info -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        # Versions on either side of vLLM's gpu_ -> kv_cache_usage_perc rename.
        version = "0.7.3+fake" if self.config.legacy_metrics else "0.10.1+fake"
        return json_response({"version": version})

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.config
        body = p.model_list(cfg.models, cfg.lora_adapters, cfg.max_model_len)
        return web.Response(body=body, content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        # prometheus_client's content type, which vLLM serves.
        return web.Response(
            body=self.engine.metrics_page().encode(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

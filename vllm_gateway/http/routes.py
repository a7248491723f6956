"""HTTP routes: the OpenAI-compatible relay and the fleet's read-only endpoints.

    POST /v1/{anything} (and vLLM's root-level model endpoints)  -> relay to a worker
    GET  /v1/models                -> union of the ready workers' models, OpenAI list format
    GET  /v1/models/{id}           -> one of them, as OpenAI's model object (404 otherwise)
    GET  /health                   -> 200 with a summary when a worker is ready, else 503
    GET  /list_workers             -> every worker: url, models, state, in-flight, reported load
    GET|POST /list_models          -> {"models": [...]}, as FastChat's controller answers

The relay handler (`Routes.relay_exchange`) reads top-down: read the body, build the
`RequestInfo`, take a lease on a worker, relay. It is written once against
`exchange.Exchange`: front.py serves most relay requests with it, aiohttp the others
(`relay_request`). Both reach it through `gate.Gate.serve`, which admits the client key and
turns every error into an OpenAI error body (and fires `ERROR_HOOKS`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from vllm_gateway.config.gateway import CorsConfig
from vllm_gateway.dispatch.aliases import AliasTable
from vllm_gateway.dispatch.dispatcher import Dispatcher, outcome_of
from vllm_gateway.dispatch.prefill_rate import seconds_per_byte
from vllm_gateway.dispatch.request_info import parse_request
from vllm_gateway.errors import (
    BadRequest,
    BodyTooLarge,
    ExpectationFailed,
    GatewayError,
    ModelNotFound,
    NoWorkerAvailable,
    PathRefused,
    RequestTimeout,
    RouteNotFound,
    UpstreamError,
    error_response,
)
from vllm_gateway.http.aiohttp_exchange import EXCHANGE, AiohttpExchange
from vllm_gateway.http.cors import Cors
from vllm_gateway.log import bind_request, clear_request, get_logger
from vllm_gateway.proxy.exchange import Exchange, Headers
from vllm_gateway.proxy.relay import Relay
from vllm_gateway.workers import Worker, WorkerRegistry, WorkerState

log = get_logger("vllm_gateway.routes")

# vLLM serves these model endpoints outside /v1/; everything under /v1/ is relayed anyway.
ROOT_MODEL_PATHS = (
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/invocations",
)


def is_model_path(path: str) -> bool:
    """Is `path` one of the OpenAI/vLLM model endpoints (a POST there is relayed)?"""
    return path.startswith("/v1/") or path in ROOT_MODEL_PATHS


# vLLM's runtime LoRA endpoints: a client allowed there could load or unload adapters for
# everyone. Refused unless `auth.lora_updates` is on.
LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def is_lora_update(path_qs: str) -> bool:
    """Is this target one of vLLM's LoRA update endpoints (in any spelling a server might
    route there: repeated or trailing slashes, any case)?"""
    path = path_qs.partition("?")[0].lower()
    if "//" in path:
        path = "/".join(part for part in path.split("/") if part)
        path = "/" + path
    return path.rstrip("/") in LORA_PATHS


def has_dot_segment(path: str) -> bool:
    """Does the (decoded) `path` have a `.` or `..` segment, or a backslash (`%5c`), which
    some servers and proxies take for a `/`?"""
    if "\\" in path:
        return True
    return "/." in path and any(segment in (".", "..") for segment in path.split("/"))


class RequestIds:
    """Unique, cheap request ids: a random prefix per app (so per process, also after a
    fork) and a counter."""

    __slots__ = ("_counter", "_prefix")

    def __init__(self) -> None:
        self._prefix = f"gw-{os.urandom(4).hex()}-"
        self._counter = itertools.count(1)

    def new(self) -> str:
        return f"{self._prefix}{next(self._counter):x}"


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` as aiohttp answers it; any other expectation gets 417 in the
    OpenAI error shape (aiohttp's own answer is plain text, before any middleware)."""
    expect = request.headers.get("Expect", "")
    if expect.lower() == "100-continue":
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None
    return error_response(ExpectationFailed(f"Unknown Expect: {expect[:100]}"))


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's X-Request-Id when it is a sane token (it is echoed back, forwarded and
    logged): at most 128 printable ASCII characters, no spaces. Otherwise None."""
    given = headers.get("X-Request-Id")
    if given and len(given) <= 128 and given.isascii() and given.isprintable() and " " not in given:
        return given
    return None


def json_response(doc: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


# Called with (error, method, path, request id) for every error the gateway answers itself,
# after the fact (telemetry counts them, the access log writes them), on either path
# (gate.Gate.fire). Only the error path pays for it.
ErrorHook = Callable[[GatewayError, str, str, str | None], None]
ERROR_HOOKS = web.AppKey("error_hooks", list[ErrorHook])


def cors_headers(cors: Cors) -> Callable[[web.BaseRequest, web.StreamResponse], Awaitable[None]]:
    """CORS on aiohttp's side (http/cors.py), as an `on_response_prepare` signal: every
    answer to a request with an Origin gets the headers (relayed ones, error answers and
    the admin sub-app's alike), whenever its head is written."""

    async def add_headers(request: web.BaseRequest, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and "Access-Control-Allow-Origin" not in response.headers:
            for name, value in cors.answer_headers(origin, "Cookie" in request.headers):
                response.headers.add(name, value)

    return add_headers


def cors_answer_headers(cors: Cors) -> Callable[[Exchange], Headers]:
    """CORS through the gate's seam for headers on every answer (`gate.Gate.answer_headers`):
    the front path's answers, relayed answers and error answers on both paths."""

    def answer_headers(ex: Exchange) -> Headers:
        headers = ex.headers  # parsed once: the relay handler reads them too
        origin = headers.get("Origin")
        if origin is None:
            return []
        pairs = cors.answer_headers(origin, "Cookie" in headers)
        return [(n.encode(), v.encode("latin-1")) for n, v in pairs]

    return answer_headers


def cors_preflight(cors: Cors) -> Middleware:
    """The middleware answering CORS preflights on any path; it runs inside the gate, which
    admits no client key for a preflight (a browser's preflight carries no credentials)."""

    @web.middleware
    async def answer_preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        asked = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or asked is None:
            return await handler(request)
        headers, refused = cors.preflight(
            origin, asked, request.headers.get("Access-Control-Request-Headers")
        )
        if refused:
            raise BadRequest(f"CORS preflight refused: {', '.join(refused)} not allowed ([cors]).")
        return web.Response(status=204, headers=headers)

    return answer_preflight


class Routes:
    """The request handlers, bound to the objects `create_app` built."""

    def __init__(
        self,
        registry: WorkerRegistry,
        dispatcher: Dispatcher,
        relay: Relay,
        max_body_bytes: int,
        aliases: AliasTable | None = None,
        body_timeout: float = 60.0,
        cors: Cors | None = None,
        lora_updates: bool = False,
    ) -> None:
        self.registry = registry
        self.dispatcher = dispatcher
        self.relay = relay
        self.max_body_bytes = max_body_bytes
        self.aliases = aliases or AliasTable(registry)
        self.body_timeout = body_timeout  # seconds to receive a whole request body
        self.cors = cors or Cors(CorsConfig())  # the [cors] rules: both serving paths follow
        self.lora_updates = lora_updates  # relay clients' LoRA load/unload requests
        self.started = time.time()
        self.request_ids = RequestIds()
        # The relay requests being handled now (their tasks): shutdown waits for them.
        self.active: set[asyncio.Task[Any]] = set()

    def add_to(self, app: web.Application) -> None:
        app.on_response_prepare.append(cors_headers(self.cors))  # preflights: cors_preflight
        r = app.router
        get = partial(r.add_get, expect_handler=expect_continue)
        post = partial(r.add_post, expect_handler=expect_continue)
        get("/v1/models", self.models)
        get("/v1/models/{model:.+}", self.model)  # ids may hold `/`: meta-llama/Llama-3-8B
        get("/health", self.health)
        get("/list_workers", self.list_workers)
        get("/list_models", self.list_models)
        post("/list_models", self.list_models)
        post("/v1/{tail:.*}", self.relay_request)
        for path in ROOT_MODEL_PATHS:
            post(path, self.relay_request)

    # --- the relay -------------------------------------------------------------------------

    async def relay_request(self, request: web.Request) -> web.StreamResponse:
        """aiohttp's handler for the relay paths: the requests front.py handed to aiohttp."""
        if has_dot_segment(request.path):
            # aiohttp decodes `%2e%2e` to `..` and `%5c` to `\\`; relayed, a worker behind a
            # proxy that resolves dot segments (or takes `\\` for `/`) could be reached
            # outside the model paths.
            raise RouteNotFound(
                "Dot segments (`.`, `..`, or encoded) and backslashes are not relayed."
            )
        exchange = request.get(EXCHANGE) or AiohttpExchange(request)
        await self.relay_exchange(exchange)
        assert exchange.response is not None  # relay answers or raises
        return exchange.response

    async def relay_exchange(self, ex: Exchange) -> None:
        """Relay one OpenAI request to a worker serving its model; answer on `ex`."""
        request_id = client_request_id(ex.headers) or self.request_ids.new()
        ex.request_id = request_id
        task = asyncio.current_task()
        assert task is not None  # each request runs in a task of its own, on either path
        self.active.add(task)
        try:
            # The body is not kept in this frame: it lives as long as the stream does.
            body = await self._read_body(ex)
            if not self.lora_updates and is_lora_update(ex.path_qs):
                raise PathRefused(
                    "Loading and unloading LoRA adapters is not open to clients here "
                    "(auth.lora_updates)."
                )
            info = parse_request(ex.path_qs, body, request_id, ex.headers)
            del body
            bind_request(request_id=request_id, model=info.model)
            asked = info
            info = self.aliases.resolve(asked)
            resplit = info is not asked  # an alias's request may be split again, once
            tried: list[Worker] = []
            while True:
                try:
                    async with self.dispatcher.lease(info, exclude=tried) as lease:
                        bind_request(worker=lease.worker.url)
                        try:
                            return await self.relay.forward(ex, lease)
                        except UpstreamError as e:
                            # The retry rule: dispatch/dispatcher.py's docstring.
                            if not (e.retryable and lease.can_retry):
                                raise
                            lease.outcome = outcome_of(e)
                            tried.append(lease.worker)
                            failure = e
                except NoWorkerAvailable:
                    # The version it was split to has no worker left (its last one drained
                    # while the request waited, as in a rollout; none reached): split again,
                    # once, now that the split leads where workers are.
                    again = self.aliases.resolve(asked) if resplit else info
                    resplit = False
                    if again.model == info.model:
                        raise
                    info, tried = again, []
                    continue
                await self.dispatcher.before_retry(lease, failure)
        finally:
            self.active.discard(task)
            clear_request()

    async def _read_body(self, ex: Exchange) -> bytes:
        length = ex.content_length
        if length is not None and length > self.max_body_bytes:
            raise BodyTooLarge(
                f"The request body is {length} bytes; the limit is {self.max_body_bytes}."
            )
        if ex.body_ready():
            # The whole body is already here (the common case): nothing to time, and
            # no timer to arm and cancel on the hot path.
            return await ex.read_body(self.max_body_bytes)
        try:
            async with asyncio.timeout(self.body_timeout):
                return await ex.read_body(self.max_body_bytes)
        except TimeoutError:
            raise RequestTimeout(
                f"The request body did not arrive within {self.body_timeout:g} s."
            ) from None

    # --- fleet endpoints -------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the union of the ready workers' models."""
        data = [self._model_object(m) for m in self._ready_models()]
        return json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: one model, as OpenAI answers it (the SDK's
        `models.retrieve`). Every model a request may name without a 404 is found here too,
        ready or not (a worker out, a model scaling from zero); 404 `model_not_found` for
        any other."""
        model = request.match_info["model"]
        if model not in self._known_models():
            raise ModelNotFound(f"The model `{model[:200]}` does not exist.", param="model")
        return json_response(self._model_object(model))

    def _known_models(self) -> set[str]:
        """Models some worker serves in any state, every alias, the models that scale from
        zero: what dispatch answers without a 404."""
        return {
            *self.registry.known_models(),
            *self.aliases.names(),
            *self.dispatcher.scales_from_zero,
        }

    def _model_object(self, model: str) -> dict[str, object]:
        return {
            "id": model,
            "object": "model",
            "created": int(self.started),
            "owned_by": "vllm-gateway",
        }

    async def list_models(self, request: web.Request) -> web.Response:
        """GET/POST /list_models, FastChat's controller shape."""
        return json_response({"models": self._ready_models()})

    def _ready_models(self) -> list[str]:
        """Models with a ready worker, and the aliases that lead to one."""
        return sorted({*self.registry.ready_models(), *self.aliases.ready_names()})

    async def health(self, request: web.Request) -> web.Response:
        """200 when at least one worker is ready, 503 otherwise; a summary either way."""
        counts: dict[str, int] = {s.value: 0 for s in WorkerState if s is not WorkerState.REMOVED}
        for w in self.registry:
            counts[w.state.value] += 1
        ready = counts[WorkerState.READY.value]
        doc = {
            "status": "ok" if ready else "unavailable",
            "workers": counts,
            "models": self.registry.ready_models(),
        }
        return json_response(doc, 200 if ready else 503)

    async def list_workers(self, request: web.Request) -> web.Response:
        """Every worker with its state, models, in-flight count and last reported load."""
        now = time.monotonic()
        buckets = self.dispatcher.buckets
        return json_response(
            {
                "workers": [
                    describe_worker(w, now) | {"dispatch": buckets.describe(w)}
                    for w in self.registry
                ]
            }
        )


def describe_worker(w: Worker, now: float) -> dict[str, object]:
    """One worker as /list_workers shows it."""
    stats = w.stats
    return {
        "url": w.url,
        "models": sorted(w.models),
        "state": w.state.value,
        "state_reason": w.state_reason,
        "circuit": w.circuit.value,
        "source": w.source,
        "weight": w.weight,
        "inflight": w.inflight,
        "running": stats.running if stats else None,
        "waiting": stats.waiting if stats else None,
        "kv_cache_usage": stats.kv_cache_usage if stats else None,
        # Whether its KV cache was seen to bind, the tokens its free blocks held at the
        # last scrape (null: not reported, stale, or read full with no queue while not
        # binding), and the request bytes per prompt token measured
        # for it (null: not yet): dispatch/kv_queue.py. Its time to a streamed first byte
        # per KiB of prefill owed (null: not yet): dispatch/prefill_rate.py.
        "kv_binds": w.kv_binds,
        "kv_free": w.kv_free if math.isfinite(w.kv_free) else None,
        "token_bytes": round(w.token_bytes, 2) if w.token_bytes else None,
        "prefill_ms_per_kib": round(seconds_per_byte(w) * 1024e3, 3) or None,
        # Prompt tokens its prefix-cache counters say it prefilled per second lately
        # (0: idle or unknown; over its KV cache, the pressure cache_aware weighs: workers.py).
        "cache_missed_per_s": round(w.miss_rate, 1),
        "stats_age_seconds": round(now - stats.at, 3) if stats else None,
        "completed": w.completed,
        "failed": w.failed,
    }

"""The admin API under /admin/: workers, drain, aliases and traffic splits, scale signals.

Every request needs `Authorization: Bearer <admin.token>`; with no token configured the
whole API answers 403 (it is refused, never open). Reads are GETs; every change is a POST
with a JSON body, and applying the same POST twice leaves the same state as once, so a
multi-process gateway can hand each control request to all of its processes.

    GET  /admin/workers                         every worker, with circuit and heartbeat
    POST /admin/workers/add      {url, models?, weight?}     add (source "admin"), probe now
    POST /admin/workers/remove   {url, drain?, timeout?}     remove (optionally drain first)
    POST /admin/workers/drain    {url, wait?, timeout?}      no new requests; wait: until idle
    POST /admin/workers/undrain  {url}                       probe, then take requests again
    POST /admin/workers/weight   {url, weight}               relative share of traffic
    GET  /admin/aliases                          aliases and splits
    POST /admin/aliases/set      {name, targets: {model: weight}}
    POST /admin/aliases/remove   {name}
    GET  /admin/scale                            per-model demand and desired worker count
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.config.settings import MAX_SECONDS, MAX_WEIGHT
from vllm_gateway.control.access import forbidden, require_token
from vllm_gateway.control.body import get_bool, get_number, get_str, get_str_list, get_url
from vllm_gateway.control.body import read_json as read_body
from vllm_gateway.dispatch.aliases import AliasTable
from vllm_gateway.errors import BadRequest, WorkerNotFound
from vllm_gateway.fleet.operations import Fleet
from vllm_gateway.http.routes import describe_worker, json_response
from vllm_gateway.workers import Source, Worker

WHAT = "admin API"
REMOVED = "removed by operator"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Extra per-worker fields other modules add to the admin view (registration: heartbeat age).
Describer = Callable[[Worker, float], dict[str, Any]]
# Reads the autoscaler's current signals (None when the app has none).
ScaleView = Callable[[], dict[str, Any]]


class AdminApi:
    """The /admin/ sub-application's handlers, bound to the objects `create_app` built.

    Also the `WorkerSource` of admin-added workers (fleet/sources.py): they live until an
    operator removes them; a reload never touches them.
    """

    def __init__(
        self,
        fleet: Fleet,
        aliases: AliasTable,
        token: str,
        drain_timeout: float,
        *,
        describers: list[Describer] | None = None,
        scale_view: ScaleView | None = None,
    ) -> None:
        self.fleet = fleet
        self.registry = fleet.registry
        self.aliases = aliases
        self.token = token
        self.drain_timeout = drain_timeout
        self.describers = describers if describers is not None else []
        self.scale_view = scale_view

    def app(self) -> web.Application:
        """The sub-application to mount at /admin/ (its middleware checks the token)."""
        app = web.Application(middlewares=[self._auth])
        r = app.router
        r.add_get("/workers", self.list_workers)
        r.add_post("/workers/add", self.add)
        r.add_post("/workers/remove", self.remove)
        r.add_post("/workers/drain", self.drain)
        r.add_post("/workers/undrain", self.undrain)
        r.add_post("/workers/weight", self.weight)
        r.add_get("/aliases", self.list_aliases)
        r.add_post("/aliases/set", self.set_alias)
        r.add_post("/aliases/remove", self.remove_alias)
        r.add_get("/scale", self.scale)
        return app

    async def start(self) -> None:
        pass  # nothing runs in the background: every change is an operator's request

    async def stop(self) -> None:
        pass

    def configure(self, config: GatewayConfig) -> list[str]:
        """Follow a reloaded [admin] section (the token, the default drain timeout)."""
        new = config.admin
        if (new.token, new.drain_timeout) == (self.token, self.drain_timeout):
            return []
        self.token, self.drain_timeout = new.token, new.drain_timeout
        return ["admin settings changed"]

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not self.token:
            raise forbidden(
                request,
                WHAT,
                "it is disabled; set admin.token (VLLM_GATEWAY_ADMIN_TOKEN) to enable it",
            )
        require_token(request, self.token, WHAT)
        return await handler(request)

    # --- workers -----------------------------------------------------------------------

    def describe(self, worker: Worker, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        doc = describe_worker(worker, now)
        doc["consecutive_failures"] = worker.consecutive_failures
        doc["breaker_openings"] = worker.breaker_openings
        for extra in self.describers:
            doc.update(extra(worker, now))
        return doc

    def _worker(self, url: str) -> Worker:
        worker = self.registry.get(url)
        if worker is None:
            raise WorkerNotFound(f"No worker {url} is known to this gateway.", param="url")
        return worker

    async def list_workers(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        return json_response({"workers": [self.describe(w, now) for w in self.registry]})

    async def add(self, request: web.Request) -> web.Response:
        doc = await read_body(request)
        url = get_url(doc)
        models = get_str_list(doc, "models")
        weight = get_number(doc, "weight", 1.0, maximum=MAX_WEIGHT, null=False)
        worker, added = await self.fleet.add(
            url, source=Source.ADMIN, models=models, weight=weight or 0.0
        )
        return json_response({"added": added, "worker": self.describe(worker)})

    async def remove(self, request: web.Request) -> web.Response:
        doc = await read_body(request)
        worker = self._worker(get_url(doc))
        idle, timeout = True, self._timeout(doc)  # checked before anything changes
        if get_bool(doc, "drain", False) and not self.fleet.retire(worker, REMOVED):
            idle = await self.fleet.wait_idle(worker, timeout)  # removed when idle
            if not self.fleet.retiring_worker(worker):
                # Gone at its last request's end (its URL may have joined again since, as
                # another worker), or an undrain called the retirement off: the later word.
                removed = self.registry.get(worker.url) is not worker
                doc = {"removed": removed, "idle": idle, "worker": self.describe(worker)}
                return json_response(doc)
        self.fleet.remove(worker.url, REMOVED)  # at once, or now that the wait timed out
        return json_response({"removed": True, "idle": idle, "worker": self.describe(worker)})

    async def drain(self, request: web.Request) -> web.Response:
        doc = await read_body(request)
        worker = self._worker(get_url(doc))
        wait, timeout = get_bool(doc, "wait", False), self._timeout(doc)  # before the drain
        self.fleet.drain(worker)
        started = time.monotonic()
        idle = worker.inflight == 0
        if wait:
            idle = await self.fleet.wait_idle(worker, timeout)
        return json_response(
            {
                "idle": idle,
                "waited_seconds": round(time.monotonic() - started, 3),
                "worker": self.describe(worker),
            }
        )

    async def undrain(self, request: web.Request) -> web.Response:
        doc = await read_body(request)
        worker = self._worker(get_url(doc))
        changed = await self.fleet.undrain(worker)
        return json_response({"changed": changed, "worker": self.describe(worker)})

    async def weight(self, request: web.Request) -> web.Response:
        doc = await read_body(request)
        worker = self._worker(get_url(doc))
        weight = get_number(doc, "weight", None, maximum=MAX_WEIGHT, null=False)
        if weight is None:
            raise BadRequest("`weight` is required.", param="weight")
        self.registry.set_weight(worker, weight)
        return json_response({"worker": self.describe(worker)})

    def _timeout(self, doc: dict[str, Any]) -> float:
        timeout = get_number(doc, "timeout", self.drain_timeout, maximum=MAX_SECONDS, null=False)
        return timeout or 0.0

    # --- aliases and splits ------------------------------------------------------------

    async def list_aliases(self, request: web.Request) -> web.Response:
        return json_response({"aliases": self.aliases.describe()})

    async def set_alias(self, request: web.Request) -> web.Response:
        doc = await read_body(request)
        name = get_str(doc, "name")
        targets = doc.get("targets")
        problem = self.aliases.set(name, targets)
        if problem:
            raise BadRequest(problem, param="targets")
        return json_response({"aliases": self.aliases.describe()})

    async def remove_alias(self, request: web.Request) -> web.Response:
        doc = await read_body(request)
        removed = self.aliases.remove(get_str(doc, "name"))
        return json_response({"removed": removed, "aliases": self.aliases.describe()})

    # --- scale signals -----------------------------------------------------------------

    async def scale(self, request: web.Request) -> web.Response:
        return json_response(self.scale_view() if self.scale_view else {"models": {}})

"""The operator's read-only views of a running gateway, over HTTP.

    GET /metrics             Prometheus text exposition (telemetry.render)
    GET /stats               the same numbers as one JSON document, for the status page
    GET / and /dashboard     the status page: one self-contained HTML file (static/status.html)

Everything is computed when asked, from the objects that own the numbers; the status page
turns successive /stats answers into rates and latencies in the browser.
"""

from __future__ import annotations

import importlib.resources
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from vllm_gateway import __version__
from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.dispatch.dispatcher import CLIENT_GONE, OK, Dispatcher
from vllm_gateway.fleet.scrape import Scraper
from vllm_gateway.http.routes import describe_worker, json_response
from vllm_gateway.observe.exposition import CONTENT_TYPE, Histogram
from vllm_gateway.observe.telemetry import (
    ReloadCounters,
    RequestMetrics,
    render,
)
from vllm_gateway.process.placement_feed import PlacementFeed
from vllm_gateway.process.siblings import Siblings
from vllm_gateway.process.view import merge_expositions, merge_stats
from vllm_gateway.workers import WorkerRegistry, WorkerState

if TYPE_CHECKING:
    from vllm_gateway.control.registration import Registration
    from vllm_gateway.fleet.autoscale import Autoscaler
    from vllm_gateway.fleet.health import Prober


@dataclass
class StatusViews:
    """Handlers for /metrics, /stats and the status page, bound to the app's objects."""

    config: GatewayConfig  # the running one; apply_config replaces it
    metrics: RequestMetrics
    registry: WorkerRegistry
    dispatcher: Dispatcher
    scraper: Scraper
    reloads: ReloadCounters
    started: float  # Unix time the process started serving
    page: bytes = b""
    # With --processes N: this process's index and its siblings, whose views are merged in.
    process: int | None = None
    siblings: Siblings | None = None
    feed: PlacementFeed | None = None
    peers: PlacementFeed | None = None  # the placement feed to the peer replicas
    autoscaler: Autoscaler | None = None
    registration: Registration | None = None
    prober: Prober | None = None

    def add_to(self, app: web.Application, *, metrics: bool, page: bool) -> None:
        if metrics:
            app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/stats", self.stats)
        if page:
            self.page = (
                importlib.resources.files("vllm_gateway").joinpath("static/status.html")
            ).read_bytes()
            app.router.add_get("/", self.status_page)
            app.router.add_get("/dashboard", self.status_page)

    async def prometheus(self, request: web.Request) -> web.Response:
        text = render(
            self.metrics,
            self.registry,
            self.dispatcher,
            self.scraper,
            self.reloads,
            self.started,
            self.process,
            self.autoscaler,
            self.registration,
            self.prober,
            (self.feed, self.peers),
        )
        if self.siblings is not None and not self.siblings.asked_by_sibling(request):
            others = await self.siblings.collect(request)
            text = merge_expositions([text, *(body.decode() for body in others)])
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

    async def status_page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.page,
            content_type="text/html",
            charset="utf-8",
            headers={"Cache-Control": "no-cache"},
        )

    async def stats(self, request: web.Request) -> web.Response:
        doc = self.snapshot()
        if self.siblings is not None and not self.siblings.asked_by_sibling(request):
            others = await self.siblings.collect(request)
            doc = merge_stats(doc, [orjson.loads(body) for body in others])
        return json_response(doc)

    def snapshot(self) -> dict[str, object]:
        """Counters and gauges as they are now; rates are the reader's business."""
        per_model: dict[str, _ModelTotals] = {}
        workers = self._workers_and_models(per_model)
        return {
            "gateway": self._gateway_doc(),
            "errors": [
                {"status": status, "code": code, "count": n}
                for (status, code), n in sorted(self.metrics.errors.items())
            ],
            "models": [{"model": m, **per_model[m].to_json()} for m in sorted(per_model)],
            "workers": workers,
            "admission_queue": self.dispatcher.admission.to_json(),
        }

    def _workers_and_models(self, per_model: dict[str, _ModelTotals]) -> list[dict[str, Any]]:
        """Each worker's line, with the per-model totals added up into `per_model`."""
        now = time.monotonic()
        per_worker: dict[str, list[int]] = {}  # url -> [finished, failed]

        def model_totals(model: str) -> _ModelTotals:
            totals = per_model.get(model)
            if totals is None:
                totals = per_model[model] = _ModelTotals()
            return totals

        for (model, url, _status, outcome), n in self.metrics.requests.items():
            counts = per_worker.setdefault(url, [0, 0])
            totals = model_totals(model)
            counts[0] += n
            totals.requests += n
            if outcome not in (OK, CLIENT_GONE):
                counts[1] += n
                totals.failed += n
        for (model, _url), h in self.metrics.duration.items():
            model_totals(model).duration.add(h)
        for (model, _url), h in self.metrics.ttfb.items():
            model_totals(model).ttfb.add(h)
        if self.autoscaler is not None:
            for model, signal in self.autoscaler.signals.items():
                totals = model_totals(model)
                totals.demand, totals.desired = signal.demand, signal.desired
        workers = []
        for w in sorted(self.registry, key=lambda x: x.url):
            doc = describe_worker(w, now)
            doc["requests"], doc["request_failures"] = per_worker.get(w.url, (0, 0))
            workers.append(doc)
            for model in w.models:
                totals = model_totals(model)
                totals.workers += 1
                totals.ready += w.state is WorkerState.READY
                totals.inflight += w.inflight_for(model)  # by the leases' model
        return workers

    def _gateway_doc(self) -> dict[str, object]:
        return {
            "version": __version__,
            "pid": os.getpid(),
            "time": time.time(),
            "started": self.started,
            "processes": 1,
            "policy": self.config.policy,
            "retries": self.dispatcher.retries,
            "config_reloads": {
                "succeeded": self.reloads.succeeded,
                "failed": self.reloads.failed,
                "last_ok": self.reloads.last_ok,
            },
        }


class _Summed:
    """Histograms of several workers summed into one, with cumulative buckets by `le`."""

    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0.0
        self.buckets: dict[str, int] = {}

    def add(self, h: Histogram) -> None:
        self.count += h.count
        self.sum += h.sum
        for le, n in h.cumulative():
            self.buckets[le] = self.buckets.get(le, 0) + n

    def to_json(self) -> dict[str, object]:
        return {"count": self.count, "sum": round(self.sum, 6), "buckets": self.buckets}


class _ModelTotals:
    """One model's line on the status page."""

    __slots__ = (
        "demand",
        "desired",
        "duration",
        "failed",
        "inflight",
        "ready",
        "requests",
        "ttfb",
        "workers",
    )

    def __init__(self) -> None:
        self.requests = 0
        self.failed = 0
        self.workers = 0
        self.ready = 0
        self.inflight = 0
        self.duration = _Summed()
        self.ttfb = _Summed()
        self.demand: float | None = None  # the autoscaler's signals (None: no autoscaler)
        self.desired: int | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "failed": self.failed,
            "workers": self.workers,
            "ready": self.ready,
            "inflight": self.inflight,
            "duration": self.duration.to_json(),
            "ttfb": self.ttfb.to_json(),
            "demand": self.demand,
            "desired": self.desired,
        }

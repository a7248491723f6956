"""Workers that join by themselves: FastChat's controller API, heartbeats and their expiry.

    POST /register_worker     {worker_name: URL, check_heart_beat, worker_status?}
    POST /receive_heart_beat  {worker_name, queue_length}  -> {"exist": bool, ...}
    POST /refresh_all_workers                              -> probe every worker now
    POST /get_worker_address  {model}                      -> {"address": URL or ""}
and two paths of our own, for `vllm-gateway register` leaving cleanly:
    POST /drain_worker        {worker_name, undrain?}      -> {"exist", "state", "inflight"}
    POST /unregister_worker   {worker_name}                -> {"exist": bool}

Tooling written for FastChat's controller works unchanged: `worker_name` is the worker's
base URL, and `worker_status` (`model_names`, `queue_length`) is optional; without it the
gateway learns the models from the worker's /v1/models. A registered worker is probed at
once, so a healthy one takes traffic within a probe round trip. One that asked for
heartbeat checks (`check_heart_beat`, FastChat's default) and sent none for
`heartbeat_expiry` seconds is removed.

Security: with `registration.token` set, every path but /get_worker_address needs it as a
bearer token (401 otherwise), and a worker URL outside the allowed networks is refused with
403 (access.py). Without a token, a gateway listening beyond loopback takes registrations
from loopback clients only (403 for others) unless `registration.open_without_token` says
otherwise: closed by default, since FastChat's workers register without any header. Every
refusal is logged, without the token.

The API acts only on workers that registered (source "registered"): /drain_worker and
/unregister_worker answer 409 for a static, admin-added or DNS-discovered worker, and
/register_worker for such a URL changes neither its source nor its life (its heartbeat is
recorded, never checked), since every worker host holds the registration token.

Each change is idempotent (re-registering a known worker refreshes its heartbeat and
nothing else), so a multi-process gateway may hand each request to all its processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vllm_gateway.config.gateway import GatewayConfig, RegistrationConfig
from vllm_gateway.config.load import check_model_name
from vllm_gateway.control.access import (
    AllowedNetworks,
    forbidden,
    is_loopback,
    local_peer,
    refuse,
    require_token,
)
from vllm_gateway.control.body import get_bool, get_number, get_str, get_url, read_json
from vllm_gateway.dispatch.aliases import AliasTable
from vllm_gateway.dispatch.dispatcher import Dispatcher
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.errors import BadRequest, NotRegistered, Unauthorized
from vllm_gateway.fleet.operations import Fleet
from vllm_gateway.fleet.periodic import Periodic
from vllm_gateway.http.routes import json_response
from vllm_gateway.log import get_logger
from vllm_gateway.workers import Source, Worker, WorkerState

log = get_logger("vllm_gateway.registration")

WHAT = "registration API"


@dataclass(slots=True)
class Heartbeat:
    """What the last heartbeat (or registration) of one worker said."""

    at: float  # time.monotonic() it arrived
    check: bool  # whether the worker asked to be removed when heartbeats stop
    queue_length: float | None = None  # as the worker reported it (FastChat's field)


class Registration:
    """The registration handlers and the heartbeat expiry task: the `WorkerSource` of
    registered workers (fleet/sources.py)."""

    def __init__(
        self,
        fleet: Fleet,
        dispatcher: Dispatcher,
        aliases: AliasTable,
        config: RegistrationConfig,
        host: str = "127.0.0.1",
    ) -> None:
        self.fleet = fleet
        self.registry = fleet.registry
        self.dispatcher = dispatcher
        self.aliases = aliases
        self.config = config
        self.allowed = AllowedNetworks(config.allowed_networks, config.allowed_hosts)
        # No token, listening beyond loopback (`host`), open registration not asked for:
        # only loopback clients (an agent beside the gateway) may register.
        self.loopback_only = loopback_only(config, host)
        self.heartbeats: dict[str, Heartbeat] = {}
        self.expired = 0  # workers removed for missing heartbeats (telemetry reads it)
        self.refused = 0  # registration requests refused (token or network)
        self._expiry = Periodic(
            "heartbeat-expiry", self.expire, self._expiry_pause, log, "heartbeat expiry failed"
        )

    def add_to(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/register_worker", self.register)
        r.add_post("/receive_heart_beat", self.heartbeat)
        r.add_post("/refresh_all_workers", self.refresh_all)
        r.add_post("/get_worker_address", self.worker_address)
        r.add_post("/drain_worker", self.drain)
        r.add_post("/unregister_worker", self.unregister)

    # --- handlers ----------------------------------------------------------------------

    def _authorize(self, request: web.Request) -> None:
        if self.config.token:
            try:
                require_token(request, self.config.token, WHAT)
            except Unauthorized:
                self.refused += 1
                raise
        elif self.loopback_only and not local_peer(request):
            self.refused += 1
            raise forbidden(
                request,
                WHAT,
                "without registration.token it accepts loopback clients only "
                "(set registration.token, or registration.open_without_token = true)",
            )

    def _owned(self, request: web.Request, worker: Worker) -> None:
        """Raise 409 unless `worker` joined through this API: the token is every worker
        host's, and must not reach the operator's own workers."""
        if worker.source is not Source.REGISTERED:
            self.refused += 1
            refuse(request, WHAT, "not a registered worker", worker=worker.url)
            raise NotRegistered(
                f"The {WHAT} acts only on workers that registered; {worker.url} is a "
                f"{worker.source} worker (its own owner drains and removes it)."
            )

    async def register(self, request: web.Request) -> web.Response:
        """FastChat's /register_worker: add the worker (source "registered") and probe it."""
        self._authorize(request)
        doc = await read_json(request)
        url = get_url(doc, "worker_name")
        problem = await self.allowed.check(url)
        if problem:
            self.refused += 1
            raise forbidden(request, WHAT, problem, worker=url)
        status = doc.get("worker_status") or {}
        if not isinstance(status, dict):
            raise BadRequest("`worker_status` must be an object.", param="worker_status")
        models = status.get("model_names") or []
        if not isinstance(models, list) or not all(
            isinstance(m, str) and not check_model_name(m) for m in models
        ):
            raise BadRequest("`worker_status.model_names` must be a list of model names.")
        check = get_bool(doc, "check_heart_beat", True)
        known = self.registry.get(url)
        if known is not None and known.source is not Source.REGISTERED:
            # Another owner's worker: its heartbeat is noted, never checked (no expiry).
            self.heartbeats[url] = Heartbeat(time.monotonic(), False, _queue_length(status))
            return json_response(
                {
                    "ok": True,
                    "new": False,
                    "state": known.state.value,
                    "models": sorted(known.models),
                    "source": known.source,
                }
            )
        self.heartbeats[url] = Heartbeat(time.monotonic(), check, _queue_length(status))
        worker, new = await self.fleet.add(url, source=Source.REGISTERED, probe=False)
        if new and models:  # dispatchable by name at once; the probe then has the last word
            self.registry.set_models(worker, models)
        if worker.state in (WorkerState.JOINING, WorkerState.UNHEALTHY):
            await self.fleet.probe(worker)
        return json_response(
            {"ok": True, "new": new, "state": worker.state.value, "models": sorted(worker.models)}
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        """FastChat's /receive_heart_beat: {"exist": false} tells the worker to re-register."""
        self._authorize(request)
        doc = await read_json(request)
        url = get_url(doc, "worker_name")
        worker = self.registry.get(url)
        if worker is None:
            self.heartbeats.pop(url, None)
            return json_response({"exist": False})
        beat = self.heartbeats.get(url)
        queue = get_number(doc, "queue_length", None)
        if beat is None:  # a known worker (static, say) that heartbeats: never expires
            self.heartbeats[url] = Heartbeat(time.monotonic(), False, queue)
        else:
            beat.at = time.monotonic()
            beat.queue_length = queue
        return json_response(_worker_doc(worker))

    async def refresh_all(self, request: web.Request) -> web.Response:
        """FastChat's /refresh_all_workers: probe every worker now."""
        self._authorize(request)
        await self.fleet.prober.probe_all()
        counts: dict[str, int] = {}
        for w in self.registry:
            counts[w.state.value] = counts.get(w.state.value, 0) + 1
        return json_response({"workers": counts})

    async def worker_address(self, request: web.Request) -> web.Response:
        """FastChat's /get_worker_address: the worker the dispatcher would pick, or ""."""
        doc = await read_json(request)
        model = get_str(doc, "model")
        info = self.aliases.resolve(RequestInfo("/v1/completions", b"", model, False, "", {}))
        worker = self.dispatcher.choose(info)
        return json_response({"address": worker.url if worker else ""})

    async def drain(self, request: web.Request) -> web.Response:
        """Drain (or with `undrain`, undrain) a worker: the agent leaving, or back again."""
        self._authorize(request)
        doc = await read_json(request)
        worker = self.registry.get(get_url(doc, "worker_name"))
        if worker is None:
            return json_response({"exist": False})
        self._owned(request, worker)
        if get_bool(doc, "undrain", False):
            await self.fleet.undrain(worker, "undrained by its agent")
        else:
            self.fleet.drain(worker, "drained by its agent")
        return json_response(_worker_doc(worker))

    async def unregister(self, request: web.Request) -> web.Response:
        """Remove a worker now (its agent is stopping). Requests in flight finish."""
        self._authorize(request)
        doc = await read_json(request)
        url = get_url(doc, "worker_name")
        known = self.registry.get(url)
        if known is not None:
            self._owned(request, known)
        self.heartbeats.pop(url, None)
        worker = self.fleet.remove(url, "unregistered by its agent")
        return json_response({"exist": worker is not None})

    # --- the admin view ----------------------------------------------------------------

    def describe(self, worker: Worker, now: float) -> dict[str, Any]:
        """Heartbeat fields for the admin API's worker list."""
        beat = self.heartbeats.get(worker.url)
        if beat is None:
            return {}
        return {
            "heartbeat_age_seconds": round(now - beat.at, 3),
            "heartbeat_checked": beat.check,
            "reported_queue_length": beat.queue_length,
        }

    # --- heartbeat expiry --------------------------------------------------------------

    def expire(self, now: float | None = None) -> list[str]:
        """Remove workers whose heartbeats stopped; return their URLs."""
        now = time.monotonic() if now is None else now
        limit = self.config.heartbeat_expiry
        removed = []
        for url, beat in list(self.heartbeats.items()):
            worker = self.registry.get(url)
            if worker is None:
                del self.heartbeats[url]
            elif worker.source is not Source.REGISTERED:
                beat.check = False  # the URL has another owner now: never expire it
            elif beat.check and now - beat.at > limit:
                del self.heartbeats[url]
                # Capacity lost without anyone asking: a WARNING, unlike a removal on request.
                log.warning("worker heartbeat expired", worker=url, expiry_seconds=limit)
                self.fleet.remove(url, f"no heartbeat for {limit:g} s")
                self.expired += 1
                removed.append(url)
        return removed

    def _expiry_pause(self) -> float:
        # A few looks per expiry period (bounded to 50 ms .. 5 s), so a worker is removed
        # at most a quarter period late.
        return max(0.05, min(self.config.heartbeat_expiry / 4, 5.0))

    async def start(self) -> None:
        if self.config.enabled:
            self._expiry.start()

    def configure(self, config: GatewayConfig) -> list[str]:
        """[registration] is read at start only (reload.RESTART_ONLY says so)."""
        return []

    async def stop(self) -> None:
        await self._expiry.stop()


def loopback_only(config: RegistrationConfig, host: str) -> bool:
    """Must registrations come from loopback clients? Yes without a token while the gateway
    listens beyond loopback on `host`, unless the config explicitly opens registration."""
    return not config.token and not config.open_without_token and not is_loopback(host)


def warn_if_open(config: RegistrationConfig, host: str) -> None:
    """Say at start how registration without a token is limited (or not) beyond loopback."""
    if loopback_only(config, host):
        log.warning(
            "registration accepts loopback clients only: no registration.token while the "
            "gateway listens beyond loopback; set registration.token "
            "(VLLM_GATEWAY_REGISTRATION_TOKEN), or registration.open_without_token = true",
            host=host,
        )
    elif not config.token and not is_loopback(host):
        log.warning(
            "registration needs no token while the gateway listens beyond loopback: "
            "anyone who reaches it may register a worker inside the allowed networks; "
            "set registration.token (VLLM_GATEWAY_REGISTRATION_TOKEN)",
            host=host,
            allowed_networks=list(config.allowed_networks),
        )


def _queue_length(status: dict[str, Any]) -> float | None:
    value = status.get("queue_length")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _worker_doc(worker: Worker) -> dict[str, Any]:
    return {
        "exist": worker.state is not WorkerState.REMOVED,
        "state": worker.state.value,
        "inflight": worker.inflight,
    }

"""create_app(config): the one place where the gateway's objects are built and wired.

Everything with a lifetime (the connection pool, the probes, the scrapes) starts and stops
through `cleanup_ctx`, in order, so a test can build a whole gateway, run it on port 0 and stop it
without leaving a task or a socket behind.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from vllm_gateway.config.gateway import AutoscaleConfig, GatewayConfig
from vllm_gateway.config.load import normalize_url
from vllm_gateway.control.admin import AdminApi
from vllm_gateway.control.registration import Registration
from vllm_gateway.dispatch.aliases import AliasTable, check_alias
from vllm_gateway.dispatch.dispatcher import Dispatcher, Lease
from vllm_gateway.dispatch.policies import Policy, check_policy_name, make_policy
from vllm_gateway.errors import ConfigError
from vllm_gateway.fleet.autoscale import Autoscaler, admission_view
from vllm_gateway.fleet.breaker import CircuitBreaker
from vllm_gateway.fleet.discovery.dns import DnsDiscovery
from vllm_gateway.fleet.health import Prober
from vllm_gateway.fleet.operations import Fleet
from vllm_gateway.fleet.scrape import Scraper
from vllm_gateway.http.front import FRONT, Front
from vllm_gateway.http.keys import ClientKeys
from vllm_gateway.http.routes import ERROR_HOOKS, ErrorHook, Routes, error_middleware
from vllm_gateway.log import get_logger
from vllm_gateway.observe.access_log import AccessLog
from vllm_gateway.observe.status import StatusViews
from vllm_gateway.observe.telemetry import ReloadCounters, RequestMetrics
from vllm_gateway.process.siblings import Siblings
from vllm_gateway.proxy.pool import UpstreamPool
from vllm_gateway.proxy.relay import Relay
from vllm_gateway.workers import WorkerRegistry, WorkerState

# Typed keys to the parts tests and tools reach for (`app[GATEWAY]` below holds the rest).
REGISTRY = web.AppKey("registry", WorkerRegistry)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
ALIASES = web.AppKey("aliases", AliasTable)
REGISTRATION = web.AppKey("registration", Registration)
AUTOSCALER = web.AppKey("autoscaler", Autoscaler)
DISCOVERY = web.AppKey("discovery", DnsDiscovery)

log = get_logger("vllm_gateway.app")


@dataclass
class Gateway:
    """The running gateway's parts, and the configuration they follow now."""

    config: GatewayConfig
    registry: WorkerRegistry
    dispatcher: Dispatcher
    relay: Relay
    prober: Prober
    scraper: Scraper
    routes: Routes
    fleet: Fleet
    breaker: CircuitBreaker
    aliases: AliasTable
    admin: AdminApi
    metrics: RequestMetrics
    reloads: ReloadCounters
    status: StatusViews
    autoscaler: Autoscaler
    discovery: DnsDiscovery
    keys: ClientKeys | None = None  # client API keys (auth.py)
    access_log: AccessLog | None = None
    # routes.ERROR_HOOKS of this app: called for each error the gateway answers itself.
    error_hooks: list[ErrorHook] = field(default_factory=list)
    # Workers dropped from the config that still had requests in flight: draining, and
    # removed from the registry when their last request ends.
    retiring: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.follow_autoscale(self.config.autoscale)

    def follow_autoscale(self, config: AutoscaleConfig) -> None:
        """Apply autoscale settings: the autoscaler's, and the models whose requests wait
        for a worker to start (`min_workers = 0`: scale from zero) in the dispatcher."""
        self.autoscaler.config = config
        self.dispatcher.scales_from_zero = config.scaled_from_zero()

    def retire_when_idle(self, lease: Lease) -> None:
        """`on_release` hook: remove a retiring worker once its last request ended."""
        worker = lease.worker
        if (
            worker.state is WorkerState.DRAINING
            and not worker.inflight
            and worker.url in self.retiring
        ):
            self.retiring.discard(worker.url)
            self.fleet.remove(worker.url, "removed from the configuration")

    def set_access_log(self, on: bool) -> None:
        """Switch the access log on or off (a new one follows the current log format)."""
        hooks = self.dispatcher.on_release
        if self.access_log is not None:
            hooks.remove(self.access_log.lease_done)
            self.error_hooks.remove(self.access_log.error)
            self.access_log = None
        if on:
            self.access_log = AccessLog()
            hooks.append(self.access_log.lease_done)
            self.error_hooks.append(self.access_log.error)


GATEWAY = web.AppKey("gateway", Gateway)


def check_app_config(config: GatewayConfig) -> None:
    """Checks that need more than config.py knows (policy names); raise ConfigError."""
    problems = []
    if problem := check_policy_name(config.policy):
        problems.append(f"policy: {problem}")
    for model, settings in config.models.items():
        if settings.policy and (problem := check_policy_name(settings.policy)):
            problems.append(f'models."{model}".policy: {problem}')
    for name, targets in config.aliases.items():
        if problem := check_alias(name, targets):
            problems.append(f"aliases.{name}: {problem}")
    problems.extend(check_scale_rules(config))
    if problems:
        raise ConfigError(problems)


def policies_for(config: GatewayConfig, rng: random.Random) -> tuple[Policy, dict[str, Policy]]:
    """The default policy and the per-model ones, as `config` names them."""
    per_model = {
        model: make_policy(settings.policy, rng, config.dispatch)
        for model, settings in config.models.items()
        if settings.policy
    }
    return make_policy(config.policy, rng, config.dispatch), per_model


def create_app(
    config: GatewayConfig,
    *,
    rng: random.Random | None = None,
    process_index: int = 0,
    process_count: int = 1,
    control_dir: str | None = None,
) -> web.Application:
    """Build the gateway application for `config` (already validated by load_config).

    `process_index` of `process_count`: which of the `serve --processes N` processes this
    is; with more than one, `control_dir` holds the processes' unix sockets (siblings.py).
    Background jobs that must run once per host (autoscaler commands) run in process 0.
    """
    check_app_config(config)
    rng = rng or random.Random()
    registry = WorkerRegistry()
    for spec in config.workers:
        registry.add(normalize_url(spec.url), models=spec.models, weight=spec.weight)
    policy, per_model = policies_for(config, rng)
    dispatcher = Dispatcher(
        registry,
        policy,
        policy_for_model=per_model,
        retry=config.retry,
        config=config.dispatch,
        processes=process_count,
        rng=rng,
    )
    pool = UpstreamPool(config.timeouts.connect)
    worker_key = config.auth.worker_api_key or None  # vLLM --api-key of the workers
    relay = Relay(
        pool,
        config.timeouts,
        forward_authorization=config.auth.forward_authorization,
        worker_api_key=worker_key,
    )
    prober = Prober(registry, pool, config.probe, api_key=worker_key)
    scraper = Scraper(registry, pool, config.scrape, api_key=worker_key)
    keys = ClientKeys(config.auth)
    breaker = CircuitBreaker(registry, config.breaker)
    dispatcher.on_release.append(breaker.on_release)
    fleet = Fleet(registry, prober, breaker)
    aliases = AliasTable(registry, config.aliases, rng)
    registration = Registration(fleet, dispatcher, aliases, config.registration)
    autoscaler = Autoscaler(
        registry,
        config.autoscale,
        process_index=process_index,
        queued=admission_view(dispatcher.admission),
    )
    discovery = DnsDiscovery(fleet, config.discovery)
    admin = AdminApi(
        fleet,
        aliases,
        config.admin.token,
        config.admin.drain_timeout,
        describers=[registration.describe],
        scale_view=autoscaler.view,
    )
    metrics = RequestMetrics()
    reloads = ReloadCounters()
    routes = Routes(
        registry,
        dispatcher,
        relay,
        config.max_body_bytes,
        aliases,
        body_timeout=config.client.body_timeout,
    )
    status = StatusViews(config, metrics, registry, dispatcher, scraper, reloads, time.time())
    status.autoscaler, status.registration = autoscaler, registration

    siblings = None
    middlewares = [error_middleware, keys.middleware]
    if process_count > 1:
        assert control_dir is not None, "several processes need a control_dir"
        siblings = Siblings(process_index, process_count, control_dir)
        middlewares.insert(0, siblings.middleware())
    app = web.Application(
        middlewares=middlewares,
        # aiohttp enforces this on bodies without Content-Length; routes check the header.
        client_max_size=config.max_body_bytes,
    )
    gateway = Gateway(
        config,
        registry,
        dispatcher,
        relay,
        prober,
        scraper,
        routes,
        fleet,
        breaker,
        aliases,
        admin,
        metrics,
        reloads,
        status,
        autoscaler,
        discovery,
        keys=keys,
    )
    app[REGISTRY] = registry
    app[DISPATCHER] = dispatcher
    app[ALIASES] = aliases
    app[REGISTRATION] = registration
    app[AUTOSCALER] = autoscaler
    app[DISCOVERY] = discovery
    app[GATEWAY] = gateway
    app[ERROR_HOOKS] = gateway.error_hooks
    if config.client.front_path:  # relay requests served without aiohttp (front.py)
        app[FRONT] = Front(routes, keys, gateway.error_hooks)
    routes.add_to(app)
    status.add_to(app, metrics=config.telemetry.metrics, page=config.telemetry.status_page)
    dispatcher.on_release.extend([metrics.observe, gateway.retire_when_idle])
    gateway.error_hooks.append(metrics.observe_error)
    gateway.set_access_log(config.log.access_log)
    if config.registration.enabled:
        registration.add_to(app)
    app.add_subapp("/admin/", admin.app())

    async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
        await pool.open()
        yield
        await pool.close()

    async def prober_ctx(app: web.Application) -> AsyncIterator[None]:
        await prober.start()
        yield
        await prober.stop()

    async def scraper_ctx(app: web.Application) -> AsyncIterator[None]:
        await scraper.start()
        yield
        await scraper.stop()

    async def fleet_ctx(app: web.Application) -> AsyncIterator[None]:
        if config.registration.enabled:
            if process_index == 0:
                _warn_if_registration_open(config)
            await registration.start()
        await discovery.start()
        await autoscaler.start()
        yield
        await autoscaler.stop()
        await discovery.stop()
        await registration.stop()
        breaker.stop()

    app.cleanup_ctx.extend([upstream_ctx, prober_ctx, scraper_ctx, fleet_ctx])
    if siblings is not None:
        status.process, status.siblings = process_index, siblings

        async def siblings_ctx(app: web.Application) -> AsyncIterator[None]:
            await siblings.open()
            yield
            await siblings.close()

        app.cleanup_ctx.append(siblings_ctx)
    return app


def check_scale_rules(config: GatewayConfig) -> list[str]:
    """Autoscale rules whose bounds or commands cannot work."""
    problems = []
    for model, rule in config.autoscale.models.items():
        where = f'autoscale.models."{model}"'
        if rule.max_workers < rule.min_workers:
            problems.append(f"{where}: max_workers is below min_workers")
        for key in ("scale_up_command", "scale_down_command"):
            try:
                getattr(rule, key).format(model=model, index=1, count=1)
            except (KeyError, IndexError, ValueError) as e:
                problems.append(
                    f"{where}.{key}: {e!r}; the placeholders are {{model}} {{index}} {{count}}"
                )
    return problems


def _warn_if_registration_open(config: GatewayConfig) -> None:
    """Registration without a token is fine on loopback, and worth a warning elsewhere."""
    if not config.registration.token and config.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "registration needs no token while the gateway listens beyond loopback: "
            "anyone who reaches it may register a worker inside the allowed networks; "
            "set registration.token (VLLM_GATEWAY_REGISTRATION_TOKEN)",
            host=config.host,
            allowed_networks=list(config.registration.allowed_networks),
        )

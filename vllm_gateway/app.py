"""create_app(config): the one place where the gateway's objects are built and wired;
apply_config(app, new): the one place a running app is made to follow a reloaded config.

Everything with a lifetime (the connection pool, the probes, the scrapes) starts and stops
through `cleanup_ctx`, in order, so a test can build a whole gateway, run it on port 0 and stop it
without leaving a task or a socket behind.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aiohttp import web

from vllm_gateway import log as logging_setup
from vllm_gateway.access_log import AccessLog
from vllm_gateway.admin import AdminApi
from vllm_gateway.aliases import AliasTable, check_alias
from vllm_gateway.auth import ClientKeys
from vllm_gateway.autoscale import Autoscaler, admission_view
from vllm_gateway.breaker import CircuitBreaker
from vllm_gateway.config import GatewayConfig, normalize_url
from vllm_gateway.discovery import DnsDiscovery
from vllm_gateway.dispatch import Dispatcher, Lease
from vllm_gateway.errors import ConfigError, GatewayError
from vllm_gateway.fleet import Fleet
from vllm_gateway.health import Prober
from vllm_gateway.log import get_logger
from vllm_gateway.policies import Policy, check_policy_name, make_policy
from vllm_gateway.registration import Registration
from vllm_gateway.relay import Relay
from vllm_gateway.routes import ERROR_HOOKS, Routes, error_middleware
from vllm_gateway.scrape import MetricNames, Scraper
from vllm_gateway.siblings import Siblings
from vllm_gateway.status import StatusViews
from vllm_gateway.telemetry import ReloadCounters, RequestMetrics
from vllm_gateway.upstream import UpstreamPool
from vllm_gateway.workers import WorkerRegistry, WorkerState

# The configuration the app was built with. A reload changes `app[GATEWAY].config`.
CONFIG = web.AppKey("config", GatewayConfig)
REGISTRY = web.AppKey("registry", WorkerRegistry)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
PROBER = web.AppKey("prober", Prober)
SCRAPER = web.AppKey("scraper", Scraper)
PROCESS_INDEX = web.AppKey("process_index", int)
SIBLINGS = web.AppKey("siblings", Siblings)
BREAKER = web.AppKey("breaker", CircuitBreaker)
FLEET = web.AppKey("fleet", Fleet)
ALIASES = web.AppKey("aliases", AliasTable)
REGISTRATION = web.AppKey("registration", Registration)
AUTOSCALER = web.AppKey("autoscaler", Autoscaler)
DISCOVERY = web.AppKey("discovery", DnsDiscovery)

log = get_logger("vllm_gateway.app")

# Settings a running app cannot change: a reload reports them as waiting for a restart.
RESTART_ONLY = (
    "host",
    "port",
    "processes",
    "max_body_bytes",
    "timeouts.connect",
    "client.header_timeout",
    "client.max_header_bytes",
    "client.max_headers",
    "auth.forward_authorization",
    "auth.worker_api_key",
    "registration",
    "telemetry.metrics",
    "telemetry.status_page",
)
# Where each worker came from. A reload owns the "static" ones (the config file's) only;
# registered, admin-added and DNS-discovered workers have their own owners.
CONFIG_SOURCES = frozenset({"static"})


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
    error_hooks: list[Callable[[web.Request, GatewayError], None]] = field(default_factory=list)
    # Workers dropped from the config that still had requests in flight: draining, and
    # removed from the registry when their last request ends.
    retiring: set[str] = field(default_factory=set)

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


def _policies(config: GatewayConfig, rng: random.Random) -> tuple[Policy, dict[str, Policy]]:
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
    policy, per_model = _policies(config, rng)
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
    app[CONFIG] = config
    app[REGISTRY] = registry
    app[DISPATCHER] = dispatcher
    app[PROBER] = prober
    app[SCRAPER] = scraper
    app[PROCESS_INDEX] = process_index
    app[BREAKER] = breaker
    app[FLEET] = fleet
    app[ALIASES] = aliases
    app[REGISTRATION] = registration
    app[AUTOSCALER] = autoscaler
    app[DISCOVERY] = discovery
    app[GATEWAY] = gateway
    app[ERROR_HOOKS] = gateway.error_hooks
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
        app[SIBLINGS] = siblings
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


def apply_config(app: web.Application, new: GatewayConfig) -> list[str]:
    """Make a running app follow `new` (validated by load_config); return what changed.

    Raises ConfigError, having changed nothing, when `new` fails the app's own checks.
    In-flight requests are untouched: a worker dropped from the config drains (no new
    requests) and leaves the registry when its last request ends; a new policy or new
    timeouts apply to requests dispatched from now on.
    """
    check_app_config(new)
    g = app[GATEWAY]
    old = g.config
    changes = _apply_workers(g, new)
    if (new.policy, new.dispatch, new.models) != (old.policy, old.dispatch, old.models):
        g.dispatcher.policy, g.dispatcher.policy_for_model = _policies(new, g.dispatcher.rng)
        g.dispatcher.configure(new.dispatch)
        if new.policy != old.policy:
            changes.append(f"policy: {old.policy} -> {new.policy}")
        if (new.dispatch, new.models) != (old.dispatch, old.models):
            changes.append("dispatch settings or per-model policies changed")
    if new.retry != old.retry:
        g.dispatcher.retry = new.retry
        changes.append("retry settings changed")
    if new.timeouts != old.timeouts:
        g.relay.timeouts = new.timeouts
        changes.append("timeouts changed")
    if new.probe != old.probe:
        g.prober.config = new.probe
        changes.append("probe settings changed")
    if new.scrape != old.scrape:
        g.scraper.config = new.scrape
        g.scraper.names = MetricNames.from_config(new.scrape)
        changes.append("scrape settings changed")
    if new.log != old.log:
        if (new.log.format, new.log.level) != (old.log.format, old.log.level):
            logging_setup.configure(new.log.format, new.log.level)
        g.set_access_log(new.log.access_log)
        changes.append(
            f"log: format {new.log.format}, level {new.log.level}, "
            f"access log {'on' if new.log.access_log else 'off'}"
        )
    if new.breaker != old.breaker:
        g.breaker.config = new.breaker
        changes.append("breaker settings changed")
    if new.aliases != old.aliases:
        g.aliases.load_config(new.aliases)
        changes.append("aliases changed")
    if new.admin != old.admin:
        g.admin.token = new.admin.token
        g.admin.drain_timeout = new.admin.drain_timeout
        changes.append("admin settings changed")
    if new.auth.keys != old.auth.keys:
        assert g.keys is not None
        g.keys.load(new.auth.keys)
        changes.append(f"client API keys: {len(new.auth.keys)} configured")
    if new.client.body_timeout != old.client.body_timeout:
        g.routes.body_timeout = new.client.body_timeout
        changes.append(f"client.body_timeout: {new.client.body_timeout:g} s")
    if new.autoscale != old.autoscale:
        g.autoscaler.config = new.autoscale
        changes.append("autoscale settings changed")
    if new.discovery != old.discovery:
        g.discovery.configure(new.discovery)
        changes.append("discovery settings changed")
    if new.lifecycle != old.lifecycle:
        changes.append("lifecycle settings changed")  # read when the next stop begins
    for key in RESTART_ONLY:
        if _get(old, key) != _get(new, key):
            changes.append(f"{key}: {_shown(new, key)} takes effect at the next restart")
    g.config = g.status.config = new
    return changes


def _apply_workers(g: Gateway, new: GatewayConfig) -> list[str]:
    """Add, reconfigure and retire the config's own (static) workers."""
    registry = g.registry
    wanted = {normalize_url(spec.url): spec for spec in new.workers}
    changes: list[str] = []
    for worker in registry:
        if worker.source in CONFIG_SOURCES and worker.url not in wanted:
            if worker.inflight:
                g.retiring.add(worker.url)
                g.fleet.drain(worker, "removed from the configuration")
                changes.append(f"worker draining: {worker.url} ({worker.inflight} in flight)")
            else:
                g.fleet.remove(worker.url, "removed from the configuration")
                changes.append(f"worker removed: {worker.url}")
    for url, spec in wanted.items():
        worker = registry.get(url)
        if worker is None:
            registry.add(url, models=spec.models, weight=spec.weight)
            g.prober.forget(url)  # probed by the reload before READY (daemon.py)
            changes.append(f"worker added: {url}")
            continue
        if worker.source not in CONFIG_SOURCES:
            continue  # known from elsewhere (registered, admin): its owner decides
        if url in g.retiring:  # dropped by an earlier reload, listed again: take it back
            g.retiring.discard(url)
            registry.set_state(worker, WorkerState.JOINING, "back in the configuration")
            g.breaker.reset(worker, "back in the configuration")
            changes.append(f"worker back: {url}")
        if registry.reconfigure(worker, models=spec.models, weight=spec.weight):
            changes.append(f"worker reconfigured: {url}")
    return changes


def _get(config: object, dotted: str) -> object:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _shown(config: object, dotted: str) -> str:
    """A setting's new value for the reload log: never a secret, nor a whole section (which
    may hold one, e.g. registration.token)."""
    parent, _, name = dotted.rpartition(".")
    owner = _get(config, parent) if parent else config
    field = next(f for f in dataclasses.fields(owner) if f.name == name)  # type: ignore[arg-type]
    value = getattr(owner, name)
    if field.metadata.get("secret") or dataclasses.is_dataclass(value):
        return "(changed)"
    return repr(value)

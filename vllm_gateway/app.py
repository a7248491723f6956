"""create_app(config): the one place where the gateway's objects are built and wired.

Everything with a lifetime (the connection pool, the probes, the scrapes) starts and stops
through `cleanup_ctx`, in order, so a test can build a whole gateway, run it on port 0 and stop it
without leaving a task or a socket behind.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from hashlib import sha256
from secrets import token_hex

from aiohttp import web

from vllm_gateway import log as logging_setup
from vllm_gateway.config.gateway import (
    AutoscaleConfig,
    DispatchConfig,
    GatewayConfig,
    LogConfig,
    ModelConfig,
    ScrapeConfig,
)
from vllm_gateway.config.section import Configurable, Section
from vllm_gateway.control.admin import AdminApi
from vllm_gateway.control.registration import Registration, warn_if_open
from vllm_gateway.dispatch.aliases import AliasTable, check_alias
from vllm_gateway.dispatch.dispatcher import Dispatcher
from vllm_gateway.dispatch.policies import Policy, check_policy_name, make_policy
from vllm_gateway.errors import ConfigError
from vllm_gateway.fleet.autoscale import Autoscaler, admission_view
from vllm_gateway.fleet.breaker import CircuitBreaker
from vllm_gateway.fleet.discovery import discovery_sources
from vllm_gateway.fleet.health import Prober
from vllm_gateway.fleet.operations import Fleet
from vllm_gateway.fleet.scrape import MetricNames, Scraper
from vllm_gateway.fleet.sources import StaticWorkers, WorkerSource
from vllm_gateway.http.cors import Cors
from vllm_gateway.http.front import FRONT, Front
from vllm_gateway.http.front_reader import FrontLimits
from vllm_gateway.http.gate import GATE, Gate
from vllm_gateway.http.keys import ClientKeys
from vllm_gateway.http.routes import (
    ERROR_HOOKS,
    ErrorHook,
    Routes,
    cors_answer_headers,
    cors_preflight,
)
from vllm_gateway.log import get_logger
from vllm_gateway.observe.access_log import AccessLog
from vllm_gateway.observe.status import StatusViews
from vllm_gateway.observe.telemetry import ReloadCounters, RequestMetrics
from vllm_gateway.process.placement_feed import PlacementFeed
from vllm_gateway.process.placement_sharing import feeds_lifetime, peer_feed, share_placements
from vllm_gateway.process.siblings import Siblings
from vllm_gateway.proxy.pool import UpstreamPool
from vllm_gateway.proxy.relay import Relay
from vllm_gateway.workers import WorkerRegistry

# Typed keys to the parts tests and tools reach for (`app[GATEWAY]` below holds the rest).
REGISTRY = web.AppKey("registry", WorkerRegistry)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
ALIASES = web.AppKey("aliases", AliasTable)
REGISTRATION = web.AppKey("registration", Registration)
AUTOSCALER = web.AppKey("autoscaler", Autoscaler)
# Where workers come from: static config, registration, admin, then each discovery source.
SOURCES = web.AppKey("sources", list[WorkerSource])

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
    autoscaler: Autoscaler
    keys: ClientKeys  # client API keys (http/keys.py)
    status: StatusViews = field(init=False)  # /metrics, /stats, the status page
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    reloads: ReloadCounters = field(default_factory=ReloadCounters)
    access_log: AccessLog | None = None
    # routes.ERROR_HOOKS of this app: called for each error the gateway answers itself.
    error_hooks: list[ErrorHook] = field(default_factory=list)
    # Where workers come from, started in this order and stopped in the reverse one.
    sources: list[WorkerSource] = field(default_factory=list)
    # What follows a reload, in order: `apply_config` calls each one's `configure`.
    followers: list[Configurable] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.follow_autoscale(self.config.autoscale)

    def follow_autoscale(self, config: AutoscaleConfig) -> None:
        """Apply autoscale settings: the autoscaler's, and the models whose requests wait
        for a worker to start (`min_workers = 0`: scale from zero) in the dispatcher."""
        self.autoscaler.config = config
        self.dispatcher.scales_from_zero = config.scaled_from_zero()

    @property
    def registration(self) -> Registration:
        return next(s for s in self.sources if isinstance(s, Registration))

    @property
    def admin(self) -> AdminApi:
        return next(s for s in self.sources if isinstance(s, AdminApi))

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
    if problems := app_config_problems(config):
        raise ConfigError(problems)


def app_config_problems(config: GatewayConfig) -> list[str]:
    """The mistakes only the layers above config/ can see (policy names, aliases, scale
    rules); `load_config(checks=...)` runs them in the same pass as its own."""
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
    return problems


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
    g = build_gateway(config, rng or random.Random(), process_count, process_index)
    # The one function both servers call (answer headers, client keys, the handler, error
    # answers, the hooks): aiohttp's through its middleware, the front path's directly.
    gate = Gate(g.keys, g.error_hooks)
    gate.answer_headers.append(cors_answer_headers(g.routes.cors))
    # CORS preflights are answered inside the gate (errors answered, hooks fired) and
    # before client keys (the gate admits no key for a preflight).
    middlewares = [gate.middleware, cors_preflight(g.routes.cors)]
    siblings, feeds = None, None
    if process_count > 1:
        assert control_dir is not None, "several processes need a control_dir"
        siblings = Siblings(process_index, process_count, control_dir)
        middlewares.insert(0, siblings.middleware())
        g.status.process, g.status.siblings = process_index, siblings
        feeds = partial(PlacementFeed.siblings, process_index, process_count, control_dir)
    peers = None
    if config.replicas.enabled:  # (the processes of one replica share its id)
        # (random per run; a digest of the run's private directory with --processes)
        ident = sha256(control_dir.encode()).hexdigest()[:16] if control_dir else token_hex(8)
        peers = peer_feed(config.replicas, ident, process_count > 1)
    if feeds is not None or peers is not None:
        g.status.feed, g.status.peers = share_placements(g.dispatcher, g.registry, feeds, peers)
    app = web.Application(
        middlewares=middlewares,
        # aiohttp enforces this on bodies without Content-Length; routes check the header.
        client_max_size=config.max_body_bytes,
    )
    app[REGISTRY], app[DISPATCHER], app[ALIASES] = g.registry, g.dispatcher, g.aliases
    app[REGISTRATION], app[AUTOSCALER], app[SOURCES] = g.registration, g.autoscaler, g.sources
    app[GATEWAY], app[ERROR_HOOKS], app[GATE] = g, g.error_hooks, gate
    if config.client.front_path:  # relay requests served without aiohttp (front.py)
        limits = FrontLimits.of(config.client, config.max_body_bytes)
        app[FRONT] = Front(partial(gate.serve, handle=g.routes.relay_exchange), limits)
    g.routes.add_to(app)
    g.status.add_to(app, metrics=config.telemetry.metrics, page=config.telemetry.status_page)
    if config.registration.enabled:
        g.registration.add_to(app)
    app.add_subapp("/admin/", g.admin.app())
    app.cleanup_ctx.extend(_lifetimes(g, process_index == 0))
    if siblings is not None:
        app.cleanup_ctx.append(feeds_lifetime(siblings, g.status.feed))
    if g.status.peers is not None:
        app.cleanup_ctx.append(feeds_lifetime(None, g.status.peers))
    return app


def build_gateway(
    config: GatewayConfig, rng: random.Random, process_count: int = 1, process_index: int = 0
) -> Gateway:
    """Build every part for `config` and wire them together; nothing starts yet."""
    registry = WorkerRegistry()
    policy, per_model = policies_for(config, rng)
    dispatcher = Dispatcher(
        registry,
        policy,
        policy_for_model=per_model,
        retry=config.retry,
        config=config.dispatch,
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
    breaker = CircuitBreaker(registry, config.breaker)
    aliases = AliasTable(registry, config.aliases, rng)
    routes = Routes(
        registry,
        dispatcher,
        relay,
        config.max_body_bytes,
        aliases,
        body_timeout=config.client.body_timeout,
        cors=Cors(config.cors),
        lora_updates=config.auth.lora_updates,
    )
    admission = admission_view(dispatcher.admission)
    autoscaler = Autoscaler(
        registry, config.autoscale, process_index=process_index, queued=admission
    )
    fleet = Fleet(registry, prober, breaker)
    keys = ClientKeys(config.auth)
    parts = (registry, dispatcher, relay, prober, scraper, routes, fleet, breaker, aliases)
    g = Gateway(config, *parts, autoscaler, keys)
    _add_sources(g)
    g.status = StatusViews(config, g.metrics, registry, dispatcher, scraper, g.reloads, time.time())
    g.status.autoscaler, g.status.registration = autoscaler, g.registration
    g.status.prober = prober
    g.followers = [g.sources[0], *_sections(g), *g.sources[1:]]
    dispatcher.on_release.extend([breaker.on_release, g.metrics.observe, fleet.on_release])
    g.error_hooks.append(g.metrics.observe_error)
    g.set_access_log(config.log.access_log)
    return g


def _add_sources(g: Gateway) -> None:
    """Where workers come from: the config file, registration, the admin API, discovery."""
    config = g.config
    registration = Registration(g.fleet, g.dispatcher, g.aliases, config.registration, config.host)
    admin = AdminApi(
        g.fleet,
        g.aliases,
        config.admin.token,
        config.admin.drain_timeout,
        describers=[registration.describe],
        scale_view=g.autoscaler.view,
    )
    g.sources = [StaticWorkers(g.fleet, config), registration, admin]
    g.sources.extend(discovery_sources(g.fleet, config))


def _sections(g: Gateway) -> list[Configurable]:
    """The parts that follow a reload but keep no copy of their section, each adapted."""
    c = g.config  # the sections each part follows now
    return [
        Section(
            c, _policy_section, lambda _, new: _set_policies(g.dispatcher, new), _policies_changed
        ),
        Section(c, lambda c: c.retry, _assign(g.dispatcher, "retry"), "retry settings changed"),
        Section(c, lambda c: c.timeouts, _assign(g.relay, "timeouts"), "timeouts changed"),
        Section(c, lambda c: c.probe, _assign(g.prober, "config"), "probe settings changed"),
        Section(
            c,
            lambda c: c.scrape,
            lambda _, new: _set_scrape(g.scraper, new),
            "scrape settings changed",
        ),
        Section(c, lambda c: c.log, lambda old, new: _set_log(g, old, new), _log_changed),
        Section(c, lambda c: c.breaker, _assign(g.breaker, "config"), "breaker settings changed"),
        Section(
            c, lambda c: c.aliases, lambda _, new: g.aliases.load_config(new), "aliases changed"
        ),
        Section(c, lambda c: c.auth.keys, lambda _, new: g.keys.load(new), _keys_changed),
        Section(
            c,
            lambda c: c.client.body_timeout,
            _assign(g.routes, "body_timeout"),
            _body_timeout_changed,
        ),
        Section(
            c,
            lambda c: c.autoscale,
            lambda _, new: g.follow_autoscale(new),
            "autoscale settings changed",
        ),
        # Read from `Gateway.config` when the next stop begins (daemon.py).
        Section(
            c,
            lambda c: c.auth.lora_updates,
            _assign(g.routes, "lora_updates"),
            lambda old, new: [f"auth.lora_updates: {new}"],
        ),
        Section(c, lambda c: c.lifecycle, lambda old, new: None, "lifecycle settings changed"),
    ]


PolicySection = tuple[str, DispatchConfig, dict[str, ModelConfig]]


def _policy_section(config: GatewayConfig) -> PolicySection:
    return (config.policy, config.dispatch, config.models)


def _set_policies(dispatcher: Dispatcher, section: PolicySection) -> None:
    policy, dispatch, models = section
    config = GatewayConfig(policy=policy, dispatch=dispatch, models=models)
    dispatcher.policy, dispatcher.policy_for_model = policies_for(config, dispatcher.rng)
    dispatcher.configure(dispatch)


def _policies_changed(old: PolicySection, new: PolicySection) -> list[str]:
    changes = [f"policy: {old[0]} -> {new[0]}"] if old[0] != new[0] else []
    if old[1:] != new[1:]:
        changes.append("dispatch settings or per-model policies changed")
    return changes


def _assign(part: object, name: str) -> Callable[[object, object], None]:
    """Follow a section by assigning it to `part.name` (read at each use)."""
    return lambda old, new: setattr(part, name, new)


def _set_scrape(scraper: Scraper, config: ScrapeConfig) -> None:
    scraper.config, scraper.names = config, MetricNames.from_config(config)


def _set_log(g: Gateway, old: LogConfig, new: LogConfig) -> None:
    if (new.format, new.level) != (old.format, old.level):
        logging_setup.configure(new.format, new.level)
    g.set_access_log(new.access_log)


def _log_changed(old: LogConfig, new: LogConfig) -> list[str]:
    access = "on" if new.access_log else "off"
    return [f"log: format {new.format}, level {new.level}, access log {access}"]


def _keys_changed(old: Mapping[str, object], new: Mapping[str, object]) -> list[str]:
    return [f"client API keys: {len(new)} configured"]


def _body_timeout_changed(old: float, new: float) -> list[str]:
    return [f"client.body_timeout: {new:g} s"]


Lifetime = Callable[[web.Application], AsyncIterator[None]]


def _lifetimes(g: Gateway, first_process: bool) -> list[Lifetime]:
    """`cleanup_ctx` pairs: the pool, the probes, the scrapes, then the worker sources
    and the autoscaler; each stops in the reverse order."""

    async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
        await g.relay.pool.open()
        yield
        await g.relay.pool.close()

    async def prober_ctx(app: web.Application) -> AsyncIterator[None]:
        await g.prober.start()
        yield
        await g.prober.stop()

    async def scraper_ctx(app: web.Application) -> AsyncIterator[None]:
        await g.scraper.start()
        yield
        await g.scraper.stop()

    async def fleet_ctx(app: web.Application) -> AsyncIterator[None]:
        if g.config.registration.enabled and first_process:
            warn_if_open(g.config.registration, g.config.host)
        for source in g.sources:
            await source.start()
        await g.autoscaler.start()
        yield
        await g.autoscaler.stop()
        for source in reversed(g.sources):
            await source.stop()
        g.breaker.stop()

    return [upstream_ctx, prober_ctx, scraper_ctx, fleet_ctx]


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

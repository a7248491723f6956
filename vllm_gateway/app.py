"""create_app(config): the one place where the gateway's objects are built and wired.

Everything with a lifetime (the connection pool, the probes, the scrapes) starts and stops through
`cleanup_ctx`, in order, so a test can build a whole gateway, run it on port 0 and stop it
without leaving a task or a socket behind.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

from aiohttp import web

from vllm_gateway.admin import AdminApi
from vllm_gateway.aliases import AliasTable, check_alias
from vllm_gateway.breaker import CircuitBreaker
from vllm_gateway.config import GatewayConfig, normalize_url
from vllm_gateway.dispatch import Dispatcher
from vllm_gateway.errors import ConfigError
from vllm_gateway.fleet import Fleet
from vllm_gateway.health import Prober
from vllm_gateway.log import get_logger
from vllm_gateway.policies import check_policy_name, make_policy
from vllm_gateway.registration import Registration
from vllm_gateway.relay import Relay
from vllm_gateway.routes import Routes, error_middleware
from vllm_gateway.scrape import Scraper
from vllm_gateway.siblings import Siblings
from vllm_gateway.upstream import UpstreamPool
from vllm_gateway.workers import WorkerRegistry

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

log = get_logger("vllm_gateway.app")


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
    if problems:
        raise ConfigError(problems)


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
    per_model = {
        model: make_policy(settings.policy, rng, config.dispatch)
        for model, settings in config.models.items()
        if settings.policy
    }
    dispatcher = Dispatcher(
        registry,
        make_policy(config.policy, rng, config.dispatch),
        policy_for_model=per_model,
        retry=config.retry,
        rng=rng,
    )
    pool = UpstreamPool(config.timeouts.connect)
    relay = Relay(pool, config.timeouts)
    prober = Prober(registry, pool, config.probe)
    scraper = Scraper(registry, pool, config.scrape)
    breaker = CircuitBreaker(registry, config.breaker)
    dispatcher.on_release.append(breaker.on_release)
    fleet = Fleet(registry, prober, breaker)
    aliases = AliasTable(registry, config.aliases, rng)
    registration = Registration(fleet, dispatcher, aliases, config.registration)
    admin = AdminApi(
        fleet,
        aliases,
        config.admin.token,
        config.admin.drain_timeout,
        describers=[registration.describe],
    )

    siblings = None
    middlewares = [error_middleware]
    if process_count > 1:
        assert control_dir is not None, "several processes need a control_dir"
        siblings = Siblings(process_index, process_count, control_dir)
        middlewares.insert(0, siblings.middleware())
    app = web.Application(
        middlewares=middlewares,
        # aiohttp enforces this on bodies without Content-Length; routes check the header.
        client_max_size=config.max_body_bytes,
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
    Routes(registry, dispatcher, relay, config.max_body_bytes, aliases).add_to(app)
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
        yield
        await registration.stop()
        breaker.stop()

    app.cleanup_ctx.extend([upstream_ctx, prober_ctx, scraper_ctx, fleet_ctx])
    if siblings is not None:
        app[SIBLINGS] = siblings

        async def siblings_ctx(app: web.Application) -> AsyncIterator[None]:
            await siblings.open()
            yield
            await siblings.close()

        app.cleanup_ctx.append(siblings_ctx)
    return app


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

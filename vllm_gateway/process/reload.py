"""apply_config(app, new): the one place a running gateway is made to follow a reloaded config.

Called by the daemon on SIGHUP with a configuration `load_config` validated. It changes the
running objects `create_app` built (the `Gateway` holder) in place and returns what changed,
one line each, for the log. In-flight requests are never touched: the config file's
workers (source "static") are added, re-pinned or re-weighted, or drained and removed once
idle; policies, retry, timeouts, probes, scrapes, breaker, aliases, keys and log settings
apply to requests dispatched from then on. The settings in `RESTART_ONLY` are read at start
only; a reload that changes them says so.
"""

from __future__ import annotations

import dataclasses

from aiohttp import web

from vllm_gateway import log as logging_setup
from vllm_gateway.app import GATEWAY, Gateway, check_app_config, policies_for
from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.config.load import normalize_url
from vllm_gateway.fleet.scrape import MetricNames
from vllm_gateway.workers import WorkerState

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
    "client.front_path",
    "auth.forward_authorization",
    "auth.worker_api_key",
    "registration",
    "telemetry.metrics",
    "telemetry.status_page",
)
# Where each worker came from. A reload owns the "static" ones (the config file's) only;
# registered, admin-added and DNS-discovered workers have their own owners.
CONFIG_SOURCES = frozenset({"static"})


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
        g.dispatcher.policy, g.dispatcher.policy_for_model = policies_for(new, g.dispatcher.rng)
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
        g.follow_autoscale(new.autoscale)
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
        known = registry.get(url)
        if known is None:
            registry.add(url, models=spec.models, weight=spec.weight)
            g.prober.forget(url)  # probed by the reload before READY (daemon.py)
            changes.append(f"worker added: {url}")
            continue
        worker = known
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

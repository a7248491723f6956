"""apply_config(app, new): the one place a running gateway is made to follow a reloaded config.

Called by the daemon on SIGHUP with a configuration `load_config` validated. Each running
part takes its own section (`configure(config)`, config/section.py) and says what changed,
one line each, for the log: the worker sources first (fleet/sources.py: the config file's
workers are added, re-pinned or re-weighted, or retired; registered, admin-added and
discovered workers stay with their owners), then dispatch, retry, timeouts, probes,
scrapes, log, breaker, aliases, client keys, admin, autoscale and discovery. In-flight
requests are never touched: the new settings apply to requests dispatched from then on.
The settings in `RESTART_ONLY` are read at start only; a reload that changes them says so.
First of all, a reload that would remove the last static worker and discovery table, the
last client key or the admin token is refused unless the new file's `[reload]` section
allows it (`check_reload`).
"""

from __future__ import annotations

import dataclasses

from aiohttp import web

from vllm_gateway.app import GATEWAY, check_app_config
from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.errors import ConfigError

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
    "client.max_head_bytes",
    "client.max_connections",
    "client.front_path",
    "cors",
    "auth.forward_authorization",
    "auth.worker_api_key",
    "registration",
    "replicas",
    "telemetry.metrics",
    "telemetry.status_page",
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
    if problems := check_reload(old, new):
        raise ConfigError(problems)
    changes = [line for part in g.followers for line in part.configure(new)]
    for key in RESTART_ONLY:
        if _get(old, key) != _get(new, key):
            changes.append(f"{key}: {_shown(new, key)} takes effect at the next restart")
    g.config = g.status.config = new
    return changes


def check_reload(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """What `new` would take away that it does not say it means to (the `[reload]` section):
    every static worker and discovery table, the last client key, the admin API. A
    truncated file is valid TOML, and applied it would empty the fleet and open the API."""
    problems = []
    if _worker_sources(old) and not _worker_sources(new) and not new.reload.allow_no_workers:
        problems.append(
            "workers: the new configuration lists no worker and no discovery table, where "
            f"the running one has {_worker_sources(old)}; "
            "set reload.allow_no_workers = true if that is meant"
        )
    if old.auth.keys and not new.auth.keys and not new.reload.allow_no_keys:
        problems.append(
            "auth.keys: the new configuration has no client key, which opens the API to "
            "everyone; set reload.allow_no_keys = true if that is meant"
        )
    if old.admin.token and not new.admin.token and not new.reload.allow_no_admin:
        problems.append(
            "admin.token: the new configuration has none, which turns the admin API off; "
            "set reload.allow_no_admin = true if that is meant"
        )
    return problems


def _worker_sources(config: GatewayConfig) -> int:
    """The config file's sources of workers: static workers and discovery tables (each
    discovered fleet leaves too when its table goes)."""
    discovery = config.discovery
    return len(config.workers) + len(discovery.dns) + len(discovery.kubernetes)


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

"""Loading the gateway's settings: TOML < env < flags, then validation; one ConfigError for all.

Naming: a top-level key `port` is `VLLM_GATEWAY_PORT`; a key `format` in section `[log]` is
`VLLM_GATEWAY_LOG_FORMAT`. Lists (e.g. `VLLM_GATEWAY_WORKERS`) are comma-separated.
`load_config` collects every mistake and raises one `ConfigError` listing them all.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from vllm_gateway.config import settings
from vllm_gateway.config.fleet import check_discovery
from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.config.replicas import check_replicas
from vllm_gateway.errors import ConfigError

ENV_PREFIX = "VLLM_GATEWAY_"


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    checks: Callable[[GatewayConfig], list[str]] | None = None,
) -> GatewayConfig:
    """Build and validate the configuration; raise `ConfigError` listing every mistake.

    `overrides` is a nested mapping like the TOML file's (e.g. {"log": {"format": "json"}});
    keys whose value is None are ignored, so click options can default to None. `checks`
    adds the checks layers above know (policy names, aliases: app.app_config_problems).
    Every check runs in one pass, a value that could not be read standing at its default,
    so a file with five mistakes is told all five at once.
    """
    errors: list[str] = []
    env = os.environ if env is None else env
    if path is None and env.get(ENV_PREFIX + "CONFIG"):
        path = env[ENV_PREFIX + "CONFIG"]
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except OSError as e:
            raise ConfigError([f"config file {path}: {e.strerror or e}"]) from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([f"config file {path}: not valid TOML: {e}"]) from e
    settings.merge(raw, settings.from_env(GatewayConfig, env, ENV_PREFIX, errors))
    settings.merge(raw, settings.drop_none(overrides or {}))
    config = settings.build(GatewayConfig, raw, "", errors)
    errors.extend(validate(config))
    if checks is not None:
        errors.extend(checks(config))
    if errors:
        raise ConfigError(errors)
    return config


def validate(config: GatewayConfig) -> list[str]:
    """Check values against their declared bounds and each other; return the mistakes."""
    errors: list[str] = []
    settings.check_bounds(config, "", errors)
    seen: set[str] = set()
    for i, worker in enumerate(config.workers):
        where = f"workers[{i}]"
        problem = check_worker_url(worker.url)
        url = normalize_url(worker.url)
        if problem:
            errors.append(f"{where}.url: {problem}")
        elif url in seen:
            errors.append(f"{where}.url: {worker.url} is listed twice")
        seen.add(url)
        for model in worker.models:
            problem = check_model_name(model)
            if problem:
                errors.append(f"{where}.models: {problem}")
    for i, dns in enumerate(config.discovery.dns):
        if problem := check_worker_url(dns.url):
            errors.append(f"discovery.dns[{i}].url: {problem}")
    for key in ("running_metrics", "waiting_metrics"):
        if not getattr(config.scrape, key):
            errors.append(f"scrape.{key}: name at least one metric")
    if not config.host or any(c in config.host for c in "/ "):
        errors.append(f"host: {config.host!r} is not an address or host name")
    for name, api_key in config.auth.keys.items():
        digest = api_key.sha256
        if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
            errors.append(
                f"auth.keys.{name}.sha256: expected 64 hex digits "
                "(`vllm-gateway hash-key` prints them)"
            )
    for i, net in enumerate(config.registration.allowed_networks):
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError:
            errors.append(f"registration.allowed_networks[{i}]: {net!r} is not a network (CIDR)")
    errors.extend(check_discovery(config.discovery))
    errors.extend(check_replicas(config.replicas))
    if config.processes > 1 and config.replicas.listen.strip().endswith(":0"):
        errors.append(
            "replicas.listen: port 0 picks a port per process; with processes > 1 give "
            "one port (the processes share it)"
        )
    return errors


def normalize_url(url: str) -> str:
    """The one spelling of a worker URL used as its identity: no trailing slash, and no
    trailing `/v1` (see `worker_url_note`)."""
    url = url.strip().rstrip("/")
    if urlsplit(url).path == "/v1":
        url = url[: -len("/v1")]
    return url


def worker_url_note(url: str) -> str | None:
    """Why `url` was respelled by `normalize_url`, for a warning; None when it was not.

    A trailing `/v1` is dropped rather than refused: it is an OpenAI base URL copied as is,
    and has one reading only (vLLM serves its OpenAI API under /v1 at its root, and the
    gateway needs that root for /health, /metrics and /v1/models). Kept, every request
    would be a 404 "no worker serves the model" with the cause nowhere in sight.
    """
    if urlsplit(url.strip().rstrip("/")).path == "/v1":
        return (
            f"{url.strip()!r}: the trailing /v1 was dropped; a worker URL is the vLLM server's "
            f"base ({normalize_url(url)}), the gateway adds /v1/... itself"
        )
    return None


def check_worker_url(url: str) -> str | None:
    """Return why `url` is not a usable worker base URL, or None when it is (a trailing
    `/v1` is usable: `normalize_url` drops it)."""
    url = url.strip()
    if not url:
        return "is empty"
    if "://" not in url:
        return f"{url!r} has no scheme: add http:// (http://{url})"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"{url!r} must start with http:// or https://"
    if not parts.hostname:
        return f"{url!r} has no host"
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return f"{url!r} has an invalid port"
    if parts.query or parts.fragment:
        return f"{url!r} must be a base URL without query or fragment"
    if parts.path.rstrip("/") not in ("", "/v1"):
        # The relay sends the client's path to the worker's host and port: a path prefix
        # here would be dropped silently, so a worker behind one cannot be served.
        return (
            f"{url!r} has a path ({parts.path}); give the vLLM server's base URL, "
            f"e.g. {parts.scheme}://{parts.netloc}: the gateway adds /v1/... itself"
        )
    return None


def check_model_name(name: str) -> str | None:
    """Return why `name` cannot be a model name, or None. Rejects what could break a path or
    a header line when echoed back."""
    if not name:
        return "model name is empty"
    if len(name) > 512:
        return "model name is longer than 512 characters"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return f"model name {name!r} contains control characters"
    return None


def describe() -> list[tuple[str, ...]]:
    """Every setting as (key, type, default, unit, cli, env, help) rows for the docs."""
    return settings.describe(GatewayConfig, ENV_PREFIX)


def effective_toml(config: GatewayConfig) -> str:
    """The configuration as a TOML document, secrets masked (for `check-config`)."""
    return settings.to_toml(config)

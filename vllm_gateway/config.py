"""The gateway's settings: frozen dataclasses, loaded once from defaults, TOML, env and CLI.

Precedence, lowest first: the defaults written here, the TOML file (`--config`), environment
variables (`VLLM_GATEWAY_*`), then command-line options. Every key is declared once, below,
with its default, unit and help text; the loader, the validator and the generated
configuration reference (docs/configuration.md) all read those declarations, so they cannot
drift apart.

Naming: a top-level key `port` is `VLLM_GATEWAY_PORT`; a key `format` in section `[log]` is
`VLLM_GATEWAY_LOG_FORMAT`. Lists (e.g. `VLLM_GATEWAY_WORKERS`) are comma-separated.
`load_config` collects every mistake and raises one `ConfigError` listing them all.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from vllm_gateway.errors import ConfigError

ENV_PREFIX = "VLLM_GATEWAY_"


def setting(
    default: Any,
    help: str,
    *,
    unit: str = "",
    choices: tuple[str, ...] = (),
    minimum: float | None = None,
    maximum: float | None = None,
    cli: str = "",
    secret: bool = False,
) -> Any:
    """Declare one setting: its default and everything the docs and validator need."""
    meta = {
        "help": help,
        "unit": unit,
        "choices": choices,
        "minimum": minimum,
        "maximum": maximum,
        "cli": cli,
        "secret": secret,
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# --- sections -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A worker named in the config file (or by `--worker`)."""

    url: str = setting("", "Base URL of the worker's OpenAI server, e.g. http://10.0.0.5:8000.")
    models: tuple[str, ...] = setting(
        (),
        "Model names pinned for this worker. Empty: learned from its /v1/models.",
    )
    weight: float = setting(1.0, "Relative share of traffic for weighted policies.", minimum=0.0)


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Structured logging."""

    format: str = setting(
        "auto",
        "Log line format: json, console, or auto (console on a TTY, JSON lines otherwise).",
        choices=("auto", "json", "console"),
        cli="--log-format",
    )
    level: str = setting(
        "info",
        "Lowest level logged.",
        choices=("debug", "info", "warning", "error"),
        cli="--log-level",
    )
    access_log: bool = setting(
        False,
        "Log one JSON line per finished request (request_id, model, worker, status, timings).",
        cli="--access-log",
    )


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    """Limits on one relay attempt against a worker. 0 disables a limit."""

    connect: float = setting(
        5.0, "Opening a TCP connection to a worker.", unit="seconds", minimum=0.0
    )
    first_byte: float = setting(
        600.0,
        "From sending the request to the worker's response headers. A non-streaming "
        "answer arrives whole, so this bounds a whole generation.",
        unit="seconds",
        minimum=0.0,
    )
    idle: float = setting(
        300.0,
        "Longest silence between two chunks of a response body.",
        unit="seconds",
        minimum=0.0,
    )
    total: float = setting(
        0.0, "Whole request, from dispatch to the last byte.", unit="seconds", minimum=0.0
    )


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """Background probes of each worker's /health and /v1/models."""

    interval: float = setting(
        5.0, "Time between two probes of one worker.", unit="seconds", minimum=0.05
    )
    timeout: float = setting(2.0, "Limit on one probe request.", unit="seconds", minimum=0.01)
    healthy_after: int = setting(
        1, "Consecutive passing probes that make a worker ready.", minimum=1
    )
    unhealthy_after: int = setting(
        2, "Consecutive failing probes that make a worker unhealthy.", minimum=1
    )
    startup_wait: float = setting(
        3.0,
        "At start, how long to wait for the first probe of every worker before serving.",
        unit="seconds",
        minimum=0.0,
    )


# --- the whole configuration ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway reads at start (and again on reload)."""

    host: str = setting(
        "127.0.0.1",
        "Address to listen on. Loopback by default: say 0.0.0.0 to serve the network.",
        cli="--host",
    )
    port: int = setting(8000, "TCP port to listen on.", minimum=0, maximum=65535, cli="--port")
    policy: str = setting(
        "queue",
        "Dispatch policy used for every model without its own (see docs/dispatch.md).",
        cli="--policy",
    )
    max_body_bytes: int = setting(
        32 * 1024 * 1024,
        "Largest request body accepted; larger ones get 413.",
        unit="bytes",
        minimum=1024,
    )
    max_attempts: int = setting(
        3,
        "Workers tried for one request when a worker cannot be reached "
        "(only before any byte reached the client).",
        minimum=1,
    )
    workers: tuple[WorkerSpec, ...] = setting(
        (),
        "Static workers: `[[workers]]` tables in TOML; URLs on the command line "
        "(`--worker`, repeatable) or comma-separated in the environment.",
        cli="--worker",
    )
    log: LogConfig = field(default_factory=LogConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)


# --- loading --------------------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Build and validate the configuration; raise `ConfigError` listing every mistake.

    `overrides` is a nested mapping like the TOML file's (e.g. {"log": {"format": "json"}});
    keys whose value is None are ignored, so click options can default to None.
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
    _merge(raw, _from_env(GatewayConfig, env, ENV_PREFIX, errors))
    _merge(raw, _drop_none(overrides or {}))
    config = _build(GatewayConfig, raw, "", errors)
    if not errors:
        errors.extend(validate(config))
    if errors:
        raise ConfigError(errors)
    return config


def validate(config: GatewayConfig) -> list[str]:
    """Check values against their declared bounds and each other; return the mistakes."""
    errors: list[str] = []
    _check_bounds(config, "", errors)
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
    if not config.host or any(c in config.host for c in "/ "):
        errors.append(f"host: {config.host!r} is not an address or host name")
    return errors


def normalize_url(url: str) -> str:
    """The one spelling of a worker URL used as its identity: no trailing slash."""
    return url.strip().rstrip("/")


def check_worker_url(url: str) -> str | None:
    """Return why `url` is not a usable worker base URL, or None when it is."""
    if not url:
        return "is empty"
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
    rows: list[tuple[str, ...]] = []
    _describe(GatewayConfig, "", ENV_PREFIX, rows)
    return rows


# --- internals ------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _tuple_item(tp: Any) -> Any | None:
    if typing.get_origin(tp) is tuple:
        return typing.get_args(tp)[0]
    return None


def _from_env(cls: type, env: Mapping[str, str], prefix: str, errors: list[str]) -> dict:
    """Pick this section's keys out of the environment, still as strings."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        name = prefix + f.name.upper()
        if _is_section(tp):
            sub = _from_env(tp, env, name + "_", errors)
            if sub:
                out[f.name] = sub
        elif name in env:
            item = _tuple_item(tp)
            if _is_section(item):  # a list of tables, given as comma-separated URLs
                out[f.name] = [u.strip() for u in env[name].split(",") if u.strip()]
            else:
                out[f.name] = env[name]
    return out


def _merge(into: dict, new: Mapping) -> None:
    for k, v in new.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _drop_none(m: Mapping) -> dict:
    out = {}
    for k, v in m.items():
        if isinstance(v, Mapping):
            v = _drop_none(v)
            if v:
                out[k] = v
        elif v is not None:
            out[k] = v
    return out


def _build(cls: type, raw: Any, where: str, errors: list[str]) -> Any:
    """Make a `cls` from a raw mapping, coercing strings from env/CLI, noting bad keys."""
    if not isinstance(raw, Mapping):
        errors.append(f"{where or 'config'}: expected a table, got {type(raw).__name__}")
        return cls()
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            errors.append(f"{where}{key}: unknown setting")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        tp = hints[f.name]
        value = _coerce(tp, raw[f.name], f"{where}{f.name}", errors)
        if value is not _BAD:
            values[f.name] = value
    return cls(**values)


_BAD = object()


def _coerce(tp: Any, value: Any, where: str, errors: list[str]) -> Any:
    if _is_section(tp):
        return _build(tp, value, where + ".", errors)
    item = _tuple_item(tp)
    if item is not None:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            errors.append(f"{where}: expected a list, got {value!r}")
            return _BAD
        out = []
        for i, v in enumerate(value):
            if _is_section(item) and isinstance(v, str):
                v = {"url": v}  # a bare URL stands for a worker table
            c = _coerce(item, v, f"{where}[{i}]", errors)
            if c is not _BAD:
                out.append(c)
        return tuple(out)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or value == "":
            return None
        return _coerce(args[0], value, where, errors)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        errors.append(f"{where}: expected true or false, got {value!r}")
        return _BAD
    if tp in (int, float):
        if isinstance(value, bool):
            errors.append(f"{where}: expected a number, got {value!r}")
            return _BAD
        try:
            number = tp(value)
        except (TypeError, ValueError):
            errors.append(
                f"{where}: expected {'an integer' if tp is int else 'a number'}, got {value!r}"
            )
            return _BAD
        if tp is int and isinstance(value, float) and value != number:
            errors.append(f"{where}: expected an integer, got {value!r}")
            return _BAD
        return number
    if tp is str:
        if not isinstance(value, str):
            errors.append(f"{where}: expected a string, got {value!r}")
            return _BAD
        return value
    if typing.get_origin(tp) is dict:
        if not isinstance(value, Mapping):
            errors.append(f"{where}: expected a table, got {value!r}")
            return _BAD
        _, vt = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            c = _coerce(vt, v, f"{where}.{k}", errors)
            if c is not _BAD:
                out[str(k)] = c
        return out
    return value


def _check_bounds(obj: Any, where: str, errors: list[str]) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{where}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_bounds(value, name + ".", errors)
            continue
        if isinstance(value, tuple):
            for i, v in enumerate(value):
                if dataclasses.is_dataclass(v):
                    _check_bounds(v, f"{name}[{i}].", errors)
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                if dataclasses.is_dataclass(v):
                    _check_bounds(v, f"{name}.{k}.", errors)
            continue
        meta = f.metadata
        if meta.get("choices") and value not in meta["choices"]:
            errors.append(f"{name}: must be one of {', '.join(meta['choices'])}, got {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if meta.get("minimum") is not None and value < meta["minimum"]:
                errors.append(f"{name}: must be at least {meta['minimum']:g}, got {value!r}")
            if meta.get("maximum") is not None and value > meta["maximum"]:
                errors.append(f"{name}: must be at most {meta['maximum']:g}, got {value!r}")


def _describe(cls: type, where: str, env_prefix: str, rows: list) -> None:
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            _describe(tp, f"{where}{f.name}.", f"{env_prefix}{f.name.upper()}_", rows)
            continue
        meta = f.metadata
        item = _tuple_item(tp)
        if item is not None and _is_section(item):
            rows.append(
                (
                    f"{where}{f.name}",
                    "list of tables",
                    "[]",
                    "",
                    meta.get("cli", ""),
                    env_prefix + f.name.upper(),
                    meta.get("help", ""),
                )
            )
            _describe(item, f"{where}{f.name}[].", "", rows)
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        env_name = env_prefix + f.name.upper() if env_prefix else ""
        rows.append(
            (
                f"{where}{f.name}",
                _type_name(tp),
                repr(default).replace("'", '"'),
                meta.get("unit", ""),
                meta.get("cli", ""),
                env_name,
                meta.get("help", ""),
            )
        )


def effective_toml(config: GatewayConfig) -> str:
    """The configuration as a TOML document, secrets masked (for `check-config`)."""
    top: list[str] = []
    sections: list[str] = []
    _emit(config, "", top, sections)
    return "".join(top) + "".join(sections)


def _emit(obj: Any, name: str, top: list[str], sections: list[str]) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            sub: list[str] = []
            _emit(value, f"{name}{f.name}.", sub, sections)
            sections.append(f"\n[{name}{f.name}]\n" + "".join(sub))
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            for item in value:
                sub = []
                _emit(item, "", sub, [])
                sections.append(f"\n[[{name}{f.name}]]\n" + "".join(sub))
        elif isinstance(value, dict) and all(dataclasses.is_dataclass(v) for v in value.values()):
            for key, item in value.items():
                sub = []
                _emit(item, "", sub, [])
                sections.append(f'\n[{name}{f.name}."{key}"]\n' + "".join(sub))
        else:
            shown = '"***"' if f.metadata.get("secret") and value else toml_value(value)
            if value is None:
                continue
            top.append(f"{f.name} = {shown}\n")


def toml_value(value: Any) -> str:
    """A value as it would be written in the TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{k}" = {toml_value(v)}' for k, v in value.items()) + "}"
    if value is None:
        return "(unset)"
    return repr(value)


def _type_name(tp: Any) -> str:
    item = _tuple_item(tp)
    if item is not None:
        return f"list of {_type_name(item)}"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} (optional)"
    if typing.get_origin(tp) is dict:
        return "table"
    return getattr(tp, "__name__", str(tp))

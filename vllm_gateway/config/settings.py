"""Typed settings from frozen dataclasses: declare a key once, load, check and document it.

A generic toolkit with no knowledge of the gateway's own settings (config.py declares those):
`setting()` declares one field with its default, unit, bounds and help; `build` makes a
dataclass from a raw mapping (TOML, environment, CLI), coercing strings and noting every
mistake; `check_bounds` checks declared bounds and choices; `describe` and `to_toml` render
the declarations for the docs and `check-config`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import field
from typing import Any


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


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _tuple_item(tp: Any) -> Any | None:
    if typing.get_origin(tp) is tuple:
        return typing.get_args(tp)[0]
    return None


def from_env(cls: type, env: Mapping[str, str], prefix: str, errors: list[str]) -> dict:
    """Pick the keys of `cls` out of the environment (as strings; `build` coerces them)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        name = prefix + f.name.upper()
        if _is_section(tp):
            sub = from_env(tp, env, name + "_", errors)
            if sub:
                out[f.name] = sub
        elif name in env:
            item = _tuple_item(tp)
            if _is_section(item):  # a list of tables, given as comma-separated URLs
                out[f.name] = [u.strip() for u in env[name].split(",") if u.strip()]
            else:
                out[f.name] = env[name]
    return out


def merge(into: dict, new: Mapping) -> None:
    """Deep-merge `new` into `into`; later sources win key by key."""
    for k, v in new.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v


def drop_none(m: Mapping) -> dict:
    """`m` without None values (click options not given), at every depth."""
    out = {}
    for k, v in m.items():
        if isinstance(v, Mapping):
            v = drop_none(v)
            if v:
                out[k] = v
        elif v is not None:
            out[k] = v
    return out


def build(cls: type, raw: Any, where: str, errors: list[str]) -> Any:
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
    """`value` as type `tp`, or _BAD with the mistake noted in `errors`."""
    if _is_section(tp):
        return build(tp, value, where + ".", errors)
    item = _tuple_item(tp)
    if item is not None:
        return _coerce_list(item, value, where, errors)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or value == "":
            return None
        return _coerce(args[0], value, where, errors)
    if tp is bool:
        return _coerce_bool(value, where, errors)
    if tp in (int, float):
        return _coerce_number(tp, value, where, errors)
    if tp is str:
        if not isinstance(value, str):
            errors.append(f"{where}: expected a string, got {value!r}")
            return _BAD
        return value
    if typing.get_origin(tp) is dict:
        return _coerce_table(typing.get_args(tp)[1], value, where, errors)
    return value


def _coerce_list(item: Any, value: Any, where: str, errors: list[str]) -> Any:
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


def _coerce_bool(value: Any, where: str, errors: list[str]) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
        return False
    errors.append(f"{where}: expected true or false, got {value!r}")
    return _BAD


def _coerce_number(tp: type, value: Any, where: str, errors: list[str]) -> Any:
    if isinstance(value, bool):
        errors.append(f"{where}: expected a number, got {value!r}")
        return _BAD
    try:
        number = tp(value)
    except (TypeError, ValueError, OverflowError):  # int(inf) overflows
        errors.append(
            f"{where}: expected {'an integer' if tp is int else 'a number'}, got {value!r}"
        )
        return _BAD
    if tp is int and isinstance(value, float) and value != number:
        errors.append(f"{where}: expected an integer, got {value!r}")
        return _BAD
    return number


def _coerce_table(value_type: Any, value: Any, where: str, errors: list[str]) -> Any:
    if not isinstance(value, Mapping):
        errors.append(f"{where}: expected a table, got {value!r}")
        return _BAD
    table: dict[str, Any] = {}
    for k, v in value.items():
        c = _coerce(value_type, v, f"{where}.{k}", errors)
        if c is not _BAD:
            table[str(k)] = c
    return table


# The largest weight a worker or an alias target may have. A weight is a relative share,
# so a million to one is more than any split needs; bounded so that sums of weights stay
# finite (a worker weighted 1e308 overflowed the preamble plan's arithmetic, and every
# request with a popular system prompt failed with it).
MAX_WEIGHT = 1e6

# A duration with no declared maximum may still not exceed this (about 115 days): beyond
# it no timer means anything, and some clocks and libraries overflow on huge delays.
MAX_SECONDS = 1e7


def check_bounds(obj: Any, where: str, errors: list[str]) -> None:
    """Note every value outside its declared choices, minimum or maximum, and every number
    that is not finite (NaN passes every comparison, so bounds alone would let it in)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{where}{f.name}"
        if dataclasses.is_dataclass(value):
            check_bounds(value, name + ".", errors)
            continue
        if isinstance(value, tuple):
            for i, v in enumerate(value):
                if dataclasses.is_dataclass(v):
                    check_bounds(v, f"{name}[{i}].", errors)
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                if dataclasses.is_dataclass(v):
                    check_bounds(v, f"{name}.{k}.", errors)
            continue
        meta = f.metadata
        if meta.get("choices") and value not in meta["choices"]:
            errors.append(f"{name}: must be one of {', '.join(meta['choices'])}, got {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _check_number(name, value, meta, errors)


def _check_number(name: str, value: float, meta: Mapping[str, Any], errors: list[str]) -> None:
    if not math.isfinite(value):
        errors.append(f"{name}: must be a finite number, got {value!r}")
        return
    maximum = meta.get("maximum")
    if maximum is None and meta.get("unit") == "seconds":
        maximum = MAX_SECONDS
    if meta.get("minimum") is not None and value < meta["minimum"]:
        errors.append(f"{name}: must be at least {meta['minimum']:g}, got {value!r}")
    if maximum is not None and value > maximum:
        errors.append(f"{name}: must be at most {maximum:g}, got {value!r}")


def describe(cls: type, env_prefix: str) -> list[tuple[str, ...]]:
    """Every setting of `cls` as (key, type, default, unit, cli, env, help) rows."""
    rows: list[tuple[str, ...]] = []
    _describe(cls, "", env_prefix, rows)
    return rows


def _dict_value(tp: Any) -> Any | None:
    if typing.get_origin(tp) is dict:
        return typing.get_args(tp)[1]
    return None


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
        value_type = _dict_value(tp)
        if value_type is not None and _is_section(value_type):
            rows.append(
                (f"{where}{f.name}", "table of tables", "{}", "", "", "", meta.get("help", ""))
            )
            _describe(value_type, f'{where}{f.name}."NAME".', "", rows)
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
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


def to_toml(settings: Any) -> str:
    """A settings object as a TOML document, secrets masked."""
    top: list[str] = []
    sections: list[str] = []
    _emit(settings, "", top, sections)
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

"""Model aliases and weighted traffic splits: the name a client asks for -> the model it gets.

    [aliases]
    llama = { "llama-v1" = 90, "llama-v2" = 10 }    # a split: 90 % v1, 10 % v2
    chat  = { "llama-v2" = 1 }                       # a plain alias

A request for `llama` is sent on as a request for `llama-v1` or `llama-v2`, its body's
`model` rewritten (`RequestInfo.with_model`), so the worker sees a model it serves. The
choice is weighted at random, except that a request with a session key (X-Session-ID,
X-User-ID or the body's `user`) always lands on the same target for the same weights, so
one conversation does not hop between versions. Only targets with an available worker are
chosen while any has one; a split never sends a request to a version that cannot serve it
while another could (this is what lets a rollout shift traffic with no failed request).

Aliases come from the config file and from the admin API; an admin entry overrides a
config entry of the same name, and a config reload replaces only the config entries. An
alias takes precedence over a model of the same name, and targets are model names as
workers serve them (aliases are not followed).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Mapping
from typing import Any

from vllm_gateway.config.load import check_model_name
from vllm_gateway.config.settings import MAX_WEIGHT
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.log import get_logger
from vllm_gateway.workers import WorkerRegistry

log = get_logger("vllm_gateway.aliases")


class Split:
    """One alias: target models and their relative weights (weights > 0 only)."""

    __slots__ = ("targets", "total", "weights")

    def __init__(self, targets: Mapping[str, float]) -> None:
        kept = [(m, float(w)) for m, w in targets.items() if w > 0]
        self.targets = tuple(m for m, _ in kept)
        self.weights = tuple(w for _, w in kept)
        self.total = sum(self.weights)

    def choose(self, point: float, registry: WorkerRegistry) -> str:
        """The target at `point` (0 <= point < 1) among the targets that can serve now."""
        if len(self.targets) == 1:
            return self.targets[0]
        live = [
            (m, w)
            for m, w in zip(self.targets, self.weights, strict=True)
            if any(worker.available for worker in registry.serving(m))
        ]
        if not live:  # none can serve: choose as configured; dispatch says why it fails
            live = list(zip(self.targets, self.weights, strict=True))
        mark = point * sum(w for _, w in live)
        for model, weight in live:
            mark -= weight
            if mark < 0:
                return model
        return live[-1][0]

    def shares(self) -> dict[str, float]:
        """Each target's share of traffic, 0..1."""
        return {m: w / self.total for m, w in zip(self.targets, self.weights, strict=True)}


def check_alias(name: str, targets: Any) -> str | None:
    """Return why `name -> targets` is not a valid alias, or None."""
    problem = check_model_name(name)
    if problem:
        return f"alias {name!r}: {problem}"
    if isinstance(targets, str):
        targets = {targets: 1.0}
    if not isinstance(targets, Mapping) or not targets:
        return f"alias {name!r}: targets must be a table of model -> weight"
    for model, weight in targets.items():
        problem = check_model_name(model) if isinstance(model, str) else "not a string"
        if problem:
            return f"alias {name!r}: target {problem}"
        if model == name:
            return f"alias {name!r}: a target cannot be the alias itself"
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not 0 <= weight <= MAX_WEIGHT
        ):
            return f"alias {name!r}: weight of {model!r} must be a number from 0 to {MAX_WEIGHT:g}"
    if not any(w > 0 for w in targets.values()):
        return f"alias {name!r}: at least one weight must be above 0"
    return None


class AliasTable:
    """The aliases in force: config entries overlaid by admin entries."""

    def __init__(
        self,
        registry: WorkerRegistry,
        config: Mapping[str, Mapping[str, float]] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.rng = rng or random.Random()
        self._config: dict[str, Split] = {}
        self._admin: dict[str, Split] = {}
        self._table: dict[str, Split] = {}
        self.load_config(config or {})

    def load_config(self, aliases: Mapping[str, Mapping[str, float]]) -> None:
        """Replace the config file's aliases (start, reload); admin entries stay."""
        self._config = {name: Split(targets) for name, targets in aliases.items()}
        self._rebuild()

    def set(self, name: str, targets: Any) -> str | None:
        """Set an admin alias; return why not when it is invalid. Idempotent."""
        problem = check_alias(name, targets)
        if problem:
            return problem
        if isinstance(targets, str):
            targets = {targets: 1.0}
        split = Split(targets)
        old = self._table.get(name)
        self._admin[name] = split
        self._rebuild()
        if old is None or old.shares() != split.shares():
            log.info("alias set", alias=name, targets=split.shares())
        return None

    def remove(self, name: str) -> bool:
        """Drop an admin alias (a config alias of that name shows through again)."""
        if self._admin.pop(name, None) is None:
            return False
        self._rebuild()
        log.info("alias removed", alias=name)
        return True

    def _rebuild(self) -> None:
        self._table = {**self._config, **self._admin}

    def resolve(self, info: RequestInfo) -> RequestInfo:
        """The request as it should be dispatched: its model replaced when it is an alias."""
        split = self._table.get(info.model)
        if split is None:
            return info
        key = info.session_key
        point = (zlib.crc32(key.encode()) / 2**32) if key else self.rng.random()
        target = split.choose(point, self.registry)
        return info.with_model(target)

    def names(self) -> list[str]:
        return sorted(self._table)

    def ready_names(self) -> list[str]:
        """Aliases with at least one target some available worker serves."""
        return sorted(
            name
            for name, split in self._table.items()
            if any(w.available for m in split.targets for w in self.registry.serving(m))
        )

    def describe(self) -> dict[str, dict[str, Any]]:
        """Every alias: its targets' shares and where it comes from."""
        return {
            name: {
                "targets": split.shares(),
                "source": "admin" if name in self._admin else "config",
            }
            for name, split in sorted(self._table.items())
        }

"""The reload seam: a running part follows its own section of a new configuration.

    class Prober:
        def configure(self, config: GatewayConfig) -> list[str]:
            if config.probe == self.config:
                return []
            self.config = config.probe
            return ["probe settings changed"]

`process/reload.apply_config` calls `configure` on each part in turn and logs the lines
they return; a part reads only its own section and says only what it changed. `Section`
adapts a part that keeps no copy of its section (a setting assigned on another object).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from vllm_gateway.config.gateway import GatewayConfig

T = TypeVar("T")


class Configurable(Protocol):
    """A running part of the gateway that follows a reloaded configuration in place."""

    def configure(self, config: GatewayConfig) -> list[str]:
        """Take this part's section of `config`; return what changed, one line each."""
        ...


class Section(Generic[T]):
    """A `Configurable` for a part that does not compare its section itself: `read` picks
    the section out of a configuration, `apply(old, new)` hands a changed one over, and
    `report` (a line, or a function of old and new giving the lines) says what changed."""

    def __init__(
        self,
        config: GatewayConfig,
        read: Callable[[GatewayConfig], T],
        apply: Callable[[T, T], object],
        report: str | Callable[[T, T], list[str]],
    ) -> None:
        self.read = read
        self.apply = apply
        self.report = report
        self.current = read(config)  # the section the part follows now

    def configure(self, config: GatewayConfig) -> list[str]:
        new = self.read(config)
        if new == self.current:
            return []
        old, self.current = self.current, new
        self.apply(old, new)
        return [self.report] if isinstance(self.report, str) else self.report(old, new)

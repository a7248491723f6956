"""Prometheus' text exposition format (version 0.0.4): histograms and a writer.

Only what the gateway needs: families with HELP and TYPE, samples with escaped labels, and
cumulative histograms. telemetry.py decides what to write; this module how.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    """Bucket counts (not cumulative; the last is +Inf), sum and count of observations."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, which is Prometheus' `le` (less or equal).
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> Iterator[tuple[str, int]]:
        """(le, cumulative count) pairs as the exposition format writes them."""
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            yield ("+Inf" if bound == float("inf") else _number(bound)), total


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    if isinstance(value, int) or value.is_integer():
        return str(int(value))
    return repr(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, object]]) -> str:
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs)
    return "{" + inner + "}" if inner else ""


class Writer:
    """Collects lines of the text exposition format (version 0.0.4)."""

    def __init__(self, const: tuple[tuple[str, object], ...] = ()) -> None:
        self.lines: list[str] = []
        self.const = const  # labels on every sample (the process, with --processes N)

    def family(self, name: str, type_: str, help_: str) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {type_}")

    def sample(self, name: str, value: float, labels: Iterable[tuple[str, object]] = ()) -> None:
        if self.const:
            labels = (*labels, *self.const)
        self.lines.append(f"{name}{_labels(labels)} {_number(value)}")

    def histograms(
        self,
        name: str,
        help_: str,
        series: Mapping[Any, Histogram],  # keys: tuples of label values, as `keys` names
        keys: tuple[str, ...] = ("model", "worker"),
    ) -> None:
        self.family(name, "histogram", help_)
        for key, h in sorted(series.items()):
            base = tuple(zip(keys, key, strict=True))
            for le, count in h.cumulative():
                self.sample(name + "_bucket", count, (*base, ("le", le)))
            self.sample(name + "_sum", h.sum, base)
            self.sample(name + "_count", h.count, base)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

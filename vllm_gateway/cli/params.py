"""Click parameter types the fleet verbs share."""

from __future__ import annotations

import math
from typing import Any

import click


class _Finite(click.ParamType):
    """A float that is finite: click's own float takes "inf" and "nan", which JSON cannot
    carry (orjson writes them as null, and the gateway would take its default)."""

    name = "float"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number.", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


FINITE = _Finite()

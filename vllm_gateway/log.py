"""The one structlog configuration, and the context every request's log lines carry.

`configure` is called once per process. Request handlers bind `request_id`, `model` and
`worker` with `bind_request`; structlog's contextvars merge puts them on every line logged
while that request runs, so no call site passes them by hand. Records from the standard
`logging` module (aiohttp's own) go through the same renderer, so the output is one format.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog
from structlog.contextvars import bind_contextvars, clear_contextvars

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _orjson_dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default or str).decode()


def configure(format: str = "auto", level: str = "info", stream: Any = None) -> None:
    """Configure structlog and stdlib logging for this process.

    format: "json" (one object per line), "console" (for humans), or "auto" (console when
    `stream` is a TTY, JSON otherwise).
    """
    stream = stream or sys.stderr
    if format == "auto":
        format = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if format == "json":
        renderer: Any = structlog.processors.JSONRenderer(serializer=_orjson_dumps)
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=getattr(stream, "isatty", bool)())
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level])
    # aiohttp's access logger would write one unstructured line per request; ours is opt-in.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A logger for one module; bind the module name so lines say where they come from."""
    return structlog.get_logger(name)


def bind_request(**fields: Any) -> None:
    """Bind fields (request_id, model, worker) to every line logged by the current task."""
    bind_contextvars(**fields)


def clear_request() -> None:
    """Forget the current task's request fields."""
    clear_contextvars()

"""The one structlog configuration, and the context every request's log lines carry.

`configure` is called at start, and again when a reload changes the log settings (loggers are
not cached, so a new level applies to every module at once). Request handlers bind
`request_id`, `model` and `worker` with `bind_request`; structlog's contextvars merge puts
them on every line logged while that request runs, so no call site passes them by hand.
Records from the standard `logging` module (aiohttp's own) go through the same renderer, so
the output is one format.
"""

from __future__ import annotations

import datetime
import logging
import sys
from collections.abc import Callable
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


# The stream JSON lines go to, when the format is json: the access log writes there directly.
_json_stream: Any = None


def _orjson_dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default or str).decode()


def configure(format: str = "auto", level: str = "info", stream: Any = None) -> None:
    """Configure structlog and stdlib logging for this process.

    format: "json" (one object per line), "console" (for humans), or "auto" (console when
    `stream` is a TTY, JSON otherwise).
    """
    global _json_stream
    stream = stream or sys.stderr
    if format == "auto":
        format = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    _json_stream = stream if format == "json" else None
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
        # Not cached, so a reload's new level reaches loggers already in use (~1 µs a call).
        cache_logger_on_first_use=False,
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
    # Ours is written whatever the level: switching it on is the operator's explicit wish.
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)


ACCESS_LOGGER = "vllm_gateway.access"


def access_writer() -> Callable[[dict[str, Any]], None]:
    """A function that writes one access log line (event "request") from a dict of fields.

    With JSON lines (the format under systemd) it renders the line itself with orjson, in the
    shape structlog would (fields, event, level, timestamp): about 3 µs a line instead of
    about 14 µs through structlog and `logging`. Otherwise it goes through structlog.
    """
    stream = _json_stream
    if stream is None:
        # Filtered at INFO whatever log.level says: switching it on is the operator's wish.
        logger = structlog.wrap_logger(
            logging.getLogger(ACCESS_LOGGER),
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        )

        def write_console(fields: dict[str, Any]) -> None:
            logger.info("request", **fields)

        return write_console
    now = datetime.datetime.now
    utc = datetime.UTC
    dumps = orjson.dumps

    def write_json(fields: dict[str, Any]) -> None:
        fields["event"] = "request"
        fields["level"] = "info"
        fields["timestamp"] = now(utc).isoformat().replace("+00:00", "Z")
        stream.write(dumps(fields, default=str).decode() + "\n")
        stream.flush()

    return write_json


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A logger for one module; bind the module name so lines say where they come from."""
    return structlog.get_logger(name)


def bind_request(**fields: Any) -> None:
    """Bind fields (request_id, model, worker) to every line logged by the current task."""
    bind_contextvars(**fields)


def clear_request() -> None:
    """Forget the current task's request fields."""
    clear_contextvars()

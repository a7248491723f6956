"""The access log: one structured line per finished request, when `log.access_log` is on.

A request that reached a worker is written when its lease ends (`Dispatcher.on_release`),
one line per attempt:

    {"request_id": "gw-3f2a-1c", "model": "llama", "path": "/v1/chat/completions",
     "stream": true, "worker": "http://10.0.0.5:8000", "status": 200, "outcome": "ok",
     "ttfb": 0.0412, "duration": 1.8731, "bytes": 5120, "waited": 0.0, "full": false,
     "placed": "history", "event": "request", ...}

`ttfb` and `duration` are seconds from dispatch (ttfb is null when no body byte was
relayed), `waited` the seconds spent in the admission queue before it, `full` whether
the worker was already full when it was sent (its capacity reached, or a queue reported:
it waits inside the worker), `placed` how the policy chose it (cache_aware's steps:
`PLACED` in policies/cache_aware.py; null for the other policies), `bytes` the
response body bytes relayed, `outcome` one of dispatch's outcomes (ok, client_gone,
unreachable, refused, timeout, broken, shutdown). A request the gateway answered itself
without a worker (400, 404, 413, 503, ...) is one line with `code` and outcome `rejected`.
Lines carry event "request", so they are easy to select in a journal.
"""

from __future__ import annotations

import time

from vllm_gateway.dispatch.dispatcher import Lease
from vllm_gateway.errors import GatewayError, UpstreamError
from vllm_gateway.log import access_writer


class AccessLog:
    """Hooks for `Dispatcher.on_release` and `routes.ERROR_HOOKS` that write the lines."""

    def __init__(self) -> None:
        # Taken once: the writer follows the log format configured at that moment, so a
        # reload that changes the format builds a new AccessLog.
        self._write = access_writer()

    def lease_done(self, lease: Lease) -> None:
        """One line for a finished attempt on a worker."""
        now = time.monotonic()
        info = lease.info
        started = lease.started
        self._write(
            {
                "request_id": info.request_id,
                "model": info.model,
                "path": info.path,
                "stream": info.stream,
                "worker": lease.worker.url,
                "status": lease.status,
                "outcome": lease.outcome,
                "ttfb": round(lease.first_byte - started, 6) if lease.first_byte else None,
                "duration": round(now - started, 6),
                "bytes": lease.bytes,
                "waited": round(lease.waited, 6),
                "full": lease.full,
                "placed": info.placed or None,
            }
        )

    def error(self, error: GatewayError, method: str, path: str, request_id: str | None) -> None:
        """One line for a request the gateway refused before any worker was tried.

        Errors of a relay attempt (`UpstreamError`: unreachable, timeout, ...) already have
        their line from the lease.
        """
        if isinstance(error, UpstreamError):
            return
        self._write(
            {
                "request_id": request_id,
                "method": method,
                "path": path,
                "status": error.status,
                "code": error.code or error.type,
                "outcome": "rejected",
            }
        )

"""Live counters of a fake worker and the record of the last requests it saw."""

from __future__ import annotations

import base64
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# How many request records to keep; older ones fall off.
RECORDS_KEPT = 200

# The ways a recorded request ends -> the FakeStats counter each one bumps. A record
# is "pending" until one of these is decided, once.
OUTCOMES = {
    "completed": "completed",
    "error": "errors",
    "aborted": "aborted",
    "faulted": "faulted",
    "dropped": "dropped",
}


class Headers(dict[str, str]):
    """Request headers as a plain dict with lower-case keys, looked up in any case.

    A relay may change the case of header names; tests should not care, so
    `headers["X-Request-Id"]` and `headers["x-request-id"]` both work.
    """

    def __init__(self, items: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__((k.lower(), v) for k, v in items)

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(key.lower())

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)


@dataclass(eq=False)
class RequestRecord:
    """One request as received: exact body bytes, headers, and how it ended."""

    method: str
    path: str
    headers: Headers
    body: bytes
    fault: str | None = None
    # "pending" while running, then one of OUTCOMES (see FakeStats for what each means).
    outcome: str = "pending"
    status: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "headers": dict(self.headers),
            # Text for reading; base64 for tests that compare bytes across processes.
            "body": self.body.decode("utf-8", "replace"),
            "body_b64": base64.b64encode(self.body).decode("ascii"),
            "fault": self.fault,
            "outcome": self.outcome,
            "status": self.status,
        }


@dataclass
class FakeStats:
    """Counters since start. Health probes, /metrics scrapes and /fake/* are not requests.

    completed: answered in full with a 2xx status.
    errors: answered with a 4xx/5xx status (bad input, unknown model, `status=` fault).
    aborted: the client went away before the answer was finished (the gateway's
        disconnect tests rely on this one).
    faulted: the fake itself ended the answer early (`reset_midstream`, `close_midstream`).
    dropped: the fake's connections were cut by pause() or stop().
    running / waiting: the scheduler right now; max_*_seen: the highest since start.
    """

    received: int = 0
    completed: int = 0
    errors: int = 0
    aborted: int = 0
    faulted: int = 0
    dropped: int = 0
    running: int = 0
    waiting: int = 0
    max_running_seen: int = 0
    max_waiting_seen: int = 0
    health_probes: int = 0
    metrics_scrapes: int = 0
    requests: deque[RequestRecord] = field(default_factory=lambda: deque(maxlen=RECORDS_KEPT))

    def record(self, rec: RequestRecord) -> None:
        self.received += 1
        self.requests.append(rec)

    def finish(self, rec: RequestRecord, outcome: str) -> bool:
        """Set a pending record's outcome and count it; a second call is a no-op.

        Returns whether this call decided the outcome.
        """
        if rec.outcome != "pending":
            return False
        counter = OUTCOMES[outcome]
        rec.outcome = outcome
        setattr(self, counter, getattr(self, counter) + 1)
        return True

    def last(self, path: str | None = None) -> RequestRecord:
        """The newest record, or the newest for `path`; KeyError if none."""
        for rec in reversed(self.requests):
            if path is None or rec.path == path:
                return rec
        raise KeyError(path)

    def counters(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if isinstance(v, int)}

    def to_dict(self) -> dict[str, Any]:
        return {**self.counters(), "requests": [r.to_dict() for r in self.requests]}

    def __repr__(self) -> str:
        # Records would drown the counters in assertion messages.
        inner = ", ".join(f"{k}={v}" for k, v in self.counters().items())
        return f"FakeStats({inner}, requests=<{len(self.requests)} records>)"

"""A request's hold on one worker (`Lease`), from dispatch to the end of its relay, and the
outcomes it can end with. The dispatcher (dispatcher.py) makes and releases leases."""

from __future__ import annotations

import asyncio
import time

from vllm_gateway.dispatch.prefill_rate import note
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.errors import NoWorkerAvailable, WorkerRefused, WorkerUnreachable
from vllm_gateway.workers import Worker

# Outcomes a lease ends with (also the values of the telemetry label and access log field).
OK = "ok"  # the worker answered and the answer reached the client (any status)
CLIENT_GONE = "client_gone"  # the client left first; its request on the worker was cancelled
UNREACHABLE = "unreachable"  # the worker could not be reached (refused, no route)
CONNECT_TIMEOUT = "connect_timeout"  # the connect timed out: no byte reached the worker
REFUSED = "refused"  # the worker answered 503/429 and the request went to another one
TIMEOUT = "timeout"  # a relay timeout expired
BROKEN = "broken"  # the worker failed mid-answer (reset, malformed framing)
SHUTDOWN = "shutdown"  # the gateway stopped before the answer ended (shutdown grace ran out)


class Lease:
    """One request's hold on one worker, from dispatch to the end of its relay."""

    __slots__ = (
        "_dispatcher",
        "attempt",
        "bytes",
        "can_retry",
        "first_byte",
        "full",
        "info",
        "learns",
        "outcome",
        "pending",
        "started",
        "status",
        "waited",
        "worker",
    )

    def __init__(
        self,
        dispatcher: object,  # the Dispatcher that made it
        worker: Worker,
        info: RequestInfo,
        attempt: int = 1,
        can_retry: bool = False,
        full: bool = False,
    ) -> None:
        self._dispatcher = dispatcher
        self.worker = worker
        self.info = info
        self.started = time.monotonic()
        self.status = 0  # HTTP status the worker answered, 0 until it did
        self.outcome = OK
        self.attempt = attempt  # 1 for the first worker tried, 2 for the next, ...
        # Another attempt is allowed if this one fails retryably (the rule above).
        self.can_retry = can_retry
        # Set by the relay: time.monotonic() when the first body byte went to the client
        # (0.0 until then), and the body bytes relayed (telemetry, access log).
        self.first_byte = 0.0
        self.bytes = 0
        self.waited = 0.0  # seconds spent in the admission queue before this lease
        self.full = full  # sent to a worker already full (Buckets.take says when)
        # Its part of the worker's prefill backlog (Worker.backlog) until its first byte,
        # and whether that byte's time teaches the worker's prefill rate (dispatcher.py).
        self.pending = 0
        self.learns = False

    def first_body(self, status: int, at: float) -> None:
        """The answer's first body byte came at `at` (time.monotonic()): its prefill is
        over. A successful answer's time to it, over the prefill it waited for, teaches
        the worker's prefill rate (prefill_rate.py) when that prefill's bytes are known
        (`learns`); an error's body says nothing of it."""
        pending = self.pending
        if pending:
            if self.learns and 200 <= status < 300:
                note(self.worker, at - self.started, pending)
            self.prefilled()

    def prefilled(self) -> None:
        """Its first byte came (or it ended): the worker owes it no more prefill."""
        pending = self.pending
        if pending:
            self.pending = 0
            self.worker.backlog -= pending


def unreachable_answer(lease: Lease, exc: WorkerUnreachable) -> NoWorkerAvailable:
    """What the client gets when the last worker tried could not be reached: a 503 with
    `Retry-After` (SDKs retry it; a 502 they do not): a refusing worker is out now (the
    breaker took it out on release), and the next request may find another or wait."""
    return NoWorkerAvailable(
        f"No worker serving `{lease.info.model}` could be reached "
        f"({lease.attempt} tried; last: {exc.message})."
    )


def outcome_of(exc: BaseException) -> str:
    """The outcome a lease ends with when `exc` ended its attempt."""
    if isinstance(exc, asyncio.CancelledError | ConnectionResetError):
        return CLIENT_GONE
    if isinstance(exc, WorkerUnreachable):
        return CONNECT_TIMEOUT if exc.timed_out else UNREACHABLE
    if isinstance(exc, WorkerRefused):
        return REFUSED
    if isinstance(exc, TimeoutError):
        return TIMEOUT
    return BROKEN

"""The gateway's exceptions and the one mapping from them to HTTP and OpenAI error bodies.

    Exception
    ├── ConfigError                 a configuration that fails validation (never reaches HTTP)
    └── GatewayError                anything the gateway itself answers with an error
        ├── BadRequest          400 invalid_request_error
        │   ├── BodyTooLarge    413
        │   ├── RequestTimeout  408 (the client sent its body too slowly)
        │   ├── ExpectationFailed 417 (an `Expect` other than 100-continue)
        │   └── MalformedRequest 400/431 (not valid HTTP; answered by client_protocol.py)
        ├── Unauthorized        401
        ├── Forbidden           403
        │   └── PathRefused     403 (a model path clients may not use, e.g. LoRA updates)
        ├── ModelNotFound       404 model_not_found
        ├── WorkerNotFound      404 worker_not_found (admin and registration APIs)
        ├── RouteNotFound       404 / 405 (no such endpoint or method)
        ├── NotRegistered       409 (the registration API, on a worker of another source)
        ├── QueueFull           429 with Retry-After
        ├── RateLimited         429 with Retry-After (a client key's requests per minute)
        │   └── ConcurrencyLimited  429 (a client key's concurrent requests)
        ├── NoWorkerAvailable   503 with Retry-After
        │   ├── QueueTimeout    503 (waited in the admission queue too long)
        │   └── GatewayStopping 503 (shut down before the worker answered)
        └── UpstreamError       502 (a worker failed before answering)
            ├── WorkerUnreachable   502, retryable: no request byte reached the worker
            │                          (its client gets 503: lease.unreachable_answer)
            ├── WorkerRefused       503, retryable: the worker answered 503/429 (not relayed)
            └── UpstreamTimeout     504

Only `GatewayError`s become HTTP answers, and only `error_parts` maps them (to a status,
headers and body: `error_response` for aiohttp, `http.wire` for the gateway's own writers),
so every error a client sees has the OpenAI shape
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson
from aiohttp import web


class ConfigError(Exception):
    """The configuration has one or more mistakes; `problems` lists each on its own."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


class CannotListen(Exception):
    """A port the gateway is configured to listen on could not be bound (in use, not an
    address of this host): the message names it."""


class GatewayError(Exception):
    """An error the gateway answers itself. Subclasses fix status, type and code."""

    status = 500
    type = "internal_error"
    code: str | None = None
    retry_after: float | None = None
    # Close the client's connection after this answer: the request's framing or the rest of
    # its body cannot be trusted to follow (on either serving path).
    closes_connection = False

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if retry_after is not None:
            self.retry_after = retry_after


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class BodyTooLarge(BadRequest):
    status = 413
    code = "request_too_large"


class RequestTimeout(BadRequest):
    status = 408
    code = "request_timeout"
    closes_connection = True  # the rest of that body may still be on its way


class ExpectationFailed(BadRequest):
    status = 417
    code = "expectation_failed"


class MalformedRequest(BadRequest):
    code = "malformed_request"
    closes_connection = True


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"


class PathRefused(Forbidden):
    code = "path_not_allowed"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class WorkerNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "worker_not_found"


class RouteNotFound(GatewayError):
    """404: no such path; 405: a known path, another method (`allow` lists the methods)."""

    status = 404
    type = "invalid_request_error"
    code = "unknown_url"

    def __init__(self, message: str, status: int = 404, allow: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.allow = allow


class NotRegistered(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "worker_not_registered"


class QueueFull(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    retry_after = 1.0


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    retry_after = 1.0


class ConcurrencyLimited(RateLimited):
    code = "concurrency_limit_exceeded"


class NoWorkerAvailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_worker_available"
    retry_after = 1.0


class QueueTimeout(NoWorkerAvailable):
    code = "queue_timeout"


class GatewayStopping(NoWorkerAvailable):
    """The gateway stopped (its shutdown grace ran out) before the worker answered."""

    code = "gateway_stopping"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "worker_error"
    # May the request be tried on another worker? The rule is in dispatch.py's docstring.
    retryable = False


class WorkerUnreachable(UpstreamError):
    """No byte of the request reached the worker: retrying elsewhere is safe."""

    code = "worker_unreachable"
    retryable = True
    # The connect timed out (no refusal came): the worker may be alive and only slow to
    # accept, so the breaker counts it rather than taking the worker out at once.
    timed_out = False


class WorkerRefused(UpstreamError):
    """The worker answered 503/429 and nothing reached the client: try another worker.

    Raised only while another attempt is allowed; the last attempt relays the worker's
    answer as it is, so this never reaches a client in practice.
    """

    status = 503
    code = "worker_refused"
    retryable = True


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "worker_timeout"


def error_body(
    message: str, type: str, code: str | int | None = None, param: str | None = None
) -> bytes:
    """The OpenAI error body, as bytes."""
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def error_parts(
    exc: GatewayError, request_id: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (besides the content type) and body a `GatewayError` becomes."""
    headers = {}
    if exc.retry_after is not None:
        # Retry-After takes whole seconds; never tell a client to retry in 0 s.
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    if request_id:
        headers["X-Request-Id"] = request_id
    if isinstance(exc, RouteNotFound) and exc.allow is not None:
        headers["Allow"] = exc.allow  # RFC 9110 15.5.6: a 405 says what is allowed
    return exc.status, headers, error_body(exc.message, exc.type, exc.code, exc.param)


def error_response(exc: GatewayError, request_id: str | None = None) -> web.Response:
    """A `GatewayError` as an aiohttp response, for refusals before a request exists
    (http/client_protocol.py); requests get theirs through `http.gate.Gate.answer_error`."""
    status, headers, body = error_parts(exc, request_id)
    response = web.Response(
        status=status, body=body, content_type="application/json", headers=headers
    )
    if exc.closes_connection:
        response.force_close()
    return response


def sse_error_event(message: str, type: str = "upstream_error", code: str | None = None) -> bytes:
    """An error as one SSE event, for a stream whose headers already went out."""
    return b"data: " + error_body(message, type, code) + b"\n\n"

"""Client API keys: who may use the OpenAI API through the gateway, and how much.

Keys are configured by name with the SHA-256 of the key, in hex (`[auth.keys."NAME"]`;
`vllm-gateway hash-key` prints it): the key itself is never stored, shown or logged. A
request presents `Authorization: Bearer <key>`; the gateway hashes it and compares the digest
with every configured one in constant time (`access.same_secret`, each one, no early exit),
so an answer's timing tells nothing about which key, or how much of one, matched. Keys are
meant to be random (`hash-key --generate` makes one with 256 bits), so one fast hash is
enough; a slow password hash would only make every request slower.

Each key may carry two limits, enforced per gateway process (with `--processes N` a key may
get up to N times its limits):

- `max_concurrent`: requests in flight at once (a stream counts until it ends);
- `requests_per_minute`: a token bucket holding that many, refilled at that many a minute.

Over a limit the client gets 429 with `Retry-After` and an OpenAI error body. With no key
configured the API is open. Guarded: every path under /v1/ and vLLM's root-level model
endpoints. Not guarded: /health, /metrics, the status page and the fleet's read-only
endpoints; the admin and registration APIs have their own tokens (access.py).

A refusal counts in `ClientKeys.unauthorized` or `.rate_limited` (and, like every error the
gateway answers, in /metrics' `vllm_gateway_errors_total` by code) and logs one DEBUG line
with the peer and the key's name when known, never the key.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from collections.abc import Callable, Mapping

from aiohttp import web

from vllm_gateway.config.gateway import ApiKeyConfig, AuthConfig
from vllm_gateway.control.access import bearer_token, same_secret
from vllm_gateway.errors import ConcurrencyLimited, RateLimited, Unauthorized
from vllm_gateway.http.routes import is_model_path
from vllm_gateway.log import get_logger
from vllm_gateway.proxy.exchange import Exchange

log = get_logger("vllm_gateway.auth")


def hash_key(key: str) -> str:
    """The hex SHA-256 of a key, as `[auth.keys."NAME"].sha256` holds it."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def generate_key() -> str:
    """A new random client key: 256 bits, URL-safe, recognisable by its prefix."""
    return "sk-gw-" + secrets.token_urlsafe(32)


class ClientKey:
    """One configured key: its digest, its limits and what it holds right now."""

    __slots__ = ("capacity", "config", "digest", "inflight", "name", "rate", "stamp", "tokens")

    def __init__(self, name: str, config: ApiKeyConfig, now: float) -> None:
        self.name = name
        self.config = config
        self.digest = config.sha256.lower()
        self.inflight = 0  # requests with this key in flight in this process
        # Token bucket for requests_per_minute: `capacity` tokens, `rate` per second.
        self.capacity = config.requests_per_minute
        self.rate = config.requests_per_minute / 60.0
        self.tokens = self.capacity
        self.stamp = now

    def admit(self, now: float) -> None:
        """Count one more request, or raise RateLimited when a limit says no."""
        limit = self.config.max_concurrent
        if limit and self.inflight >= limit:
            raise ConcurrencyLimited(
                f"Too many concurrent requests for API key `{self.name}` "
                f"(limit {limit}); retry when one has finished."
            )
        if self.rate:
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens < 1.0:
                wait = (1.0 - self.tokens) / self.rate
                raise RateLimited(
                    f"Rate limit reached for API key `{self.name}` "
                    f"({self.capacity:g} requests per minute).",
                    retry_after=float(math.ceil(wait)),
                )
            self.tokens -= 1.0
        self.inflight += 1


def is_model_api(path: str) -> bool:
    """Is `path` part of the OpenAI API the keys guard (see the module docstring)?"""
    return is_model_path(path)


class ClientKeys:
    """The configured keys, and the check every guarded request passes (`admit`)."""

    def __init__(
        self,
        config: AuthConfig,
        *,
        guarded: Callable[[str], bool] = is_model_api,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.guarded = guarded
        self.clock = clock
        self.keys: tuple[ClientKey, ...] = ()
        self.unauthorized = 0  # requests refused for a missing or unknown key
        self.rate_limited = 0  # requests refused by a key's limits
        self.load(config.keys)

    def load(self, keys: Mapping[str, ApiKeyConfig]) -> None:
        """Take a (re)loaded set of keys; a key whose settings did not change keeps its
        in-flight count and bucket."""
        now = self.clock()
        old = {k.name: k for k in self.keys}
        self.keys = tuple(
            old[name] if name in old and old[name].config == cfg else ClientKey(name, cfg, now)
            for name, cfg in keys.items()
        )

    def authenticate(self, request: Exchange | web.Request) -> ClientKey:
        """The key the request presents, or raise Unauthorized."""
        given = bearer_token(request)
        found = None
        if given is not None:
            digest = hash_key(given)
            for key in self.keys:  # every key, no early exit: constant time for a given count
                if same_secret(digest, key.digest):
                    found = key
        if found is None:
            self.unauthorized += 1
            reason = "no API key" if given is None else "unknown API key"
            log.debug("request refused", peer=request.remote, path=request.path, reason=reason)
            if given is None:
                raise Unauthorized(
                    "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
                )
            raise Unauthorized("Incorrect API key provided.")
        return found

    def admit(self, request: Exchange | web.Request) -> ClientKey | None:
        """Check a request's key and count it against the key's limits: the key to `release`
        when the request ends, None when the request needs no key. Raises Unauthorized or
        RateLimited. Both serving paths call this, through gate.Gate.serve."""
        if not self.keys or not self.guarded(request.path):
            return None
        key = self.authenticate(request)
        try:
            key.admit(self.clock())
        except RateLimited as e:
            self.rate_limited += 1
            log.debug("request refused", peer=request.remote, key=key.name, reason=e.code)
            raise
        return key

    @staticmethod
    def release(key: ClientKey | None) -> None:
        if key is not None:
            key.inflight -= 1

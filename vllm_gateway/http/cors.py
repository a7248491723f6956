"""CORS as vLLM answers it: from a request's Origin (and preflight asks) to response headers.

vLLM's server puts Starlette's `CORSMiddleware` in front of its routes, configured by
`--allowed-origins`, `--allowed-methods`, `--allowed-headers` (each `["*"]` by default) and
`--allow-credentials` (off). The `[cors]` section has the same names and defaults, and
`Cors` answers as that middleware does, so a browser page that worked against one vLLM
server works against the gateway:

- a request without `Origin` gets no CORS header (it is not from a browser page);
- an answer to a request with `Origin` (relayed or the gateway's own, errors included) gets
  `Access-Control-Allow-Origin`: `*` when any origin is allowed (the origin itself, with
  `Vary: Origin`, when the request carries cookies), else the origin when it is allowed;
  and `Access-Control-Allow-Credentials: true` when credentials are allowed;
- a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`, any path) is
  answered by the gateway itself: 204 with the `Access-Control-Allow-*` headers, or 400
  naming what is not allowed. (Starlette answers 200 "OK"; browsers take any 2xx.)

Pure: no aiohttp, no I/O. routes.py wires it into aiohttp's side, front_exchange.py into the
heads the front path writes.
"""

from __future__ import annotations

from vllm_gateway.config.gateway import CorsConfig

# What `*` stands for in allowed_methods, and the headers a browser may always send.
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
SAFELISTED_HEADERS = ("Accept", "Accept-Language", "Content-Language", "Content-Type")
MAX_AGE = "600"  # seconds a browser may cache a preflight answer (Starlette's default)

Pairs = list[tuple[str, str]]


class Cors:
    """The `[cors]` settings, turned into the headers each answer gets."""

    __slots__ = (
        "_any_line",
        "allow_all_headers",
        "allow_all_origins",
        "credentials",
        "headers",
        "methods",
        "origins",
    )

    def __init__(self, config: CorsConfig) -> None:
        self.origins = frozenset(config.allowed_origins)
        self.allow_all_origins = "*" in self.origins
        self.methods = (
            ALL_METHODS if "*" in config.allowed_methods else tuple(config.allowed_methods)
        )
        self.allow_all_headers = "*" in config.allowed_headers
        self.headers = tuple(sorted({*SAFELISTED_HEADERS, *config.allowed_headers} - {"*"}))
        self.credentials = config.allow_credentials
        # The common answer (any origin, no cookie), written once for the front path.
        self._any_line = b"Access-Control-Allow-Origin: *\r\n" + (
            b"Access-Control-Allow-Credentials: true\r\n" if self.credentials else b""
        )

    def allows_origin(self, origin: str) -> bool:
        return self.allow_all_origins or origin in self.origins

    def answer_headers(self, origin: str | None, has_cookie: bool = False) -> Pairs:
        """The CORS headers of an answer to a request from `origin` (None: not a browser's)."""
        if origin is None:
            return []
        out: Pairs = []
        if (self.allow_all_origins and has_cookie) or (
            not self.allow_all_origins and origin in self.origins
        ):
            # With cookies `*` does not count, and a named origin is echoed: either way the
            # answer depends on Origin, which caches must know.
            out += [("Access-Control-Allow-Origin", origin), ("Vary", "Origin")]
        elif self.allow_all_origins:
            out.append(("Access-Control-Allow-Origin", "*"))
        if self.credentials:
            out.append(("Access-Control-Allow-Credentials", "true"))
        return out

    def answer_bytes(self, origin: str, has_cookie: bool) -> bytes:
        """`answer_headers` as header lines, for the heads the front path writes."""
        if self.allow_all_origins and not has_cookie:
            return self._any_line
        pairs = self.answer_headers(origin, has_cookie)
        return b"".join(b"%s: %s\r\n" % (n.encode(), v.encode("latin-1")) for n, v in pairs)

    def preflight(
        self, origin: str, method: str, request_headers: str | None
    ) -> tuple[Pairs, list[str]]:
        """A preflight's answer headers, and what it asks that is not allowed (empty: 204)."""
        out: Pairs = []
        refused: list[str] = []
        if not self.allows_origin(origin):
            refused.append(f"origin {origin[:200]!r}")
        elif self.allow_all_origins and not self.credentials:
            out.append(("Access-Control-Allow-Origin", "*"))
        else:
            out.append(("Access-Control-Allow-Origin", origin))
        if not self.allow_all_origins or self.credentials:
            out.append(("Vary", "Origin"))
        out.append(("Access-Control-Allow-Methods", ", ".join(self.methods)))
        out.append(("Access-Control-Max-Age", MAX_AGE))
        if method not in self.methods:
            refused.append(f"method {method[:40]!r}")
        if request_headers is not None and self.allow_all_headers:
            # Any header is allowed: say so by echoing the ones asked for.
            out.append(("Access-Control-Allow-Headers", request_headers))
        else:
            if not self.allow_all_headers:
                out.append(("Access-Control-Allow-Headers", ", ".join(self.headers)))
            allowed = {h.lower() for h in self.headers}
            asked = [h.strip().lower() for h in (request_headers or "").split(",") if h.strip()]
            if any(h not in allowed for h in asked):
                refused.append("headers")
        if self.credentials:
            out.append(("Access-Control-Allow-Credentials", "true"))
        return out, refused

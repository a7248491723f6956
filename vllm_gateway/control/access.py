"""Who may change the fleet: bearer tokens, and where a registered worker may point.

Tokens (admin.token, registration.token) are compared in constant time (`same_secret`,
which client API keys use too, auth.py). A refusal is logged with the peer address, the path and why
(missing or wrong token), never with the token itself, and answered 401 (no or wrong
credentials) or 403 (not allowed at all) with an OpenAI error body.

A registered worker URL must point into the allowed networks: otherwise anyone who can
reach /register_worker could divert a model's traffic (prompts included) to a server of
their own. An IP literal is checked directly; a host name listed in `allowed_hosts` is
accepted as is; any other host name must resolve, and every address it resolves to must
be inside `allowed_networks`.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from aiohttp import web

from vllm_gateway.errors import Forbidden, Unauthorized
from vllm_gateway.log import get_logger
from vllm_gateway.proxy.exchange import Exchange

log = get_logger("vllm_gateway.access")

# A host name that does not resolve within this long is refused.
RESOLVE_TIMEOUT_SECONDS = 2.0

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str], Awaitable[list[str]]]


async def resolve_host(host: str) -> list[str]:
    """Every address `host` resolves to (the system resolver, as connections use)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def bearer_token(request: web.Request | Exchange) -> str | None:
    """The token of an `Authorization: Bearer ...` header, or None."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def same_secret(given: str, expected: str) -> bool:
    """Are two secrets (tokens, key digests) equal? In constant time: the one comparison
    every credential check uses, so no check leaks through its timing."""
    return hmac.compare_digest(given.encode(), expected.encode())


def require_token(request: web.Request, expected: str, what: str) -> None:
    """Raise `Unauthorized` unless the request carries `expected` as its bearer token.

    `what` names the API in the log line and the error ("admin API", "registration").
    """
    given = bearer_token(request)
    if given is not None and same_secret(given, expected):
        return
    reason = "no bearer token" if given is None else "wrong token"
    refuse(request, what, reason)
    raise Unauthorized(
        f"The {what} needs `Authorization: Bearer <token>` with the configured token ({reason})."
    )


def refuse(request: web.Request, what: str, reason: str, **fields: object) -> None:
    """Log one refused control request: who, where, why (no credentials)."""
    log.warning(
        "control request refused",
        api=what,
        peer=request.remote,
        method=request.method,
        path=request.path,
        reason=reason,
        **fields,
    )


class AllowedNetworks:
    """The networks and host names a registered worker URL may point into."""

    def __init__(
        self, networks: Iterable[str], hosts: Iterable[str] = (), resolve: Resolver = resolve_host
    ) -> None:
        self.resolve = resolve
        self.networks: tuple[IPNetwork, ...] = tuple(
            ipaddress.ip_network(n, strict=False) for n in networks
        )
        self.hosts = tuple(h.lower().rstrip(".") for h in hosts)

    def _host_listed(self, host: str) -> bool:
        for allowed in self.hosts:
            if allowed.startswith("*."):
                if host.endswith(allowed[1:]):
                    return True
            elif host == allowed:
                return True
        return False

    def _inside(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.networks)

    async def check(self, url: str) -> str | None:
        """Return why `url` may not be registered, or None when it may."""
        host = (urlsplit(url).hostname or "").lower().rstrip(".")
        if not host:
            return "the URL has no host"
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            pass
        else:
            if self._inside(host):
                return None
            return f"{host} is outside the allowed networks"
        if self._host_listed(host):
            return None
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_SECONDS):
                addresses = await self.resolve(host)
        except (OSError, TimeoutError) as e:
            return f"{host} does not resolve ({e.__class__.__name__})"
        outside = [a for a in addresses if not self._inside(a)]
        if not addresses or outside:
            where = ", ".join(outside) or "nothing"
            return f"{host} resolves to {where}, outside the allowed networks"
        return None


def is_loopback(address: str | None) -> bool:
    """Is `address` (a peer's IP, or a host setting) a loopback one? Unknown: no."""
    if not address:
        return False
    if address.lower().rstrip(".") == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


# Set by a process re-sending a client's control request to its siblings (siblings.py):
# "1" if that client was a local peer, "0" if not. Read only on a unix socket.
LOCAL_PEER_HEADER = "X-Gateway-Local-Peer"


def local_peer(request: web.Request) -> bool:
    """Did `request` come from this host: a loopback peer, or a unix socket (only the
    gateway's own processes reach those: siblings.py re-sends control requests on them)?

    A re-sent request is judged by the client of the process that re-sent it: otherwise a
    remote client refused by one process would be served by all its siblings."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family == socket.AF_UNIX:
        return request.headers.get(LOCAL_PEER_HEADER, "1") == "1"
    return is_loopback(request.remote)


def forbidden(request: web.Request, what: str, reason: str, **fields: object) -> Forbidden:
    """Log a refusal and return the 403 to raise."""
    refuse(request, what, reason, **fields)
    return Forbidden(f"The {what} refused this request: {reason}.")

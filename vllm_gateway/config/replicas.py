"""The `[replicas]` section: gateways in front of the same workers telling each other
where they placed which prompt (process/placement_feed.py), and its checks.

    parse_address("10.0.0.2:8101") -> ("10.0.0.2", 8101)     raises ValueError
    check_replicas(config.replicas) -> list[str]              the mistakes
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from vllm_gateway.config.settings import setting

# A token shorter than this is refused: it is all that keeps a stranger who can reach the
# port from filling the replicas' indexes with false placements.
MIN_TOKEN = 16
MAX_PEERS = 64  # listed peers, at most (each a connection from every process)
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


@dataclass(frozen=True, slots=True)
class ReplicasConfig:
    """Replicas of the gateway behind one load balancer, in front of the same workers."""

    listen: str = setting(
        "",
        "HOST:PORT where this gateway hears its peer replicas' placements (a TCP port of its "
        "own, not the API's; [::1]:PORT for IPv6). Empty: it hears none. Changes take "
        "effect at restart.",
        cli="--replica-listen",
    )
    peers: tuple[str, ...] = setting(
        (),
        "HOST:PORT of each peer replica's `listen`, told where this gateway placed each "
        "prompt, so a conversation's next turn finds its history whichever replica it "
        "reaches; a host name stands for every address it resolves to. One list for every "
        "replica may name this one too (at its `listen` address it finds itself and skips "
        "it). Changes take effect at restart.",
        cli="--peer",
    )
    token: str = setting(
        "",
        f"Shared secret every replica must present (at least {MIN_TOKEN} characters); "
        "required with `listen` or `peers`. Never sent: both sides of a connection prove "
        "it with an HMAC over fresh nonces, and tag every line.",
        secret=True,
    )

    @property
    def enabled(self) -> bool:
        return bool(self.listen or self.peers)


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[IPV6]:PORT`) as (host, port); ValueError says what is wrong. A
    host is an IP address or a DNS name (labels of letters, digits, '-' and '_', each 1-63
    long, not starting or ending with '-')."""
    text = text.strip()
    if "://" in text:
        raise ValueError(f"{text!r}: give HOST:PORT, not a URL")
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT")
    if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
        raise ValueError(f"{text!r}: the port must be a number from 0 to 65535")
    if host.startswith("["):
        try:
            if not host.endswith("]"):
                raise ValueError
            host = str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise ValueError(f"{text!r}: an IPv6 host goes in brackets, e.g. [::1]:8101") from None
    elif ":" in host:
        raise ValueError(f"{text!r}: put an IPv6 host in brackets, e.g. [::1]:8101")
    elif not all(_LABEL.fullmatch(label) for label in host.removesuffix(".").split(".")):
        raise ValueError(
            f"{text!r}: the host must be an address or a DNS name (labels of letters, "
            "digits, '-' and '_', 1-63 long)"
        )
    return host, int(port_text)


def check_replicas(replicas: ReplicasConfig) -> list[str]:
    """The mistakes in `[replicas]`, each naming its key."""
    errors: list[str] = []
    if replicas.listen:
        try:
            parse_address(replicas.listen)
        except ValueError as e:
            errors.append(f"replicas.listen: {e}")
    if len(replicas.peers) > MAX_PEERS:
        errors.append(f"replicas.peers: {len(replicas.peers)} listed, at most {MAX_PEERS}")
    for i, peer in enumerate(replicas.peers[:MAX_PEERS]):
        try:
            if parse_address(peer)[1] == 0:
                errors.append(f"replicas.peers[{i}]: {peer!r} has port 0")
        except ValueError as e:
            errors.append(f"replicas.peers[{i}]: {e}")
    if replicas.enabled and len(replicas.token) < MIN_TOKEN:
        errors.append(
            f"replicas.token: set a shared secret of at least {MIN_TOKEN} characters "
            "(VLLM_GATEWAY_REPLICAS_TOKEN) when replicas.listen or replicas.peers is set"
        )
    return errors

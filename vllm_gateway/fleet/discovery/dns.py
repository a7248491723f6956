"""DNS discovery: a host name that resolves to many addresses, each one a worker.

    [[discovery.dns]]
    url = "http://vllm.default.svc.cluster.local:8000"   # a Kubernetes headless Service

Every `discovery.interval` each name is resolved again. A new address becomes a worker
(source "dns", probed at once); an address that is gone is retired (`Fleet.retire`): drained,
so its requests in flight finish (a terminating pod leaves the Service's DNS answer while it
still serves), and removed when its last request ends; one that comes back before that is
taken back. A name that fails to resolve changes
nothing: a DNS hiccup must not empty the fleet. Several gateway replicas pointed at the
same name need no shared state: each resolves it and reads the same workers' /metrics.

A config reload gives the discovery its new names (`configure`, the `WorkerSource` seam);
workers of names no longer listed are retired the same way. Registered and admin-added workers are
never touched, even at an address a name resolves to.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from vllm_gateway.config.gateway import DiscoveryConfig, DnsName, GatewayConfig
from vllm_gateway.fleet.operations import Fleet
from vllm_gateway.fleet.periodic import Periodic
from vllm_gateway.log import get_logger
from vllm_gateway.workers import Source

log = get_logger("vllm_gateway.discovery")

SOURCE = Source.DNS
# Resolves (host, family) to its addresses; injectable so tests can script answers.
Resolver = Callable[[str, int], Awaitable[list[str]]]
FAMILIES = {"any": socket.AF_UNSPEC, "ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}
RESOLVE_TIMEOUT_SECONDS = 5.0


async def system_resolve(host: str, family: int) -> list[str]:
    """The addresses the system resolver gives for `host`."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, None, family=family, type=socket.SOCK_STREAM
    )
    return sorted({str(info[4][0]) for info in infos})


def worker_url(template: str, address: str) -> str:
    """`template` with its host replaced by `address` (bracketed when IPv6)."""
    parts = urlsplit(template)
    host = f"[{address}]" if ":" in address else address
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}"


class DnsDiscovery:
    """Keeps the workers of every configured DNS name in step with its addresses."""

    def __init__(
        self, fleet: Fleet, config: DiscoveryConfig, resolve: Resolver = system_resolve
    ) -> None:
        self.fleet = fleet
        self.registry = fleet.registry
        self.config = config
        self.resolve = resolve
        self.owned: dict[str, set[str]] = {}  # DNS name URL -> worker URLs it added
        self.failures = 0  # resolutions that failed (a name that stops resolving logs once)
        self._failing: set[str] = set()
        self._rounds = Periodic(
            "dns-discovery",
            self.refresh,
            lambda: self.config.interval,
            log,
            "DNS discovery round failed",
        )

    def configure(self, config: GatewayConfig) -> list[str]:
        """Take the names of a reloaded config; the next round applies them."""
        new = config.discovery
        if (new.interval, new.dns) == (self.config.interval, self.config.dns):
            return []
        self.config = new
        return ["discovery settings changed"]

    async def refresh(self) -> None:
        """One round: resolve every name, add the new addresses, retire the gone ones."""
        names = {n.url: n for n in self.config.dns}
        answers = await asyncio.gather(*(self._resolve(n) for n in names.values()))
        for (key, name), addresses in zip(names.items(), answers, strict=True):
            if addresses is None:
                continue  # keep what we have
            urls = {worker_url(name.url, a) for a in addresses}
            await self._sync(key, name, urls)
        for key in [k for k in self.owned if k not in names]:  # names no longer listed
            for url in self.owned.pop(key):
                self._retire(url, f"{urlsplit(key).hostname} is no longer configured")

    async def _resolve(self, name: DnsName) -> list[str] | None:
        host = urlsplit(name.url).hostname or ""
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_SECONDS):
                addresses = await self.resolve(host, FAMILIES[name.family])
        except (OSError, TimeoutError) as e:
            self.failures += 1
            if name.url not in self._failing:  # log when it starts failing, not every round
                self._failing.add(name.url)
                log.warning(
                    "DNS name does not resolve; keeping its workers", name=host, error=str(e)
                )
            return None
        if name.url in self._failing:
            self._failing.discard(name.url)
            log.info("DNS name resolves again", name=host, addresses=addresses)
        return addresses

    async def _sync(self, key: str, name: DnsName, urls: set[str]) -> None:
        owned = self.owned.setdefault(key, set())
        host = urlsplit(key).hostname
        joining: list[Awaitable[object]] = []
        for url in sorted(urls - owned):
            worker = self.registry.get(url)
            if worker is not None and worker.source != SOURCE:
                continue  # registered or added by an operator: its owner decides
            owned.add(url)
            if worker is None:
                joining.append(self.fleet.add(url, source=SOURCE, models=name.models))
            elif self.fleet.unretire(worker, f"back in {host}"):  # back before it was removed
                joining.append(self.fleet.probe(worker))
        await asyncio.gather(*joining)  # probed together: a new name may bring many
        for url in sorted(owned - urls):
            owned.discard(url)
            self._retire(url, f"no longer in {host}")

    def _retire(self, url: str, reason: str) -> None:
        worker = self.registry.get(url)
        if worker is None or worker.source != SOURCE:
            return
        if any(url in urls for urls in self.owned.values()):
            return  # another name still resolves to it
        self.fleet.retire(worker, reason)

    def workers(self) -> Iterable[str]:
        return sorted({u for urls in self.owned.values() for u in urls})

    async def start(self) -> None:
        if self.config.dns:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RESOLVE_TIMEOUT_SECONDS):
                    await self.refresh()  # serve with the names' workers known
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

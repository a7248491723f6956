"""DNS discovery: scripted answers (no network), and the system resolver on `localhost`."""

from __future__ import annotations

import socket
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.conftest import wait_until
from vllm_gateway.app import GATEWAY, REGISTRY, SOURCES
from vllm_gateway.config.gateway import DiscoveryConfig, DnsName, GatewayConfig, ReloadConfig
from vllm_gateway.fleet.discovery.dns import DnsDiscovery, worker_url
from vllm_gateway.fleet.health import ProbeResult
from vllm_gateway.fleet.operations import Fleet
from vllm_gateway.process.reload import apply_config
from vllm_gateway.workers import WorkerRegistry, WorkerState

pytestmark = pytest.mark.timeout(30)

NAME = "http://vllm.default.svc.cluster.local:8000"


class Prober:
    """Stands in for health.Prober: every probe passes, no request is made."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self.probed: list[str] = []

    def forget(self, url: str) -> None:
        pass

    async def probe_one(self, worker) -> ProbeResult:
        self.probed.append(worker.url)
        self.registry.set_models(worker, ["m"])
        self.registry.set_state(worker, WorkerState.READY, "probe passed")
        return ProbeResult(True, ["m"])


class Dns:
    """Scripted answers per host name; an exception to raise instead."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str] | Exception] = {}
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, family: int) -> list[str]:
        self.asked.append((host, family))
        answer = self.answers[host]
        if isinstance(answer, Exception):
            raise answer
        return answer


def setup(*names: str, family: str = "any"):
    registry = WorkerRegistry()
    dns = Dns()
    config = DiscoveryConfig(dns=tuple(DnsName(url=n, family=family) for n in names))
    discovery = DnsDiscovery(Fleet(registry, Prober(registry)), config, dns)  # type: ignore[arg-type]
    return registry, dns, discovery


def urls(registry: WorkerRegistry, state: WorkerState | None = None) -> list[str]:
    return sorted(w.url for w in registry if state is None or w.state is state)


def test_worker_urls_keep_scheme_and_port_and_bracket_ipv6():
    assert worker_url(NAME, "10.0.0.5") == "http://10.0.0.5:8000"
    assert worker_url("https://x.example", "fd00::7") == "https://[fd00::7]"


async def test_addresses_become_workers_and_gone_ones_drain_then_leave():
    registry, dns, discovery = setup(NAME)
    dns.answers["vllm.default.svc.cluster.local"] = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    await discovery.refresh()
    assert urls(registry, WorkerState.READY) == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
    ]
    assert {w.source for w in registry} == {"dns"}

    # 10.0.0.2 leaves while a request is in flight on it: drained, kept until idle.
    dns.answers["vllm.default.svc.cluster.local"] = ["10.0.0.1", "10.0.0.3", "10.0.0.4"]
    busy = registry.get("http://10.0.0.2:8000")
    busy.inflight = 1
    await discovery.refresh()
    assert busy.state is WorkerState.DRAINING and "no longer in" in busy.state_reason
    assert registry.get("http://10.0.0.4:8000").state is WorkerState.READY
    await discovery.refresh()
    assert registry.get(busy.url) is busy  # still finishing its request
    busy.inflight = 0  # its last request ends: the lease release removes it
    discovery.fleet.on_release(SimpleNamespace(worker=busy))  # type: ignore[arg-type]
    assert registry.get(busy.url) is None

    # A name that stops resolving changes nothing (a DNS hiccup must not empty the fleet).
    dns.answers["vllm.default.svc.cluster.local"] = OSError("SERVFAIL")
    await discovery.refresh()
    await discovery.refresh()
    assert len(urls(registry, WorkerState.READY)) == 3 and discovery.failures == 2

    # An address that comes back while draining is undrained.
    dns.answers["vllm.default.svc.cluster.local"] = ["10.0.0.1", "10.0.0.3"]
    w4 = registry.get("http://10.0.0.4:8000")
    w4.inflight = 2
    await discovery.refresh()
    assert w4.state is WorkerState.DRAINING
    dns.answers["vllm.default.svc.cluster.local"] = ["10.0.0.1", "10.0.0.3", "10.0.0.4"]
    await discovery.refresh()
    assert w4.state is WorkerState.READY and registry.get(w4.url) is w4


async def test_registered_and_admin_workers_are_never_touched_and_names_can_go():
    registry, dns, discovery = setup(NAME, "http://other.example:9000", family="ipv4")
    dns.answers["vllm.default.svc.cluster.local"] = ["10.0.0.1"]
    dns.answers["other.example"] = ["10.0.0.9"]
    registry.add("http://10.0.0.1:8000", source="registered")
    await discovery.refresh()
    assert {(w.url, w.source) for w in registry} == {
        ("http://10.0.0.1:8000", "registered"),
        ("http://10.0.0.9:9000", "dns"),
    }
    assert {family for _, family in dns.asked} == {socket.AF_INET}
    dns.answers["vllm.default.svc.cluster.local"] = []
    await discovery.refresh()
    assert registry.get("http://10.0.0.1:8000").state is WorkerState.JOINING  # untouched

    # A reload that drops a name retires its workers.
    discovery.configure(GatewayConfig(discovery=DiscoveryConfig(dns=(DnsName(url=NAME),))))
    await discovery.refresh()
    assert urls(registry) == ["http://10.0.0.1:8000"]


async def test_localhost_resolves_to_a_worker_that_serves(fake_worker, gateway, client):
    w = await fake_worker(models="m")
    name = DnsName(url=f"http://localhost:{w.port}", family="ipv4")
    gw = await gateway([], discovery=DiscoveryConfig(interval=0.2, dns=(name,)))
    registry = gw.app[REGISTRY]
    await wait_until(lambda: registry.get(w.url) is not None and registry.get(w.url).available)
    assert registry.get(w.url).source == "dns"
    answer = await client(gw).completions.create(model="m", prompt="x", max_tokens=1)
    assert answer.choices[0].text == " w0"

    # A reload without the name (its only source of workers: said to be meant) drains the
    # worker, then removes it.
    meant = ReloadConfig(allow_no_workers=True)
    changes = apply_config(
        gw.app, replace(gw.app[GATEWAY].config, discovery=DiscoveryConfig(), reload=meant)
    )
    assert changes == ["discovery settings changed"]
    await wait_until(lambda: registry.get(w.url) is None, timeout=5)
    (dns,) = (s for s in gw.app[SOURCES] if isinstance(s, DnsDiscovery))
    assert dns.workers() == []

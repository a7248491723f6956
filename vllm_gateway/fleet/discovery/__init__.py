"""Discovery sources: workers found by looking outside the gateway, one module each.

Each is a `WorkerSource` (fleet/sources.py) built from its `[discovery.*]` section;
`discovery_sources` is the one list `create_app` asks for, so a new source is a module
here, its section in config/fleet.py, and a line below.
"""

from __future__ import annotations

from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.fleet.discovery.dns import DnsDiscovery
from vllm_gateway.fleet.discovery.kubernetes import KubernetesDiscovery
from vllm_gateway.fleet.operations import Fleet
from vllm_gateway.fleet.sources import WorkerSource


def discovery_sources(fleet: Fleet, config: GatewayConfig) -> list[WorkerSource]:
    """Every discovery source, idle until its section names something to watch."""
    return [DnsDiscovery(fleet, config.discovery), KubernetesDiscovery(fleet, config.discovery)]

"""The `WorkerSource` seam, and the first source: the config file's own workers.

Workers come from several places, each the owner of its workers' lives (docs/fleet.md):

    source        module                          who retires its workers
    static        fleet/sources.StaticWorkers     a reload that no longer lists them
    registered    control/registration            its agent, missing heartbeats, an operator
    admin         control/admin                   an operator
    dns           fleet/discovery/dns             the name no longer resolving to them
    kubernetes    fleet/discovery/kubernetes      the EndpointSlice marking them terminating
                                                  (drained) or dropping them (retired)

Each is a `WorkerSource`: started and stopped with the app (`cleanup_ctx`, in order), given
its section of a reloaded configuration (`configure`), and writing only through `Fleet`
(add, drain, retire), so a worker leaves one way whatever its source. A source touches only
workers of its own `Source`: a registered or admin-added worker at an address a DNS name
resolves to stays the operator's.
"""

from __future__ import annotations

from typing import Protocol

from vllm_gateway.config.gateway import GatewayConfig, WorkerSpec
from vllm_gateway.config.load import normalize_url, worker_url_note
from vllm_gateway.fleet.operations import Fleet
from vllm_gateway.log import get_logger
from vllm_gateway.workers import Source

log = get_logger("vllm_gateway.fleet")

# Why a reload takes a static worker out (also the reason its removal is logged with).
DROPPED = "removed from the configuration"


class WorkerSource(Protocol):
    """Somewhere workers come from, with a life of its own beside the app's."""

    async def start(self) -> None:
        """Begin (the app is about to serve): find the first workers, start watching."""
        ...

    async def stop(self) -> None:
        """End every task of the source; its workers stay."""
        ...

    def configure(self, config: GatewayConfig) -> list[str]:
        """Follow a reloaded configuration; return what changed, one line each."""
        ...


class StaticWorkers:
    """The config file's workers (`[[workers]]`, `--worker`): added when the app is built,
    and on reload added, re-pinned or re-weighted, or retired."""

    def __init__(self, fleet: Fleet, config: GatewayConfig) -> None:
        self.fleet = fleet
        for spec in config.workers:
            if note := worker_url_note(spec.url):  # a copied OpenAI base URL: say so
                log.warning("worker URL normalized", problem=note)
            fleet.registry.add(
                normalize_url(spec.url),
                models=spec.models,
                weight=spec.weight,
                max_num_seqs=spec.max_num_seqs,
            )

    async def start(self) -> None:
        pass  # known from the start; the prober's first round looks at them

    async def stop(self) -> None:
        pass

    def configure(self, config: GatewayConfig) -> list[str]:
        """Retire the workers the config dropped, add or update the ones it lists. New
        workers are probed by the reload before READY (daemon.py), not here."""
        wanted = {normalize_url(spec.url): spec for spec in config.workers}
        changes: list[str] = []
        for worker in self.fleet.registry:
            if worker.source is Source.STATIC and worker.url not in wanted:
                inflight = worker.inflight
                if self.fleet.retire(worker, DROPPED):
                    changes.append(f"worker removed: {worker.url}")
                else:
                    changes.append(f"worker draining: {worker.url} ({inflight} in flight)")
        for url, spec in wanted.items():
            changes.extend(self._keep(url, spec))
        return changes

    def _keep(self, url: str, spec: WorkerSpec) -> list[str]:
        fleet = self.fleet
        worker = fleet.registry.get(url)
        if worker is None:
            fleet.registry.add(
                url, models=spec.models, weight=spec.weight, max_num_seqs=spec.max_num_seqs
            )
            fleet.prober.forget(url)
            return [f"worker added: {url}"]
        if worker.source is not Source.STATIC:
            return []  # known from elsewhere (registered, admin): its owner decides
        changes = []
        if fleet.unretire(worker, "back in the configuration"):  # dropped earlier, listed again
            changes.append(f"worker back: {url}")
        if fleet.registry.reconfigure(
            worker, models=spec.models, weight=spec.weight, max_num_seqs=spec.max_num_seqs
        ):
            changes.append(f"worker reconfigured: {url}")
        return changes

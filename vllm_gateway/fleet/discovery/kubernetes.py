"""Kubernetes discovery: the endpoints of a Service, watched through its EndpointSlices.

    [[discovery.kubernetes]]
    namespace = "vllm"
    service = "vllm-workers"
    port = "http"                # the Service port's name; the URL is http://ADDRESS:PORT

For each Service: LIST its EndpointSlices (`kubernetes.io/service-name={service}`), then
WATCH from the list's resourceVersion, with bookmarks, for as long as the gateway runs
(kube_api.py bounds every read). Each change is applied through `Fleet` at once:

- an endpoint that is **ready** joins (source "kubernetes", probed at once); one known and
  drained by us (it was terminating or not ready) comes back through joining and a probe;
- one **terminating** or **not ready** (`conditions.terminating`, `conditions.ready:
  false`) is drained at once: a pod being deleted says so here before its DNS record goes,
  so no new request is sent to a server about to stop; those in flight finish;
- one **gone** (its slice deleted, or no longer in it) is retired (`Fleet.retire`): drained
  and removed when its last request ends.

A lost watch resumes from the last resourceVersion seen (an event's or a bookmark's), so
nothing is missed and nothing is listed again. When that version is too old (410 Gone) the
Service is listed again and the fleet reconciled with the list — with one safe rule:
**a list never empties the fleet.** A list with no endpoint at all while the Service has
workers keeps them (logged): an empty answer after a lost watch is far more likely a
broken API server, cache or RBAC change than every pod gone at once, and the workers' own
probes still take dead ones out. Watch events (a slice deleted, an endpoint dropped) are
trusted, one change at a time. An API server that cannot be reached changes nothing.

Only workers of source "kubernetes" are touched: a registered or admin-added worker at an
endpoint's address stays its owner's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp

from vllm_gateway.config.gateway import DiscoveryConfig, GatewayConfig, KubernetesService
from vllm_gateway.errors import ConfigError
from vllm_gateway.fleet.discovery.kube_access import KubeAccess, from_kubeconfig, in_cluster
from vllm_gateway.fleet.discovery.kube_api import ApiError, Gone, KubeClient, Timing
from vllm_gateway.fleet.discovery.kube_api import resource_version as version_of
from vllm_gateway.fleet.operations import Fleet
from vllm_gateway.log import get_logger
from vllm_gateway.workers import Source, Worker

log = get_logger("vllm_gateway.discovery")

SOURCE = Source.KUBERNETES
SLICES = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
SERVICE_LABEL = "kubernetes.io/service-name"
MAX_SLICES = 1000  # per Service (each holds up to 1000 endpoints; 100 by default)
MAX_ENDPOINTS = 10_000  # per Service: beyond, endpoints are ignored (and that is logged)
FIRST_LIST_WAIT = 5.0  # start() waits this long for the first lists, then serves anyway


def slice_endpoints(obj: Mapping[str, Any], port_name: str, scheme: str) -> dict[str, bool]:
    """Worker URL -> ready?, for one EndpointSlice; anything malformed is skipped.

    Ready: `conditions.ready` true or absent (the API's "unknown, treat as ready") and not
    `conditions.terminating`. The URL: the endpoint's first address and the port named
    `port_name` (or the slice's only port when the name is empty).
    """
    port = _port(obj.get("ports"), port_name)
    endpoints = obj.get("endpoints")
    if port is None or not isinstance(endpoints, list):
        return {}
    out: dict[str, bool] = {}
    for endpoint in endpoints[:MAX_ENDPOINTS]:
        if not isinstance(endpoint, dict):
            continue
        addresses = endpoint.get("addresses")
        if not isinstance(addresses, list) or not addresses:
            continue
        host = _host(addresses[0])
        if host is None:
            continue
        conditions = endpoint.get("conditions")
        conditions = conditions if isinstance(conditions, dict) else {}
        ready = conditions.get("ready") is not False and conditions.get("terminating") is not True
        url = f"{scheme}://{host}:{port}"
        out[url] = out.get(url, False) or ready
    return out


def _port(ports: object, name: str) -> int | None:
    if not isinstance(ports, list):
        return None
    named = [p for p in ports if isinstance(p, dict) and (p.get("name") or "") == name]
    if not named and not name and len(ports) == 1 and isinstance(ports[0], dict):
        named = ports
    number = named[0].get("port") if named else None
    if isinstance(number, int) and not isinstance(number, bool) and 0 < number < 65536:
        return number
    return None


def _host(address: object) -> str | None:
    """An IP address, bracketed when IPv6; None for anything else (names included)."""
    if not isinstance(address, str) or len(address) > 64:
        return None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    return f"[{ip}]" if ip.version == 6 else str(ip)


class ServiceWatch:
    """One Service: its slices as last seen, kept in step with the fleet by list and watch."""

    def __init__(self, discovery: KubernetesDiscovery, entry: KubernetesService) -> None:
        self.discovery = discovery
        self.fleet = discovery.fleet
        self.entry = entry
        self.name = f"{entry.namespace or '?'}/{entry.service}"
        self.slices: dict[str, dict[str, bool]] = {}  # slice name -> its endpoints
        self.version = ""  # resourceVersion to watch from; "" until listed (or after 410)
        self.owned: set[str] = set()  # worker URLs this Service brought (or still lists)
        self.drained: set[str] = set()  # ... of which this watch drained (not ready)
        self.listed = asyncio.Event()  # the first list is applied
        self.lists = 0  # LISTs applied (the first, then one per 410)
        self.watches = 0  # WATCH requests made
        self.failures = 0  # API calls that failed
        self._failing = False  # since the last failure, nothing worked yet
        self._fresh = False  # no event since the last list

    # --- applying what the API server says ----------------------------------------------

    def apply_list(self, items: list[dict[str, Any]], version: str) -> None:
        """Replace every slice with a list's; the safe rule: never empty the fleet."""
        self.slices = {}
        for item in items[:MAX_SLICES]:
            with contextlib.suppress(ApiError):  # a malformed item is skipped, not fatal
                self._set_slice(item)
        self.version = version
        self.lists += 1
        self._fresh = True
        self.listed.set()
        if not self._wanted() and self.owned:
            log.warning(
                "EndpointSlice list has no endpoint; keeping the Service's workers until a "
                "watch event says otherwise",
                service=self.name,
                workers=len(self.owned),
            )
            return
        self.reconcile()

    def apply_event(self, kind: str, obj: dict[str, Any]) -> None:
        """One watch event: a slice added, modified or deleted, or a bookmark."""
        version = version_of(obj)
        self._fresh = False
        if kind in ("ADDED", "MODIFIED"):
            if len(self.slices) < MAX_SLICES or _name(obj) in self.slices:
                self._set_slice(obj)
                self.reconcile()
        elif kind == "DELETED" and self.slices.pop(_name(obj), None) is not None:
            self.reconcile()
        self.version = version  # BOOKMARK and unknown types: just the version

    def _set_slice(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata")
        labels = meta.get("labels") if isinstance(meta, dict) else None
        if not isinstance(labels, dict) or labels.get(SERVICE_LABEL) != self.entry.service:
            return  # not this Service's (an answer we did not ask for), or malformed
        self.slices[_name(obj)] = slice_endpoints(obj, self.entry.port, self.entry.scheme)

    def _wanted(self) -> dict[str, bool]:
        wanted: dict[str, bool] = {}
        for endpoints in self.slices.values():
            for url, ready in endpoints.items():
                if len(wanted) >= MAX_ENDPOINTS and url not in wanted:
                    break
                wanted[url] = wanted.get(url, False) or ready
        return wanted

    def reconcile(self) -> None:
        """Bring this Service's workers in line with its slices as they are now."""
        wanted = self._wanted()
        for url, ready in sorted(wanted.items()):
            worker = self.fleet.registry.get(url)
            if worker is not None and worker.source is not SOURCE:
                continue  # registered or added by an operator: its owner decides
            if ready:
                self.owned.add(url)
                self._ready(url, worker)
            elif worker is not None:
                self.owned.add(url)
                reason = f"not ready in the EndpointSlices of {self.name}"
                if self.fleet.drain(worker, reason):
                    self.drained.add(url)
        for url in sorted(self.owned - wanted.keys()):
            self.owned.discard(url)
            self.drained.discard(url)
            self.discovery.retire(url, f"gone from the EndpointSlices of {self.name}")

    def _ready(self, url: str, worker: Worker | None) -> None:
        fleet = self.fleet
        if worker is None:
            worker, _ = fleet.registry.add(url, models=self.entry.models, source=SOURCE)
            fleet.prober.forget(url)
        elif url in self.drained or url in fleet.retiring:  # drained or retired by us: back
            self.drained.discard(url)
            if not fleet.rejoin(worker, f"ready in the EndpointSlices of {self.name}"):
                return
        else:
            return
        self.discovery.probe_soon(worker)

    # --- the API calls --------------------------------------------------------------------

    async def run(self) -> None:
        """List, then watch, resuming or relisting as needed, until cancelled."""
        timing = self.discovery.timing
        backoff = timing.backoff_min
        client: KubeClient | None = None
        while True:
            try:
                client = client or self.discovery.client(self.entry)
                await self._list_and_watch(client)
                backoff = timing.backoff_min  # the server ended the watch: resume shortly
            except Gone as e:
                self.version = ""
                if not self._fresh:  # expired while we were away: list again at once
                    log.info("EndpointSlice watch expired (410); listing again", service=self.name)
                    continue
                self._failed(e)  # 410 right after a list: back off as from any failure
            except (ApiError, ConfigError, aiohttp.ClientError, TimeoutError, OSError) as e:
                self._failed(e)
            except (ValueError, TypeError, KeyError, AttributeError) as e:  # a malformed answer
                self._failed(e)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, timing.backoff_max)

    def _failed(self, error: Exception) -> None:
        self.failures += 1
        if not self._failing:  # logged when it starts failing, not at every retry
            self._failing = True
            log.warning(
                "EndpointSlice watch failed; keeping the Service's workers, retrying",
                service=self.name,
                error=f"{type(error).__name__}: {error}"[:300],
            )

    def _working(self) -> None:
        if self._failing:
            self._failing = False
            log.info("EndpointSlice watch works again", service=self.name)

    async def _list_and_watch(self, client: KubeClient) -> None:
        namespace = self.entry.namespace or client.access.namespace or "default"
        self.name = f"{namespace}/{self.entry.service}"
        path = SLICES.format(namespace=namespace)
        selector = f"{SERVICE_LABEL}={self.entry.service}"
        if not self.version:
            items, version = await client.list(path, selector)
            self.apply_list(items, version)
            self._working()
        self.watches += 1
        async for kind, obj in client.watch(path, selector, self.version):
            self.apply_event(kind, obj)
            self._working()
        # The server ended the watch (timeoutSeconds): the caller pauses, then resumes.


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name or len(name) > 253:
        raise ApiError("an EndpointSlice without a usable name")
    return name


class KubernetesDiscovery:
    """The `WorkerSource` of `[[discovery.kubernetes]]`: one `ServiceWatch` per Service."""

    def __init__(self, fleet: Fleet, config: DiscoveryConfig, timing: Timing | None = None):
        self.fleet = fleet
        self.services = config.kubernetes
        self.timing = timing or Timing()
        self.watches: dict[KubernetesService, ServiceWatch] = {}
        self._tasks: dict[KubernetesService, asyncio.Task[None]] = {}
        self._ending: set[asyncio.Task[None]] = set()
        self._probes: set[asyncio.Task[object]] = set()
        self._session: aiohttp.ClientSession | None = None  # made at the first API call
        self._access: dict[str, KubeAccess] = {}
        self._started = False

    def client(self, entry: KubernetesService) -> KubeClient:
        """A client for `entry`'s API server (its kubeconfig, or the pod's account)."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        access = self._access.get(entry.kubeconfig)
        if access is None:
            access = from_kubeconfig(entry.kubeconfig) if entry.kubeconfig else in_cluster()
            self._access[entry.kubeconfig] = access
        return KubeClient(access, self._session, self.timing)

    def retire(self, url: str, reason: str) -> None:
        """Retire a worker no Service of this source lists any more."""
        if any(url in watch.owned for watch in self.watches.values()):
            return  # another Service still lists it
        worker = self.fleet.registry.get(url)
        if worker is not None and worker.source is SOURCE:
            self.fleet.retire(worker, reason)

    def probe_soon(self, worker: Worker) -> None:
        """Probe a worker that just joined or came back, without holding up the watch."""
        task = asyncio.create_task(self.fleet.probe(worker))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def workers(self) -> Iterable[str]:
        return sorted({url for watch in self.watches.values() for url in watch.owned})

    # --- WorkerSource ---------------------------------------------------------------------

    async def start(self) -> None:
        """Watch every Service; serve once their first lists (and probes) are in, or 5 s."""
        self._started = True
        self._sync()
        if self.watches:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FIRST_LIST_WAIT):
                    await asyncio.gather(*(w.listed.wait() for w in self.watches.values()))
                    if self._probes:
                        await asyncio.wait(self._probes)

    async def stop(self) -> None:
        """End every watch and probe; the workers stay."""
        self._started = False
        tasks = [*self._tasks.values(), *self._ending, *self._probes]
        self._tasks.clear()
        self.watches.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def configure(self, config: GatewayConfig) -> list[str]:
        """Follow the reloaded `[[discovery.kubernetes]]` tables: new Services watched,
        dropped ones' workers retired."""
        new = config.discovery.kubernetes
        if new == self.services:
            return []
        self.services = new
        if self._started:
            self._sync()
        return ["kubernetes discovery settings changed"]

    def _sync(self) -> None:
        for entry in [e for e in self.watches if e not in self.services]:
            watch = self.watches.pop(entry)
            task = self._tasks.pop(entry)
            task.cancel()
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)
            for url in sorted(watch.owned):
                self.retire(url, f"{watch.name} is no longer configured")
        for entry in self.services:
            if entry not in self.watches:
                watch = self.watches[entry] = ServiceWatch(self, entry)
                self._tasks[entry] = asyncio.create_task(
                    watch.run(), name=f"kubernetes-discovery {entry.service}"
                )

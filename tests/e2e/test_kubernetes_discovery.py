"""Kubernetes discovery against a fake API server on loopback: list, watch, resume, relist."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from tests.conftest import wait_until
from tests.support.fake_kube import FakeKubeApi, endpoint
from vllm_gateway.app import GATEWAY, REGISTRY, SOURCES
from vllm_gateway.config.gateway import DiscoveryConfig, KubernetesService, ReloadConfig
from vllm_gateway.fleet.discovery import kube_api
from vllm_gateway.fleet.discovery.kube_api import Timing
from vllm_gateway.fleet.discovery.kubernetes import KubernetesDiscovery
from vllm_gateway.fleet.health import ProbeResult
from vllm_gateway.fleet.operations import Fleet
from vllm_gateway.process.reload import apply_config
from vllm_gateway.workers import WorkerRegistry, WorkerState

pytestmark = pytest.mark.timeout(30)

SERVICE = "vllm-workers"
FAST = Timing(connect=2, list_timeout=5, watch_seconds=30, silence=10, backoff_min=0.02)


class Prober:
    """Stands in for health.Prober: every probe passes, no request is made."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    def forget(self, url: str) -> None:
        pass

    async def probe_one(self, worker) -> ProbeResult:
        self.registry.set_models(worker, ["m"])
        self.registry.set_state(worker, WorkerState.READY, "probe passed")
        return ProbeResult(True, ["m"])


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    server = FakeKubeApi(token="s3cret")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def watching(api, tmp_path):
    """(registry, discovery) watching SERVICE through a kubeconfig for `api`; stopped after."""
    made = []

    async def make():
        entry = KubernetesService(
            service=SERVICE, port="http", kubeconfig=api.kubeconfig(tmp_path / "kubeconfig")
        )
        registry = WorkerRegistry()
        fleet = Fleet(registry, Prober(registry))  # type: ignore[arg-type]
        discovery = KubernetesDiscovery(fleet, DiscoveryConfig(kubernetes=(entry,)), FAST)
        await discovery.start()
        made.append(discovery)
        (watch,) = discovery.watches.values()
        return registry, discovery, watch

    yield make
    for discovery in made:
        await discovery.stop()


def urls(registry: WorkerRegistry, state: WorkerState | None = None) -> list[str]:
    return sorted(w.url for w in registry if state is None or w.state is state)


def watched_from(api: FakeKubeApi) -> list[str]:
    return [q["resourceVersion"] for kind, q in api.requests if kind == "watch"]


async def test_ready_joins_terminating_drains_at_once_deleted_is_retired(api, watching):
    api.put_slice(
        "s1",
        SERVICE,
        [endpoint("10.0.0.1"), endpoint("10.0.0.2"), endpoint("10.0.0.3", ready=False)],
    )
    api.put_slice("other", "another-service", [endpoint("10.0.0.9")])
    registry, discovery, watch = await watching()
    # Listed before start() returned: the ready endpoints are workers, probed, serving.
    assert urls(registry, WorkerState.READY) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert {w.source for w in registry} == {"kubernetes"}
    assert api.requests[0][1]["labelSelector"] == f"kubernetes.io/service-name={SERVICE}"

    # 10.0.0.2's pod is being deleted while a request is in flight on it: drained at once.
    busy = registry.get("http://10.0.0.2:8000")
    busy.inflight = 1
    api.put_slice(
        "s1",
        SERVICE,
        [
            endpoint("10.0.0.1"),
            endpoint("10.0.0.2", ready=False, terminating=True),
            endpoint("10.0.0.3"),  # ready now: joins
        ],
    )
    await wait_until(lambda: busy.state is WorkerState.DRAINING)
    assert "not ready" in busy.state_reason
    await wait_until(
        lambda: (
            urls(registry, WorkerState.READY) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
        )
    )

    # Gone from the slice: retired, so kept until its last request ends.
    api.put_slice("s1", SERVICE, [endpoint("10.0.0.1"), endpoint("10.0.0.3")])
    await wait_until(lambda: busy.url in discovery.fleet.retiring)
    assert registry.get(busy.url) is busy
    busy.inflight = 0
    discovery.fleet.on_release(SimpleNamespace(worker=busy))  # type: ignore[arg-type]
    assert registry.get(busy.url) is None

    # The slice deleted: its idle workers leave at once.
    api.delete_slice("s1")
    await wait_until(lambda: len(registry) == 0)
    assert watch.lists == 1 and discovery.workers() == []


async def test_not_ready_then_ready_again_comes_back_through_a_probe(api, watching):
    api.put_slice("s1", SERVICE, [endpoint("10.0.0.1")])
    registry, _, _ = await watching()
    w = registry.get("http://10.0.0.1:8000")
    api.put_slice("s1", SERVICE, [endpoint("10.0.0.1", ready=False)])  # failing readiness
    await wait_until(lambda: w.state is WorkerState.DRAINING)
    api.put_slice("s1", SERVICE, [endpoint("10.0.0.1")])
    await wait_until(lambda: w.state is WorkerState.READY)
    assert registry.get(w.url) is w


async def test_a_dropped_watch_resumes_from_its_resource_version(api, watching):
    api.put_slice("s1", SERVICE, [endpoint("10.0.0.1")])
    registry, _, watch = await watching()
    api.put_slice("s1", SERVICE, [endpoint("10.0.0.1"), endpoint("10.0.0.2")])
    await wait_until(lambda: len(registry) == 2)
    seen = watch.version
    refused = api.refuse = 3  # the next reconnections fail: the watch backs off and retries
    api.drop_watches()
    api.put_slice("s1", SERVICE, [endpoint("10.0.0.2"), endpoint("10.0.0.3")])  # while away
    await wait_until(lambda: urls(registry) == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
    # The drop and each refused reconnection failed; then resumed, never listed again.
    assert watch.lists == 1 and watch.failures == 1 + refused
    assert watched_from(api)[-1] == seen

    # A bookmark moves the version on without a change; a drop resumes from there.
    api.bookmark()
    await wait_until(lambda: watch.version == str(api.version))
    api.drop_watches()
    await wait_until(lambda: watched_from(api)[-1] == str(api.version))
    assert watch.lists == 1


async def test_410_relists_and_a_list_never_empties_the_fleet(api, watching, logs):
    api.put_slice("s1", SERVICE, [endpoint("10.0.0.1"), endpoint("10.0.0.2")])
    registry, _, watch = await watching()
    busy = registry.get("http://10.0.0.1:8000")
    busy.inflight = 1

    # Away long enough for the history to be compacted: 410, list again, reconcile.
    api.refuse = 10**6
    api.drop_watches()
    api.put_slice("s1", SERVICE, [endpoint("10.0.0.2"), endpoint("10.0.0.3")])
    api.compact()
    await wait_until(lambda: watch.failures >= 1)
    api.refuse = 0
    await wait_until(lambda: watch.lists == 2)
    await wait_until(lambda: registry.get("http://10.0.0.3:8000") is not None)
    assert busy.state is WorkerState.DRAINING and busy.url in urls(registry)  # retired, busy
    assert registry.get("http://10.0.0.2:8000").state is WorkerState.READY

    # A relist that answers nothing while the Service has workers: they stay.
    api.empty_lists = True
    api.compact()
    api.drop_watches()
    await wait_until(lambda: watch.lists == 3)
    assert urls(registry, WorkerState.READY) == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    assert any("no endpoint" in r["event"] for r in logs.records())
    # ... until a watch event says otherwise.
    api.put_slice("s1", SERVICE, [endpoint("10.0.0.3")])
    await wait_until(lambda: registry.get("http://10.0.0.2:8000") is None)


async def test_malformed_or_oversized_answers_keep_the_workers(api, watching, monkeypatch):
    monkeypatch.setattr(kube_api, "MAX_EVENT_BYTES", 4096)
    api.put_slice("s1", SERVICE, [endpoint("10.0.0.1")])
    registry, _, watch = await watching()
    bad = [
        b"not json\n",
        b"[1, 2]\n",
        b'{"type": "MODIFIED", "object": {"metadata": "nonsense"}}\n',
        b'{"type": "MODIFIED", "object": {"metadata": {"resourceVersion": 7}}}\n',
        b'{"type": "ERROR", "object": {"code": 500, "message": "x"}}\n',
        b'{"type": "MODIFIED", "object": {"metadata": {"name": "' + b"x" * 8192,
    ]
    for i, data in enumerate(bad):
        await wait_until(lambda: len(api._watchers) == 1)
        api.push_raw(data)
        await wait_until(lambda n=i: watch.failures > n)
    assert urls(registry, WorkerState.READY) == ["http://10.0.0.1:8000"]
    assert watch.lists == 1  # each time resumed from the last good resourceVersion

    monkeypatch.setattr(kube_api, "MAX_LIST_BYTES", 100)  # a list too large: kept, retried
    api.compact()
    api.drop_watches()
    failures = watch.failures
    await wait_until(lambda: watch.failures >= failures + 2)
    assert urls(registry, WorkerState.READY) == ["http://10.0.0.1:8000"]


async def test_a_gateway_serves_the_services_endpoints(api, tmp_path, fake_worker, gateway, client):
    w = await fake_worker(models="m")
    api.port_number = w.port
    api.put_slice("s1", SERVICE, [endpoint("127.0.0.1")])
    entry = KubernetesService(
        service=SERVICE, port="http", kubeconfig=api.kubeconfig(tmp_path / "kubeconfig")
    )
    gw = await gateway([], discovery=DiscoveryConfig(kubernetes=(entry,)))
    registry = gw.app[REGISTRY]
    await wait_until(lambda: registry.get(w.url) is not None and registry.get(w.url).available)
    assert registry.get(w.url).source == "kubernetes"
    answer = await client(gw).completions.create(model="m", prompt="x", max_tokens=1)
    assert answer.choices[0].text == " w0"

    # A reload without the Service retires its workers (idle: removed at once). It was the
    # only source of workers, so the file says that is meant.
    config = gw.app[GATEWAY].config
    meant = ReloadConfig(allow_no_workers=True)
    new = dataclasses.replace(config, discovery=DiscoveryConfig(), reload=meant)
    assert apply_config(gw.app, new) == ["kubernetes discovery settings changed"]
    assert registry.get(w.url) is None
    (k8s,) = (s for s in gw.app[SOURCES] if isinstance(s, KubernetesDiscovery))
    assert k8s.watches == {}

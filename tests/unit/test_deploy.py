"""deploy/: the Kubernetes manifests hang together, and their gateway config is valid."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest
import yaml

from vllm_gateway.app import check_app_config
from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.config.load import load_config
from vllm_gateway.process.daemon import CLOSE_REST_SECONDS

K8S = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "kubernetes")
VARIANT = os.path.join(K8S, "endpointslices")  # the gateway watching EndpointSlices


def manifests(root: str = K8S) -> dict[tuple[str, str], dict]:
    """(kind, name) -> object, as `kubectl kustomize root` builds them: every resource the
    kustomization lists (a directory is another kustomization), then its patches merged."""
    with open(os.path.join(root, "kustomization.yaml")) as f:
        kustomization = yaml.safe_load(f)
    files = {n for n in os.listdir(root) if n.endswith(".yaml")} - {"kustomization.yaml"}
    patches = [p["path"] for p in kustomization.get("patches", ())]
    listed = [r for r in kustomization["resources"] if r.endswith(".yaml")]
    assert sorted(listed + patches) == sorted(files)  # no file forgotten
    out: dict[tuple[str, str], dict] = {}
    for name in kustomization["resources"]:
        path = os.path.join(root, name)
        if os.path.isdir(path):
            out.update(manifests(path))
            continue
        with open(path) as f:
            out.update(((d["kind"], d["metadata"]["name"]), d) for d in yaml.safe_load_all(f))
    for name in patches:
        with open(os.path.join(root, name)) as f:
            for patch in yaml.safe_load_all(f):
                key = (patch["kind"], patch["metadata"]["name"])
                assert key in out, f"{name} patches {key}, which is not there"
                _merge(out[key], patch)
    return out


def _merge(into: dict, patch: dict) -> None:
    """A strategic merge patch, for maps (enough for these patches)."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def gateway_config(m: dict[tuple[str, str], dict], tmp_path) -> GatewayConfig:
    path = tmp_path / "gateway.toml"
    path.write_text(m[("ConfigMap", "vllm-gateway")]["data"]["gateway.toml"])
    config = load_config(path, env={})
    check_app_config(config)
    return config


def test_headless_service_lists_the_worker_pods():
    m = manifests()
    svc = m[("Service", "vllm-workers")]
    sts = m[("StatefulSet", "vllm")]
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == "vllm-workers"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()


def test_gateway_config_is_valid_and_points_at_the_headless_service(tmp_path):
    if "discovery" not in {f.name for f in dataclasses.fields(GatewayConfig)}:
        pytest.skip("DNS discovery ([[discovery.dns]]) is not in this build yet")
    m = manifests()
    config = gateway_config(m, tmp_path)
    assert config.discovery.kubernetes == ()
    (name,) = config.discovery.dns
    url = urlsplit(name.url)
    svc = m[("Service", "vllm-workers")]
    assert url.hostname == f"vllm-workers.{svc['metadata']['namespace']}.svc.cluster.local"
    assert url.port == svc["spec"]["ports"][0]["port"]


def test_the_endpointslice_variant_watches_the_workers_service_with_just_enough_rbac(tmp_path):
    m = manifests(VARIANT)
    config = gateway_config(m, tmp_path)
    assert config.discovery.dns == ()
    (watched,) = config.discovery.kubernetes
    svc = m[("Service", "vllm-workers")]
    assert (watched.namespace, watched.service) == (svc["metadata"]["namespace"], "vllm-workers")
    assert watched.port in {p["name"] for p in svc["spec"]["ports"]}
    assert not watched.kubeconfig  # the pod's service account

    pod = m[("Deployment", "vllm-gateway")]["spec"]["template"]["spec"]
    account = m[("ServiceAccount", pod["serviceAccountName"])]
    assert pod.get("automountServiceAccountToken", True)
    (binding,) = [d for (kind, _), d in m.items() if kind == "RoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "vllm"}
    ]
    role = m[("Role", binding["roleRef"]["name"])]
    assert role["metadata"]["namespace"] == watched.namespace
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    # Everything else is the DNS variant's: same workers, same gateway pods otherwise.
    base = manifests()
    assert m.keys() - base.keys() == {
        ("ServiceAccount", "vllm-gateway"),
        ("Role", "vllm-gateway-endpointslices"),
        ("RoleBinding", "vllm-gateway-endpointslices"),
    }
    assert m[("StatefulSet", "vllm")] == base[("StatefulSet", "vllm")]


@pytest.mark.parametrize("root", [K8S, VARIANT])
def test_gateway_pods_stop_gracefully_and_are_probed_on_served_paths(root):
    m = manifests(root)
    dep = m[("Deployment", "vllm-gateway")]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cm = m[("ConfigMap", "vllm-gateway")]["data"]["gateway.toml"]
    shutdown = float(cm.split("shutdown_timeout = ")[1].split()[0])
    pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + shutdown + CLOSE_REST_SECONDS
    assert c["readinessProbe"]["httpGet"]["path"] == "/stats"
    mount = next(v for v in c["volumeMounts"] if v["name"] == "config")["mountPath"]
    assert c["args"] == ["serve", "--config", f"{mount}/gateway.toml"]
    svc = m[("Service", "vllm-gateway")]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


async def test_the_readiness_path_answers_without_workers(gateway, http):
    gw = await gateway(workers=())
    async with http.get(gw.url + "/stats") as r:
        assert r.status == 200  # /health would be 503 here, taking every replica out


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl not installed")
@pytest.mark.parametrize("root", [K8S, VARIANT])
def test_kustomize_renders(root):
    r = subprocess.run(["kubectl", "kustomize", root], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout)}
    assert rendered == manifests(root)  # the emulation above builds what kustomize builds

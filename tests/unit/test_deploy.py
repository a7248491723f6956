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


def manifests() -> dict[tuple[str, str], dict]:
    """(kind, name) -> object, over every file the kustomization lists."""
    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        files = yaml.safe_load(f)["resources"]
    assert sorted(files) == sorted(n for n in os.listdir(K8S) if n != "kustomization.yaml")
    out = {}
    for name in files:
        with open(os.path.join(K8S, name)) as f:
            for doc in yaml.safe_load_all(f):
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


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
    path = tmp_path / "gateway.toml"
    path.write_text(m[("ConfigMap", "vllm-gateway")]["data"]["gateway.toml"])
    config = load_config(path, env={})
    check_app_config(config)
    (name,) = config.discovery.dns
    url = urlsplit(name.url)
    svc = m[("Service", "vllm-workers")]
    assert url.hostname == f"vllm-workers.{svc['metadata']['namespace']}.svc.cluster.local"
    assert url.port == svc["spec"]["ports"][0]["port"]


def test_gateway_pods_stop_gracefully_and_are_probed_on_served_paths():
    m = manifests()
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
def test_kustomize_renders():
    r = subprocess.run(["kubectl", "kustomize", K8S], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\nkind: ") + r.stdout.startswith("kind: ") >= 6

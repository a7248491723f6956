"""Kubernetes discovery's pure parts: EndpointSlices read as untrusted input, kubeconfig
and service-account access, the [[discovery.kubernetes]] section."""

from __future__ import annotations

import os

import pytest
import yaml

from vllm_gateway.config.load import load_config
from vllm_gateway.errors import ConfigError
from vllm_gateway.fleet.discovery.kube_access import from_kubeconfig, in_cluster, read_yaml
from vllm_gateway.fleet.discovery.kubernetes import slice_endpoints


def test_the_api_servers_answers_are_untrusted():
    port = [{"name": "http", "port": 8000}]
    assert slice_endpoints({"ports": port, "endpoints": "x"}, "http", "http") == {}
    assert slice_endpoints({"ports": "x"}, "http", "http") == {}
    junk = [
        None,
        {"addresses": "10.0.0.1"},
        {"addresses": []},
        {"addresses": ["not-an-ip"]},
        {"addresses": ["169.254.0.1" * 10]},
        {"addresses": [7]},
        {"addresses": ["fd00::7"], "conditions": "x"},
        {"addresses": ["10.0.0.8"], "conditions": {"ready": None, "terminating": False}},
    ]
    got = slice_endpoints({"ports": port, "endpoints": junk}, "http", "https")
    assert got == {"https://[fd00::7]:8000": True, "https://10.0.0.8:8000": True}
    for bad_port in (0, 70000, "8000", True, None):
        doc = {"ports": [{"name": "http", "port": bad_port}], "endpoints": junk}
        assert slice_endpoints(doc, "http", "http") == {}
    # An unnamed single port serves an empty port name; a wrong name matches nothing.
    doc = {"ports": [{"port": 9000}], "endpoints": [{"addresses": ["10.0.0.1"]}]}
    assert slice_endpoints(doc, "", "http") == {"http://10.0.0.1:9000": True}
    assert slice_endpoints(doc, "grpc", "http") == {}


def test_kubeconfig_and_service_account(tmp_path):
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "b",
        "clusters": [
            {"name": "a", "cluster": {"server": "https://a.example:6443"}},
            {
                "name": "b",
                "cluster": {"server": "https://10.0.0.1:6443/", "insecure-skip-tls-verify": True},
            },
        ],
        "contexts": [{"name": "b", "context": {"cluster": "b", "user": "u", "namespace": "ns"}}],
        "users": [{"name": "u", "user": {"token": "tok: # not a comment"}}],
        "preferences": {},
    }
    for indent in (2, 4):
        text = yaml.safe_dump(doc, indent=indent)
        assert read_yaml(text) == doc, text
        (tmp_path / "config").write_text(text)
        access = from_kubeconfig(str(tmp_path / "config"))
        assert (access.server, access.namespace) == ("https://10.0.0.1:6443", "ns")
        assert access.headers() == {"Authorization": "Bearer tok: # not a comment"}
        assert access.insecure and access.ssl_context() is not None
    (tmp_path / "bad").write_text("current-context: nowhere\n")
    with pytest.raises(ConfigError, match="no context named"):
        from_kubeconfig(str(tmp_path / "bad"))
    with pytest.raises(ValueError):
        read_yaml("a: &anchor x\n")

    sa = tmp_path / "sa"
    sa.mkdir()
    with pytest.raises(ConfigError, match="not in a pod"):
        in_cluster(env={}, root=str(sa))
    (sa / "token").write_text("first\n")
    (sa / "namespace").write_text("vllm")
    access = in_cluster(env={"KUBERNETES_SERVICE_HOST": "fd00::1"}, root=str(sa))
    assert (access.server, access.namespace) == ("https://[fd00::1]:443", "vllm")
    assert access.ca_file == os.path.join(str(sa), "ca.crt")
    (sa / "token").write_text("rotated\n")  # bound tokens rotate: read at every connection
    assert access.headers() == {"Authorization": "Bearer rotated"}


def test_config_section_is_declared_and_checked(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[[discovery.kubernetes]]\nnamespace = "vllm"\nservice = "vllm-workers"\nport = "http"\n'
    )
    (entry,) = load_config(path, env={}).discovery.kubernetes
    assert (entry.namespace, entry.service, entry.port, entry.scheme) == (
        "vllm",
        "vllm-workers",
        "http",
        "http",
    )
    path.write_text('[[discovery.kubernetes]]\nservice = "Not_A_Name"\nport = "h" \n')
    with pytest.raises(ConfigError, match=r"discovery.kubernetes\[0\].service"):
        load_config(path, env={})

"""The systemd unit and the example configuration shipped in packaging/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from vllm_gateway.app import check_app_config
from vllm_gateway.config.gateway import LifecycleConfig
from vllm_gateway.config.load import load_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "packaging")
UNIT = os.path.join(ROOT, "systemd", "vllm-gateway.service")


def unit_settings() -> dict[str, list[str]]:
    """KEY -> values (a key may repeat), over all sections."""
    out: dict[str, list[str]] = {}
    section = ""
    with open(UNIT) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("["):
                section = line
                continue
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    assert section == "[Install]"
    return out


def test_unit_is_a_notify_service_with_reload_secrets_and_hardening():
    s = unit_settings()
    assert s["Type"] == ["notify"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert "--config /etc/vllm-gateway/gateway.toml" in s["ExecStart"][0]
    assert s["EnvironmentFile"] == ["-/etc/vllm-gateway/env"]
    for key, value in {
        "DynamicUser": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": "",
        "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX AF_NETLINK",
    }.items():
        assert s[key] == [value], key
    assert "@system-service" in s["SystemCallFilter"]
    # systemd must wait longer than the gateway's own shutdown grace.
    stop = float(s["TimeoutStopSec"][0].rstrip("s"))
    assert stop > LifecycleConfig().shutdown_timeout + 5
    assert float(s["WatchdogSec"][0].rstrip("s")) >= 10


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart exists: point it at this environment's entry point.
    exe = shutil.which("vllm-gateway", path=os.path.dirname(sys.executable))
    assert exe, "vllm-gateway is not installed in this environment"
    with open(UNIT) as f:
        text = f.read().replace("/opt/vllm-gateway/bin/vllm-gateway", exe)
    unit = tmp_path / "vllm-gateway.service"
    unit.write_text(text)
    r = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    complaints = [line for line in (r.stdout + r.stderr).splitlines() if "vllm-gateway" in line]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr


def test_example_config_is_valid():
    config = load_config(os.path.join(ROOT, "gateway.toml"), env={})
    check_app_config(config)
    assert config.workers and config.log.format == "json"


def test_env_example_names_real_settings():
    from vllm_gateway.config.load import ENV_PREFIX, describe

    names = {row[5] for row in describe() if row[5]}
    with open(os.path.join(ROOT, "systemd", "env.example")) as f:
        for line in f:
            line = line.strip().lstrip("#")
            if line.startswith(ENV_PREFIX):
                assert line.split("=")[0] in names, line


ALERTS = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "prometheus")


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed (Prometheus)")
def test_sample_alerts_are_valid_and_fire_as_tested():
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        r = subprocess.run(
            ["promtool", *args], cwd=ALERTS, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stdout + r.stderr


async def test_sample_alerts_use_series_the_gateway_exports(gateway, http):
    import re

    gw = await gateway(workers=())
    async with http.get(gw.url + "/metrics") as resp:
        exported = set(re.findall(r"^# TYPE (\w+) ", await resp.text(), re.M))
    with open(os.path.join(ALERTS, "alerts.yml")) as f:
        used = set(re.findall(r"\b(vllm_gateway_\w+)", f.read()))
    for name in used:
        family = re.sub(r"_(bucket|count|sum)$", "", name)
        assert name in exported or family in exported, name

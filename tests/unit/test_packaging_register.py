"""packaging/systemd/vllm-gateway-register@.service: systemd accepts it, and it drains first."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parent.parent.parent / "packaging/systemd/vllm-gateway-register@.service"


def sections() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # keys are case-sensitive
    parser.read(UNIT)
    return parser


def test_unit_orders_the_agent_to_stop_before_the_server():
    unit = sections()
    # After= the server: systemd stops units in the reverse order, so the agent drains
    # and deregisters while vLLM still answers; BindsTo= stops it with the server.
    assert "vllm@%i.service" in unit["Unit"]["After"]
    assert unit["Unit"]["BindsTo"] == "vllm@%i.service"
    assert "vllm-gateway register" in unit["Service"]["ExecStart"]
    assert int(unit["Service"]["TimeoutStopSec"]) > 600  # the agent's default drain timeout
    assert unit["Service"]["KillSignal"] == "SIGTERM"
    assert "AF_NETLINK" in unit["Service"]["RestrictAddressFamilies"]  # name resolution


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    exe = Path(sys.executable).parent / "vllm-gateway"
    text = UNIT.read_text().replace("/opt/vllm-gateway/bin/vllm-gateway", str(exe))
    (tmp_path / "vllm-gateway-register@1.service").write_text(text)
    (tmp_path / "vllm@.service").write_text(
        "[Unit]\nDescription=vLLM %i\n[Service]\nExecStart=/bin/true\n"
    )
    result = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            str(tmp_path / "vllm-gateway-register@1.service"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr

"""`vllm-gateway workers ...` against a running gateway (click's runner, in a thread)."""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner

from tests.conftest import wait_until
from vllm_gateway.app import ALIASES, AUTOSCALER, REGISTRY
from vllm_gateway.cli.main import main
from vllm_gateway.config.gateway import AdminConfig
from vllm_gateway.workers import WorkerState

pytestmark = pytest.mark.timeout(30)

TOKEN = "cli-admin-token"


async def cli(gw, *args: str, token: str | None = TOKEN):
    env = {"VLLM_GATEWAY_URL": gw.url, "VLLM_GATEWAY_ADMIN_TOKEN": token or ""}
    return await asyncio.to_thread(CliRunner().invoke, main, ["workers", *args], env=env)


async def test_workers_commands_drive_the_admin_api(fake_worker, gateway, logs):
    # (logs: the gateway logs to the capture, not into the CLI output click captures)
    w1 = await fake_worker(models="m")
    w2 = await fake_worker(models="m2")
    gw = await gateway([w1], admin=AdminConfig(token=TOKEN))
    registry = gw.app[REGISTRY]

    r = await cli(gw, "add", w2.url, "--weight", "2")
    assert r.exit_code == 0 and r.output.startswith(f"added: {w2.url}  ready"), r.output
    r = await cli(gw, "list")
    lines = r.output.splitlines()
    assert lines[0].split() == [
        "URL", "STATE", "CIRCUIT", "INFLIGHT", "RUNNING", "WAITING", "SOURCE", "MODELS"
    ]  # fmt: skip
    assert {line.split()[0] for line in lines[1:]} == {w1.url, w2.url}
    assert any(line.split()[-2:] == ["admin", "m2"] for line in lines[1:])

    r = await cli(gw, "drain", w1.url, "--wait", "--timeout", "5")
    assert r.exit_code == 0 and "draining" in r.output
    assert registry.get(w1.url).state is WorkerState.DRAINING
    r = await cli(gw, "undrain", w1.url)
    assert r.exit_code == 0 and registry.get(w1.url).state is WorkerState.READY
    r = await cli(gw, "weight", w1.url, "0.5")
    assert r.exit_code == 0 and registry.get(w1.url).weight == 0.5

    r = await cli(gw, "alias", "big", "m=3", "m2=1")
    assert r.exit_code == 0 and r.output.strip() == "big -> m 75%, m2 25%  (admin)"
    assert gw.app[ALIASES].names() == ["big"]
    r = await cli(gw, "alias", "big", "--remove")
    assert r.exit_code == 0 and gw.app[ALIASES].names() == []

    # `scale` prints a table like the other verbs; --json the admin API's document.
    await wait_until(lambda: "m" in gw.app[AUTOSCALER].view()["models"])
    r = await cli(gw, "scale")
    lines = r.output.splitlines()
    assert r.exit_code == 0 and lines[0] == "autoscaler: off; runs commands: no", r.output
    assert lines[1].split()[:3] == ["MODEL", "WORKERS", "READY"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["m"][1:3] == ["1", "1"] and rows["m2"][1] == "1", r.output
    r = await cli(gw, "scale", "--json")
    assert r.exit_code == 0 and '"models"' in r.output

    r = await cli(gw, "remove", w2.url)
    assert r.exit_code == 0 and registry.get(w2.url) is None
    r = await cli(gw, "list", "--json")
    assert r.exit_code == 0 and '"url"' in r.output


async def test_workers_commands_report_refusals(fake_worker, gateway, logs):
    gw = await gateway([], admin=AdminConfig(token=TOKEN))
    r = await cli(gw, "list", token="wrong")
    assert r.exit_code == 1 and "401" in r.output and "wrong token" in r.output
    r = await cli(gw, "drain", "http://127.0.0.1:9")
    assert r.exit_code == 1 and "404" in r.output
    r = await cli(gw, "alias", "x", "m=abc")
    assert r.exit_code == 2 and "must be a number" in r.output

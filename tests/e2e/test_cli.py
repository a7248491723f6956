"""The command line, run as a user runs it: real processes, real sockets."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys

import pytest
from click.testing import CliRunner

from tests.support.processes import free_port
from vllm_gateway.cli.main import main
from vllm_gateway.config.docs import render_reference

pytestmark = pytest.mark.timeout(60)
DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "configuration.md")


def test_help_explains_every_command():
    runner = CliRunner()
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("serve", "demo", "chat", "fake-worker", "check-config"):
        assert command in result.output
    result = runner.invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    for flag in (
        "--host",
        "--port",
        "--worker",
        "--config",
        "--policy",
        "--log-format",
        "--log-level",
    ):
        assert flag in result.output
    # It points to a reference a pip-installed user has: the one the package prints.
    assert "docs/" not in result.output
    assert "check-config --reference" in " ".join(result.output.split())
    result = runner.invoke(main, ["check-config", "--reference"])
    assert result.exit_code == 0 and result.output == render_reference()


def test_check_config_reports_each_mistake(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('port = "eighty"\n[timeouts]\nconnect = -2\nbogus = 1\n')
    result = CliRunner().invoke(main, ["check-config", "--config", str(path)])
    assert result.exit_code == 1
    assert "port: expected an integer" in result.output
    assert "timeouts.bogus: unknown setting" in result.output
    result = CliRunner().invoke(main, ["check-config"], env={"VLLM_GATEWAY_POLICY": "nope"})
    assert result.exit_code == 1 and "unknown policy 'nope'" in result.output
    good = tmp_path / "good.toml"
    good.write_text('port = 9001\n[[workers]]\nurl = "http://10.0.0.5:8000"\n')
    result = CliRunner().invoke(main, ["check-config", "--config", str(good)], env={})
    assert result.exit_code == 0 and "port = 9001" in result.output
    assert 'url = "http://10.0.0.5:8000"' in result.output


def test_check_config_lists_every_mistake_in_one_pass(tmp_path):
    # Five mistakes of five kinds: a bad value, an unknown key, a misspelled key in a
    # section, an unknown policy (checked above config/) and a worker URL without a scheme.
    path = tmp_path / "five.toml"
    path.write_text(
        'port = 99999\ncolour = "blue"\npolicy = "fastest"\n'
        '[timeouts]\nconect = 2\n[[workers]]\nurl = "127.0.0.1:8001"\n'
    )
    result = CliRunner().invoke(main, ["check-config", "--config", str(path)], env={})
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.startswith("  - ")]
    assert len(lines) == 5, result.output
    for expected in (
        "port: must be at most",
        "colour: unknown setting",
        "timeouts.conect: unknown setting",
        "policy: unknown policy 'fastest'",
        "workers[0].url: '127.0.0.1:8001' has no scheme: add http:// (http://127.0.0.1:8001)",
    ):
        assert any(expected in line for line in lines), (expected, result.output)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("localhost:8000", "has no scheme: add http:// (http://localhost:8000)"),
        ("http://10.0.0.5:8000/vllm", "has a path (/vllm)"),
        ("http://10.0.0.5:8000/v1/chat/completions", "e.g. http://10.0.0.5:8000"),
        ("ftp://10.0.0.5", "must start with http:// or https://"),
    ],
)
def test_a_bad_worker_url_is_refused_where_it_enters_with_what_is_wrong(url, problem):
    runner = CliRunner()
    for args, env in (
        (["check-config"], {"VLLM_GATEWAY_WORKERS": url}),  # environment
        (["serve", "--worker", url], {}),  # flag (refused before anything starts)
    ):
        result = runner.invoke(main, args, env=env)
        assert result.exit_code == 1 and problem in result.output, (args, result.output)


def test_a_trailing_v1_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "v1.toml"
    path.write_text('[[workers]]\nurl = "http://10.0.0.5:8000/v1/"\n')
    result = CliRunner().invoke(main, ["check-config", "--config", str(path)], env={})
    assert result.exit_code == 0, result.output
    assert "warning: workers[0].url: 'http://10.0.0.5:8000/v1/': the trailing /v1 was dropped" in (
        result.stderr
    )


def test_configuration_reference_is_current():
    with open(DOCS) as f:
        assert f.read() == render_reference(), (
            "docs/configuration.md is stale: python -m vllm_gateway.config.docs > "
            "docs/configuration.md"
        )


async def _read_until(stream: asyncio.StreamReader, needle: str, timeout: float) -> str:
    seen = ""
    async with asyncio.timeout(timeout):
        while needle not in seen:
            line = await stream.readline()
            if not line:
                raise AssertionError(f"process ended before printing {needle!r}: {seen}")
            seen += line.decode()
    return seen


async def _wait_http(http, url: str, timeout: float = 15.0) -> None:
    async with asyncio.timeout(timeout):
        while True:
            try:
                async with http.get(url) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            await asyncio.sleep(0.1)


async def test_serve_from_environment_logs_json_and_stops_on_sigterm(fake_worker, http):
    w = await fake_worker(models="m")
    port = free_port()
    env = {**os.environ, "VLLM_GATEWAY_WORKERS": w.url, "VLLM_GATEWAY_PORT": str(port)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vllm_gateway",
        "serve",
        "--log-level",
        "info",
        env=env,
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    try:
        await _wait_http(http, f"http://127.0.0.1:{port}/health")
        async with http.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "m", "prompt": "x", "max_tokens": 2},
        ) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] == " w0 w1"
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = (await proc.stderr.read()).decode().splitlines()
    events = [json.loads(line) for line in lines]  # not a TTY: one JSON object per line
    assert any(e["event"] == "gateway listening" for e in events)
    assert any(e["event"] == "worker state" and e["new"] == "ready" for e in events)
    assert all("timestamp" in e and "level" in e for e in events)


async def test_serve_without_a_worker_says_how_to_add_one():
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vllm_gateway",
        "serve",
        "--port",
        str(free_port()),
        "--log-format",
        "json",
        env={k: v for k, v in os.environ.items() if not k.startswith("VLLM_GATEWAY_")},
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    try:
        seen = await _read_until(proc.stderr, "no worker configured", timeout=15)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    [warning] = [json.loads(line) for line in seen.splitlines() if "no worker" in line]
    assert warning["level"] == "warning"
    for way in ("--worker URL", "[[workers]]", "vllm-gateway register", "workers add URL"):
        assert way in warning["event"]


async def test_demo_and_chat(http):
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vllm_gateway",
        "demo",
        "--port",
        str(port),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        printed = await _read_until(proc.stdout, "PY\n", timeout=20)
        assert f"curl -s {url}/v1/models" in printed
        await _wait_http(http, url + "/health")
        async with http.get(url + "/v1/models") as r:
            ids = sorted(m["id"] for m in (await r.json())["data"])
        assert ids == ["demo-llama", "demo-mistral"]
        chat = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "vllm_gateway",
            "chat",
            "--gateway",
            url,
            "--model",
            "demo-mistral",
            "--max-tokens",
            "3",
            "hello",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(chat.communicate(), 20)
        assert chat.returncode == 0
        assert out.decode() == " w0 w1 w2\n"
        chat = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "vllm_gateway",
            "chat",
            "--gateway",
            url,
            "--model",
            "nope",
            "hello",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(chat.communicate(), 20)
        assert chat.returncode == 1 and "404" in out.decode() and "demo-llama" in out.decode()
        proc.send_signal(signal.SIGINT)
        rest = await _read_until(proc.stdout, "demo stopped", timeout=10)
        assert "Traceback" not in rest
        async with asyncio.timeout(10):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize(
    "flags",
    [["--port", "{busy}"], ["--processes", "2", "--port", "{busy}"],
     ["--port", "{free}", "--replica-listen", "127.0.0.1:{busy}"]],
)  # fmt: skip
async def test_serve_on_a_port_in_use_says_so_and_exits(flags):
    """A port another process holds (vLLM's default is 8000, as the gateway's): one error
    line naming the address and what to do, exit code 3, no traceback; with --processes
    the supervisor stops rather than restart children that would fail alike."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        args = [f.format(busy=busy, free=free_port()) for f in flags]
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GATEWAY_")}
        env["VLLM_GATEWAY_REPLICAS_TOKEN"] = "a-shared-secret-of-some-length"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "vllm_gateway", "serve", "--log-format", "json", *args,
            env=env, stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            async with asyncio.timeout(20):
                err = (await proc.stderr.read()).decode()
                assert await proc.wait() == 3
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert "Traceback" not in err, err
    [line] = [json.loads(x) for x in err.splitlines() if '"cannot listen"' in x][:1]
    assert line["level"] == "error" and f"127.0.0.1:{busy}: " in line["error"]
    assert ("replicas' feed" in line["error"]) == ("--replica-listen" in args)

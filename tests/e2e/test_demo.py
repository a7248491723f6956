"""`vllm-gateway demo` as a new user meets it: every command it prints is run as printed, in
a new login shell with a clean environment, from the directory the demo started in."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from tests.support.processes import free_port
from vllm_gateway.cli import demo

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAST_LINE = "until the undrain"


def printed_commands(text: str) -> list[str]:
    """The paste units the demo printed: blocks of indented lines (a heredoc's body and
    end at the margin), blank-line separated, that are more than comments."""
    blocks = text.split("Try it", 1)[1].split("\n\n")
    commands = []
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or not lines[0].startswith("  "):
            continue
        if all(line.strip().startswith("#") for line in lines):
            continue
        commands.append("\n".join(lines) + "\n")
    return commands


async def new_shell(script: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `script` as a user's new terminal would: a login bash, nothing inherited but a
    plain PATH and HOME, in the repository directory; bounded."""
    clean = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-lc",
        script,
        cwd=REPO,
        env={**clean, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


async def start_demo(*args: str, env: dict[str, str] | None = None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GATEWAY_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vllm_gateway",
        "demo",
        *args,
        cwd=REPO,
        env={**base, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    seen = ""
    try:
        async with asyncio.timeout(30):
            while LAST_LINE not in seen:
                line = await proc.stdout.readline()  # type: ignore[union-attr]
                assert line, f"the demo ended before printing its commands: {seen}"
                seen += line.decode()
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc, seen


async def stop_demo(proc) -> None:
    proc.terminate()
    try:
        async with asyncio.timeout(10):
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_every_command_the_demo_prints_works_as_printed_in_a_new_shell():
    port = free_port()
    proc, text = await start_demo("--port", str(port))
    try:
        commands = printed_commands(text)
        assert len(commands) == 5, text  # curls, a streamed curl, chat, Python, the fleet
        outputs = []
        for command in commands:
            code, out = await new_shell(command)
            assert code == 0, (command, out)
            outputs.append(out)
        curls, streamed, chat, python, fleet = outputs
        assert '"demo-mistral"' in curls and '"state":"ready"' in curls
        assert streamed.count("data: ") >= 8 and "[DONE]" in streamed
        assert chat.strip().startswith("w0 w1")
        assert python.strip() == "w0 w1 w2 w3 w4 w5 w6 w7"  # the openai SDK snippet
        assert "draining" in fleet and fleet.count("ready") >= 2, fleet

        # Where the openai SDK is not installed, the snippet uses the standard library.
        url = f"http://127.0.0.1:{port}"
        workers = [line.split()[1] for line in text.splitlines()[1:3]]
        find_spec = demo.importlib.util.find_spec
        try:
            demo.importlib.util.find_spec = lambda name: None  # type: ignore[assignment]
            stdlib = [c for c in printed_commands(demo.examples(url, workers, None)) if "PY" in c]
        finally:
            demo.importlib.util.find_spec = find_spec
        assert "urllib" in stdlib[0] and "from openai" not in stdlib[0]
        code, out = await new_shell(stdlib[0])
        assert code == 0 and out.strip() == "w0 w1 w2 w3 w4 w5 w6 w7", out
    finally:
        await stop_demo(proc)


async def test_the_demo_reads_the_settings_serve_reads():
    port = free_port()
    env = {"VLLM_GATEWAY_PORT": str(port), "VLLM_GATEWAY_ADMIN_TOKEN": "my-own-admin-token"}
    proc, text = await start_demo(env=env)
    try:
        assert f"a gateway on http://127.0.0.1:{port}" in text  # the port from the environment
        assert "my-own-admin-token" not in text and "set to your admin.token" in text
        [fleet] = [c for c in printed_commands(text) if "workers list" in c]
        code, out = await new_shell(fleet, env={"VLLM_GATEWAY_ADMIN_TOKEN": "my-own-admin-token"})
        assert code == 0 and "draining" in out, out
        code, out = await new_shell(fleet, env={"VLLM_GATEWAY_ADMIN_TOKEN": "wrong"})
        assert code != 0 and "401" in out
    finally:
        await stop_demo(proc)
    # An invalid setting stops it before anything starts, as it stops serve.
    bad = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vllm_gateway",
        "demo",
        env={**os.environ, "VLLM_GATEWAY_POLICY": "fastest"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(bad.communicate(), 20)
    assert bad.returncode == 1 and "unknown policy 'fastest'" in out.decode()

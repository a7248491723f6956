"""`vllm-gateway demo`: two fake workers and a gateway, in one process, for a first look.

The gateway reads the settings `serve` reads (defaults < `--config` < `VLLM_GATEWAY_*` <
flags), with the two fake workers added to the configured ones. Without an `admin.token`
the demo makes one, so the fleet commands it prints work. Every command printed is meant
to work as printed in a new shell, in the directory the demo was started from: the
commands name this installation's `vllm-gateway` and Python by path when they are not the
ones a new shell finds (a virtualenv's), and the Python snippet uses the `openai` SDK only
when this Python has it (`pip install 'vllm-gateway[client]'`), the standard library otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import secrets
import shlex
import shutil
import sys

from vllm_gateway import log as logging_setup
from vllm_gateway.app import create_app
from vllm_gateway.config.gateway import GatewayConfig, LogConfig, WorkerSpec
from vllm_gateway.http.server import run_until_signal, start_server

MODELS = (("demo-llama",), ("demo-llama", "demo-mistral"))

HEADER = """\
vllm-gateway demo: a gateway on {url} in front of two fake vLLM workers
  worker {w0}  serves demo-llama
  worker {w1}  serves demo-llama, demo-mistral

Try it from another shell, in {cwd} (Ctrl-C here stops everything):

  curl -s {url}/v1/models
  curl -s {url}/list_workers

  curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "demo-llama", "stream": true, "max_tokens": 8,
         "messages": [{{"role": "user", "content": "Hello"}}]}}'

  {gw} chat --gateway {url} --model demo-mistral "Tell me a story"
"""

OPENAI_SNIPPET = """
  {py} - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="unused")
stream = client.chat.completions.create(
    model="demo-llama", stream=True, max_tokens=8,
    messages=[{{"role": "user", "content": "Hello"}}])
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY
"""

# Without the openai SDK (not a dependency of the gateway itself): the standard library.
STDLIB_SNIPPET = """
  {py} - <<'PY'
import json, urllib.request
body = {{"model": "demo-llama", "max_tokens": 8,
        "messages": [{{"role": "user", "content": "Hello"}}]}}
request = urllib.request.Request(
    "{url}/v1/chat/completions", data=json.dumps(body).encode(),
    headers={{"Content-Type": "application/json"}})
print(json.load(urllib.request.urlopen(request))["choices"][0]["message"]["content"])
PY
  # the same with the openai SDK: pip install 'vllm-gateway[client]' (or any OpenAI
  # client with base_url {url}/v1)
"""

FLEET = """
Change the fleet while it serves (the admin API; {token_note}):

  export VLLM_GATEWAY_URL={url}{token_export}
  {gw} workers list
  {gw} workers drain {w0} --wait
  {gw} workers list
  {gw} workers undrain {w0}

  # drained, {w0} takes no new request and those in flight finish:
  # every demo-llama request goes to {w1} until the undrain
"""


def invocation() -> tuple[str, str]:
    """How a new shell, in the current directory, runs this installation's `vllm-gateway`
    and its Python: the bare name when that is what PATH finds outside a virtualenv, else
    the path (relative to here when under it)."""
    bin_dir = os.path.dirname(sys.executable)
    script = os.path.join(bin_dir, "vllm-gateway")
    in_venv = sys.prefix != sys.base_prefix
    if not os.path.exists(script):
        return f"{shlex.quote(sys.executable)} -m vllm_gateway", shlex.quote(sys.executable)
    if not in_venv and shutil.which("vllm-gateway") == script:
        return "vllm-gateway", shlex.quote(sys.executable)
    here = os.getcwd()
    if os.path.commonpath([here, bin_dir]) == here:
        bin_dir = os.path.relpath(bin_dir, here)
    return (
        shlex.quote(os.path.join(bin_dir, "vllm-gateway")),
        shlex.quote(os.path.join(bin_dir, os.path.basename(sys.executable))),
    )


def examples(url: str, workers: list[str], token: str | None) -> str:
    """What the demo prints: commands to try, each working as printed in a new shell."""
    gw, py = invocation()
    fields = {"url": url, "w0": workers[0], "w1": workers[1], "gw": gw, "py": py}
    text = HEADER.format(cwd=os.getcwd(), **fields)
    has_openai = importlib.util.find_spec("openai") is not None
    text += (OPENAI_SNIPPET if has_openai else STDLIB_SNIPPET).format(**fields)
    if token is None:  # the user's own admin.token: not echoed
        token_note = "with VLLM_GATEWAY_ADMIN_TOKEN set to your admin.token"
        token_export = ""
    else:
        token_note = "this token was made for this demo"
        token_export = f" VLLM_GATEWAY_ADMIN_TOKEN={token}"
    return text + FLEET.format(token_note=token_note, token_export=token_export, **fields)


def demo_config(config: GatewayConfig, workers: list[str]) -> tuple[GatewayConfig, str | None]:
    """`config` with the fake workers added and an admin token made when none is set; the
    token made, or None when the user's own stands."""
    made = None
    if not config.admin.token:
        made = secrets.token_urlsafe(18)
        config = dataclasses.replace(config, admin=dataclasses.replace(config.admin, token=made))
    specs = (*config.workers, *(WorkerSpec(url=u) for u in workers))
    return dataclasses.replace(config, workers=specs), made


def run_demo(config: GatewayConfig, log_level: str) -> None:
    """Run the demo with `config` (as `serve` loads it) until Ctrl-C."""
    from vllm_gateway.fake_worker import FakeWorker, FakeWorkerConfig

    config = dataclasses.replace(config, log=LogConfig(format="console", level=log_level))
    logging_setup.configure("console", log_level)

    async def main(stop: asyncio.Event) -> None:
        workers = [
            FakeWorker(FakeWorkerConfig(models=m, ttft_ms=80, tpot_ms=40, max_tokens=24))
            for m in MODELS
        ]
        for w in workers:
            await w.start("127.0.0.1", 0)
        gateway, token = demo_config(config, [w.url for w in workers])
        host, port = gateway.host, gateway.port
        try:
            server = await start_server(create_app(gateway), host, port, client=gateway.client)
        except OSError as e:
            for w in workers:
                await w.stop()
            raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror}; try --port") from None
        print(examples(server.url, [w.url for w in workers], token), flush=True)
        await stop.wait()
        await server.stop()
        for w in workers:
            await w.stop()
        print("demo stopped", flush=True)

    run_until_signal(main)

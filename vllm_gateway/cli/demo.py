"""`vllm-gateway demo`: two fake workers and a gateway, in one process, for a first look."""

from __future__ import annotations

import asyncio

from vllm_gateway import log as logging_setup
from vllm_gateway.app import create_app
from vllm_gateway.config.gateway import GatewayConfig, LogConfig, WorkerSpec
from vllm_gateway.http.server import run_until_signal, start_server

MODELS = (("demo-llama",), ("demo-llama", "demo-mistral"))

EXAMPLES = """\
vllm-gateway demo: a gateway on {url} in front of two fake vLLM workers
  worker {w0}  serves demo-llama
  worker {w1}  serves demo-llama, demo-mistral

Try it (Ctrl-C stops everything):

  curl -s {url}/v1/models
  curl -s {url}/list_workers
  curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "demo-llama", "stream": true, "max_tokens": 8,
         "messages": [{{"role": "user", "content": "Hello"}}]}}'
  vllm-gateway chat --gateway {url} --model demo-mistral "Tell me a story"

  python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="unused")
for chunk in client.chat.completions.create(
        model="demo-llama", stream=True, max_tokens=8,
        messages=[{{"role": "user", "content": "Hello"}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY
"""


def run_demo(host: str, port: int) -> None:
    """Run the demo until Ctrl-C."""
    from vllm_gateway.fake_worker import FakeWorker, FakeWorkerConfig

    logging_setup.configure("console", "warning")

    async def main(stop: asyncio.Event) -> None:
        workers = [
            FakeWorker(FakeWorkerConfig(models=m, ttft_ms=80, tpot_ms=40, max_tokens=24))
            for m in MODELS
        ]
        for w in workers:
            await w.start("127.0.0.1", 0)
        config = GatewayConfig(
            host=host,
            port=port,
            workers=tuple(WorkerSpec(url=w.url) for w in workers),
            log=LogConfig(format="console", level="warning"),
        )
        try:
            server = await start_server(create_app(config), host, port, client=config.client)
        except OSError as e:
            for w in workers:
                await w.stop()
            raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror}; try --port") from None
        print(EXAMPLES.format(url=server.url, w0=workers[0].url, w1=workers[1].url), flush=True)
        await stop.wait()
        await server.stop()
        for w in workers:
            await w.stop()
        print("demo stopped", flush=True)

    run_until_signal(main)

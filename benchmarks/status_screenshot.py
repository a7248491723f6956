"""Make docs/status-page.png: the status page of a gateway under load, in headless Chromium.

Three fake workers (one small, so its own queue fills), one drained, one that never answers,
40 streaming clients for the length of the shot; everything on 127.0.0.1, bounded in time.
Run it with scripts/screenshot_status (needs Debian's chromium).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import random
import shutil
import tempfile
from pathlib import Path

import aiohttp

from vllm_gateway import log as logging_setup
from vllm_gateway.app import GATEWAY, create_app
from vllm_gateway.config.gateway import GatewayConfig, ProbeConfig, ScrapeConfig, WorkerSpec
from vllm_gateway.fake_worker import FakeWorker, FakeWorkerConfig
from vllm_gateway.http.server import start_server

ROOT = Path(__file__).resolve().parent.parent


async def load(url: str, models: list[str], until: float) -> None:
    rng = random.Random()
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        while loop.time() < until:
            body = {
                "model": rng.choice(models),
                "prompt": "x",
                "max_tokens": rng.randint(8, 64),
                "stream": True,
            }
            with contextlib.suppress(aiohttp.ClientError):
                async with http.post(url + "/v1/completions", json=body) as r:
                    async for _ in r.content.iter_any():
                        pass


async def shoot(profile: Path, url: str, seconds: float) -> bytes:
    """Open `url` in the running Chromium, let it live `seconds`, return a PNG of it."""
    port_file = profile / "DevToolsActivePort"
    async with asyncio.timeout(20):
        while not port_file.exists() or not port_file.read_text().strip():
            await asyncio.sleep(0.05)
    port = int(port_file.read_text().split()[0])
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = itertools.count(1)

            async def call(method: str, **params: object) -> dict:
                n = next(ids)
                await ws.send_json({"id": n, "method": method, "params": params})
                while True:
                    msg = await ws.receive_json()
                    if msg.get("id") == n:
                        return msg["result"]

            await call("Page.navigate", url=url)
            await asyncio.sleep(seconds)  # real time: the page's rates are real rates
            shot = await call("Page.captureScreenshot", format="png")
    return base64.b64decode(shot["data"])


async def main(out: Path, seconds: float) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("needs headless Chromium: apt-get install chromium")
    logging_setup.configure("json", "warning", stream=open("/dev/null", "w"))  # noqa: SIM115
    configs = [
        FakeWorkerConfig(models=("llama-3-8b",), ttft_ms=60, tpot_ms=15, max_num_seqs=32),
        FakeWorkerConfig(models=("llama-3-8b",), ttft_ms=80, tpot_ms=20, max_num_seqs=6),
        FakeWorkerConfig(models=("qwen-2.5-7b", "qwen-2.5-7b-lora"), ttft_ms=50, tpot_ms=12),
        FakeWorkerConfig(models=("llama-3-8b",), ttft_ms=60, tpot_ms=15),
    ]
    workers = [FakeWorker(c) for c in configs]
    for w in workers:
        await w.start("127.0.0.1", 0)
    urls = [w.url for w in workers] + ["http://127.0.0.1:9"]  # the last never answers
    config = GatewayConfig(
        workers=tuple(WorkerSpec(url=u) for u in urls),
        probe=ProbeConfig(interval=0.5, timeout=0.5, startup_wait=2.0),
        scrape=ScrapeConfig(interval=0.25),
    )
    server = await start_server(create_app(config), "127.0.0.1", 0)
    gateway = server.app[GATEWAY]
    gateway.fleet.drain(gateway.registry.get(workers[3].url), "drained for maintenance")
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds + 10
    clients = [
        asyncio.create_task(load(server.url, ["llama-3-8b", "qwen-2.5-7b"], until))
        for _ in range(40)
    ]
    await asyncio.sleep(3)
    with tempfile.TemporaryDirectory() as profile:
        proc = await asyncio.create_subprocess_exec(
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--window-size=1280,1000",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "about:blank",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            png = await shoot(Path(profile), server.url + "/?interval=1000", seconds)
        finally:
            proc.terminate()
            await proc.wait()
    out.write_bytes(png)
    for t in clients:
        t.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    await server.stop()
    for w in workers:
        await w.stop()
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "status-page.png")
    parser.add_argument("--seconds", type=float, default=8.0, help="page time before the shot")
    args = parser.parse_args()
    asyncio.run(main(args.out, args.seconds))

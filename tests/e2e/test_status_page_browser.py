"""The status page in a real browser: Debian's headless Chromium, driven over DevTools.

Skipped where Chromium is not installed (`apt-get install chromium`); `-m "not browser"`
leaves it out anywhere. Chromium runs without network access beyond 127.0.0.1, with a
fresh profile, and is stopped by the test.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)"
    ),
]

ROWS_JS = """JSON.stringify({
  conn: document.getElementById("conn").className,
  ready: document.getElementById("c-ready").textContent,
  workers: [...document.querySelectorAll("tr[data-worker]")].map((tr) => ({
    url: tr.dataset.worker,
    state: tr.querySelector("[data-field=state]").textContent,
    requests: Number(tr.querySelector("[data-field=requests]").textContent),
  })),
})"""


class Page:
    """One browser tab over the DevTools protocol (a websocket of JSON commands)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict:
        n = next(self.ids)
        await self.ws.send_json({"id": n, "method": method, "params": params})
        async with asyncio.timeout(10):
            while True:
                msg = await self.ws.receive_json()
                if msg.get("id") == n:
                    assert "error" not in msg, msg
                    return msg["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, predicate, timeout: float = 15.0) -> dict:
        """Poll the page's worker table until `predicate(view)` holds; return the view."""
        view: dict = {}
        try:
            async with asyncio.timeout(timeout):
                while True:
                    raw = await self.evaluate(ROWS_JS)  # None while the page still loads
                    view = json.loads(raw) if raw else {}
                    if view and predicate(view):
                        return view
                    await asyncio.sleep(0.1)
        except TimeoutError:
            raise AssertionError(f"the page never showed it; last view: {view}") from None


@pytest.fixture
async def browser_page(tmp_path: Path) -> AsyncIterator[Page]:
    profile = tmp_path / "profile"
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--no-default-browser-check",
        f"--user-data-dir={profile}",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        async with asyncio.timeout(20):
            while not port_file.exists() or not port_file.read_text().strip():
                await asyncio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                targets = await r.json()
            page = next(t for t in targets if t["type"] == "page")
            async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield Page(ws)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def test_status_page_shows_the_fleet_and_follows_it(
    fake_worker, gateway, client, browser_page
):
    a = await fake_worker(models="m", tpot_ms=1, ttft_ms=1)
    b = await fake_worker(models="m", tpot_ms=1, ttft_ms=1)
    gw = await gateway([a, b], policy="round_robin")
    await browser_page.call("Page.navigate", url=gw.url + "/dashboard?interval=200")

    def both_ready(view: dict) -> bool:
        states = {w["url"]: w["state"] for w in view["workers"]}
        return states == {a.url: "ready", b.url: "ready"} and view["conn"] == "live"

    view = await browser_page.wait_for(both_ready)
    assert view["ready"] == "2 / 2"

    # Traffic shows up on the page without a reload.
    c = client(gw)
    for _ in range(6):
        await c.completions.create(model="m", prompt="x", max_tokens=1)
    await browser_page.wait_for(lambda v: sum(w["requests"] for w in v["workers"]) == 6)

    # A worker going down shows up too.
    await a.pause()
    view = await browser_page.wait_for(
        lambda v: any(w["url"] == a.url and w["state"] == "unhealthy" for w in v["workers"])
    )
    assert view["ready"] == "1 / 2"

"""A worker whose /health, /v1/models and /metrics pages a test sets byte for byte.

For untrusted-worker tests: it answers what it is told (`models`, `metrics`, `health`
status), streamed in `chunk`-sized writes so a huge page really is sent piece by piece,
and serves POST /v1/completions with a small valid answer so it can take traffic.
`pages` counts the GETs of each path.
"""

from __future__ import annotations

import collections

from aiohttp import web

GOOD_MODELS = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
GOOD_METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
COMPLETION = b'{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok"}]}'


class HostileWorker:
    def __init__(self, models: bytes = GOOD_MODELS, metrics: bytes = GOOD_METRICS) -> None:
        self.models = models
        self.metrics = metrics
        self.health = 200
        self.chunk = 1 << 20
        self.pages: collections.Counter[str] = collections.Counter()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _page(self, request: web.Request, body: bytes) -> web.StreamResponse:
        self.pages[request.path] += 1
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(body)
        await response.prepare(request)
        for i in range(0, len(body), self.chunk):
            await response.write(body[i : i + self.chunk])
        return response

    async def _health(self, request: web.Request) -> web.Response:
        self.pages[request.path] += 1
        return web.Response(status=self.health)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return await self._page(request, self.models)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return await self._page(request, self.metrics)

    async def _complete(self, request: web.Request) -> web.Response:
        await request.read()
        self.pages[request.path] += 1
        return web.Response(body=COMPLETION, content_type="application/json")

    async def start(self) -> HostileWorker:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

"""FakeWorker: the fake's lifecycle on a real socket and the bookkeeping of every request.

start/stop/pause/resume, the record and outcome of each request, auth and fault
selection, and the /fake/* control API live here; the vLLM endpoints are in api.py.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import orjson
from aiohttp import web

from vllm_gateway.fake_worker import protocol as p
from vllm_gateway.fake_worker.api import CALL, GENERATE_PATHS, Call, OpenAIApi, json_response
from vllm_gateway.fake_worker.config import FakeWorkerConfig, parse_fault
from vllm_gateway.fake_worker.engine import Engine
from vllm_gateway.fake_worker.stats import FakeStats, Headers, RequestRecord

FAULT_HEADER = "X-Fake-Fault"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeWorker:
    """One fake vLLM server. start() binds 127.0.0.1 on a free port by default."""

    def __init__(self, config: FakeWorkerConfig | None = None) -> None:
        self.config = config or FakeWorkerConfig()
        self.stats = FakeStats()
        self.host = "127.0.0.1"
        self.port = 0
        self._fault = parse_fault(self.config.fault)
        self.engine = Engine(self.config, self.stats)
        self._in_flight: set[RequestRecord] = set()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        # While frozen or blackholed: the bare listening socket standing in for the server,
        # and (blackhole) the connection that keeps its accept queue full.
        self._stand_in: list[socket.socket] = []
        self._outages: set[asyncio.Task[None]] = set()  # POST /fake/outage in progress

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self.port}"

    @property
    def fault(self) -> str | None:
        """The worker-wide fault as text (`NAME=PARAM`), or None."""
        return str(self._fault) if self._fault else None

    def set_fault(self, fault: str | None) -> None:
        """Set the worker-wide fault (None heals); ValueError for an unknown name."""
        self._fault = parse_fault(fault)

    async def wait_for(self, predicate: Callable[[FakeStats], bool], timeout: float = 2.0) -> None:
        """Poll `predicate(stats)` until true; TimeoutError (with the stats) after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not predicate(self.stats):
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {timeout}s: {self.stats!r}")
            await asyncio.sleep(0.005)

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if self._runner is not None:
            raise RuntimeError("fake worker already started")
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024**2)
        OpenAIApi(self.config, self.engine, self._finish).add_routes(app)
        app.router.add_get("/fake/stats", self._get_stats)
        app.router.add_post("/fake/fault", self._post_fault)
        app.router.add_post("/fake/outage", self._post_outage)
        # handler_cancellation: aiohttp cancels a handler when its client goes away,
        # which is how a non-streaming request learns of it (and frees its slot).
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        self.host = host
        await self._listen(port)

    async def stop(self) -> None:
        if self._runner is None:
            return
        for task in list(self._outages):
            task.cancel()
        await self.pause()
        self._close_stand_in()
        await self._runner.cleanup()
        self._runner = None

    async def pause(self) -> None:
        """Die: close the listening socket (connects are refused) and cut open connections.

        Requests in flight end as "dropped"; their clients see the connection close.
        """
        if self._site is not None:
            site, self._site = self._site, None
            await site.stop()
        for rec in list(self._in_flight):
            self._finish(rec, "dropped")
        if self._runner is not None and self._runner.server is not None:
            for conn in self._runner.server.connections:
                if conn.transport is not None:
                    conn.transport.abort()
        # Let the cancelled handlers unwind (bounded) so stats are settled on return.
        for _ in range(1000):
            if not self._in_flight:
                break
            await asyncio.sleep(0.001)

    async def resume(self) -> None:
        """Restart: listen again on the same port (after pause, freeze or blackhole)."""
        if self._runner is None:
            raise RuntimeError("fake worker not started")
        self._close_stand_in()
        if self._site is None:
            await self._listen(self.port)

    async def freeze(self) -> None:
        """Hang like a stopped process: connections are accepted, never read or answered.

        The kernel completes every TCP handshake (a listening socket nobody accepts from,
        with a deep backlog) and buffers the request; no byte ever comes back. Open
        connections are cut first, as pause() does. resume() serves again.
        """
        await self._stand_in_listener(backlog=1024)

    async def blackhole(self) -> None:
        """Drop connection attempts, like a host behind a firewall that drops SYNs.

        A listening socket with a one-slot accept queue, kept full by one connection of
        our own: the kernel drops further SYNs, so connects time out rather than fail.
        Open connections are cut first, as pause() does. resume() serves again.
        """
        sock = await self._stand_in_listener(backlog=0)
        filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        filler.setblocking(False)
        self._stand_in.append(filler)
        with suppress(BlockingIOError):
            filler.connect(sock.getsockname())
        await asyncio.sleep(0.01)  # let the handshake complete and fill the queue

    async def _stand_in_listener(self, backlog: int) -> socket.socket:
        if self._runner is None:
            raise RuntimeError("fake worker not started")
        await self.pause()
        self._close_stand_in()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(backlog)
        self._stand_in.append(sock)
        return sock

    def _close_stand_in(self) -> None:
        for sock in self._stand_in:
            sock.close()
        self._stand_in.clear()

    async def _listen(self, port: int) -> None:
        assert self._runner is not None
        site = web.TCPSite(self._runner, self.host, port, reuse_address=True, backlog=2048)
        await site.start()
        self._site = site
        self.port = self._runner.addresses[-1][1]

    # --- per-request bookkeeping -------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        # Probes, scrapes and the control API are not "requests": a gateway probing every
        # 100 ms must not push the requests under test out of the record.
        if path == "/health":
            self.stats.health_probes += 1
            return await handler(request)
        if path == "/metrics":
            self.stats.metrics_scrapes += 1
            return await handler(request)
        if path.startswith("/fake/"):
            return await handler(request)
        body = await request.read()
        record = RequestRecord(request.method, path, Headers(request.headers.items()), body)
        self.stats.record(record)
        self._in_flight.add(record)
        try:
            resp = await self._answer(request, record, handler)
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the connection is lost: the client left.
            self._finish(record, "aborted")
            raise
        finally:
            self._in_flight.discard(record)
        record.status = resp.status
        self._finish(record, "completed" if resp.status < 400 else "error")
        return resp

    async def _answer(
        self, request: web.Request, record: RequestRecord, handler: Handler
    ) -> web.StreamResponse:
        try:
            key = self.config.api_key
            auth = request.headers.get("Authorization")
            if key and request.path.startswith("/v1") and auth != f"Bearer {key}":
                raise p.ApiError(401, "Unauthorized")
            fault = self._fault
            if (header := request.headers.get(FAULT_HEADER)) is not None:
                try:
                    fault = parse_fault(header)
                except ValueError as exc:
                    raise p.ApiError(400, str(exc), FAULT_HEADER) from None
            record.fault = str(fault) if fault else None
            request[CALL] = Call(record, fault, asyncio.get_running_loop().time())
            return await handler(request)
        except p.ApiError as exc:
            return _error(exc)
        except web.HTTPException as exc:
            # Unknown path or method: FastAPI's shape, as vLLM answers.
            return json_response({"detail": exc.reason}, exc.status)

    def _finish(self, rec: RequestRecord, outcome: str) -> None:
        if self.stats.finish(rec, outcome) and outcome == "aborted" and rec.path in GENERATE_PATHS:
            self.engine.count_abort()

    # --- control API -------------------------------------------------------------------

    async def _get_stats(self, request: web.Request) -> web.Response:
        return json_response({**self.stats.to_dict(), "fault": self.fault})

    async def _post_fault(self, request: web.Request) -> web.Response:
        try:
            body: Any = orjson.loads(await request.read())
            if not isinstance(body, dict) or "fault" not in body:
                raise ValueError('body must be {"fault": NAME or null}')
            self.set_fault(body["fault"])
        except (ValueError, TypeError, AttributeError) as exc:
            return _error(p.ApiError(400, str(exc), "fault"))
        return json_response({"fault": self.fault})

    async def _post_outage(self, request: web.Request) -> web.Response:
        """`{"mode": "pause"|"freeze"|"blackhole", "seconds": S}`: that outage for S seconds,
        then resume(). For a worker run as its own process, whose methods a test cannot
        call; the answer (202) goes out first, since the outage cuts this connection too."""
        modes = {"pause": self.pause, "freeze": self.freeze, "blackhole": self.blackhole}
        try:
            body: Any = orjson.loads(await request.read())
            start = modes[body["mode"]]
            seconds = float(body["seconds"])
            if not 0 < seconds <= 3600:
                raise ValueError("seconds must be in (0, 3600]")
        except (ValueError, TypeError, KeyError) as exc:
            message = f'body must be {{"mode": one of {sorted(modes)}, "seconds": S}}: {exc}'
            return _error(p.ApiError(400, message, "mode"))

        async def outage() -> None:
            await asyncio.sleep(0.05)  # let the 202 reach the caller
            await start()
            await asyncio.sleep(seconds)
            await self.resume()

        task = asyncio.get_running_loop().create_task(outage())
        self._outages.add(task)
        task.add_done_callback(self._outages.discard)
        return json_response({"mode": body["mode"], "seconds": seconds}, 202)


def _error(exc: p.ApiError) -> web.Response:
    # vLLM sends no Retry-After; a gateway's retry logic wants one on 429/503 to test with.
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    body = p.error_body(exc.status, exc.message, exc.param)
    return web.Response(
        status=exc.status, body=body, content_type="application/json", headers=headers
    )


async def run_forever(config: FakeWorkerConfig, host: str, port: int) -> None:
    """Serve until cancelled or SIGINT/SIGTERM, then stop cleanly."""
    worker = FakeWorker(config)
    await worker.start(host, port)
    print(f"fake worker listening on {worker.url} serving {','.join(config.models)}", flush=True)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        # Only the main thread may own signal handlers; elsewhere, cancel to stop.
        with suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, done.set)
    try:
        await done.wait()
    finally:
        for sig in signals:
            with suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)
        await worker.stop()

"""Running an aiohttp application on a socket, and a process's event loop and signals.

`start_server` is what the CLI, the demo and the tests share: an app on host:port (port 0
picks a free one), with handler cancellation on, so a client that goes away cancels its
handler and, through it, the upstream request. `run_until_signal` runs a coroutine factory
on uvloop (when installed) until SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

from vllm_gateway.config.gateway import ClientConfig
from vllm_gateway.errors import CannotListen
from vllm_gateway.http.client_protocol import ClientRunner
from vllm_gateway.http.front import FRONT
from vllm_gateway.http.front_reader import FrontLimits
from vllm_gateway.http.gate import GATE
from vllm_gateway.http.guard import ConnectionLimit


class RunningServer:
    """An application listening on a socket."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self.runner = runner
        self.host = host
        self.port = port

    @property
    def app(self) -> web.Application:
        return self.runner.app

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    async def stop_listening(self) -> None:
        """Close the listening sockets and idle keep-alive connections; requests in
        progress go on, and their connections close when they end."""
        for site in list(self.runner.sites):
            await site.stop()
        if self.runner.server is not None:
            self.runner.server.pre_shutdown()

    async def stop(self) -> None:
        """Stop listening, wait up to `shutdown_timeout` for handlers, run the cleanups."""
        await self.runner.cleanup()


async def start_server(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    reuse_port: bool = False,
    shutdown_timeout: float = 5.0,
    unix_path: str | None = None,
    client: ClientConfig | None = None,
) -> RunningServer:
    """Start serving `app`; return once it listens (its startup hooks have run).

    `reuse_port`: bind with SO_REUSEPORT (several processes on one port). `unix_path`: also
    serve the same app on this unix socket (the sibling channel of `--processes`). `client`
    bounds what a client connection may send and how slowly (defaults: config.py).
    """
    client = client or ClientConfig()
    front = app.get(FRONT)  # the gateway's own protocol for relay requests (front.py)
    if front is not None:
        front.limits = FrontLimits.of(client, front.limits.max_body_bytes)
    gate = app.get(GATE)  # refusals of malformed HTTP are counted too (its error hooks)
    runner = ClientRunner(
        app,
        front=front,
        gate=gate,
        limit=ConnectionLimit(client.max_connections, gate),
        max_head_bytes=client.max_head_bytes,
        handler_cancellation=True,  # a departed client cancels its handler (and the relay)
        access_log=None,  # the gateway writes its own, structured and opt-in
        shutdown_timeout=shutdown_timeout,
        # aiohttp closes a connection that has not sent a whole request line and headers
        # this long after it opened or after its previous answer: a slow-loris guard, and
        # the idle keep-alive limit (aiohttp's own default is an hour).
        keepalive_timeout=client.header_timeout,
        # After an answer given before the body was whole, the rest of it is read and dropped
        # this long at most (so the client reads the answer, not a reset); the front path's
        # linger is the same.
        lingering_time=client.body_timeout,
        max_line_size=client.max_header_bytes,
        max_field_size=client.max_header_bytes,
        max_headers=client.max_headers,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None, backlog=4096)
    try:
        try:
            await site.start()
        except OSError as e:
            raise CannotListen(f"the API at {host}:{port}: {e.strerror or e}") from e
        if unix_path is not None:
            await web.UnixSite(runner, unix_path).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses and port == 0 else port
    return RunningServer(runner, host, bound)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (it is a dependency on Linux), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is installed on every supported platform
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` on a fresh loop; SIGINT/SIGTERM set `stop`. Returns when main does."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await main(stop)

    with asyncio.Runner(loop_factory=new_event_loop) as r:
        r.run(runner())

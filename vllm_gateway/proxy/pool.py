"""Keep-alive HTTP connection pools to workers, one set per gateway process.

Relay traffic uses `UpstreamConnection`s (connection.py): per worker URL, a set of idle
connections, most recently used first. There is no cap on connections (a cap would
silently queue the 101st stream behind the others): admission is the dispatcher's job, not
the pool's. Probes and scrapes, which are few and not latency-critical, use one aiohttp
`ClientSession` (`session`).

Idle connections are dropped after `IDLE_CONNECTION_SECONDS`, on reuse and by a sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from urllib.parse import urlsplit

import aiohttp

from vllm_gateway.proxy.connection import UpstreamConnection

# vLLM's HTTP server (uvicorn) closes an idle keep-alive connection after 5 s
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE). Dropping ours a little earlier avoids sending a request
# down a connection the worker is closing at that very moment.
IDLE_CONNECTION_SECONDS = 4.0


class Origin:
    """Where a worker URL points: host, port, TLS, and the Host header to send."""

    __slots__ = ("host", "host_header", "port", "ssl")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if tls else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if tls else None
        self.host_header = parts.netloc.encode("idna" if not parts.netloc.isascii() else "ascii")


class UpstreamPool:
    """The process's connections to workers; relay traffic and probes share the pool.

    Built with the app, opened when the app starts (a session belongs to a running loop).
    Counters for telemetry: `opened` (connections made), `reused` (exchanges sent on a
    kept-alive connection).
    """

    def __init__(self, connect_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None
        self._idle: dict[str, dict[UpstreamConnection, None]] = {}
        self._origins: dict[str, Origin] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self.opened = 0
        self.reused = 0

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "UpstreamPool used before open()"
        return self._session

    def origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = Origin(url)
        return origin

    async def acquire(self, url: str) -> UpstreamConnection:
        """An open connection to the worker at `url`: an idle one, or a new one.

        Raises OSError (refused, unreachable) or TimeoutError (connect timeout).
        """
        idle = self._idle.get(url)
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.popitem()[0]  # the most recently used
                conn.pool_idle = None
                if conn.transport is not None and now - conn.idle_since < IDLE_CONNECTION_SECONDS:
                    self.reused += 1
                    return conn
                conn.close()
        origin = self.origin(url)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout or None):
            _, conn = await loop.create_connection(
                lambda: UpstreamConnection(url, loop),
                origin.host,
                origin.port,
                ssl=origin.ssl,
            )
        self.opened += 1
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        """Take back a connection after its exchange: kept if reusable, else closed."""
        conn.finish()
        if not conn.reusable:
            return
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = {}
        conn.idle_since = time.monotonic()
        conn.pool_idle = idle
        idle[conn] = None

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def sweep(self) -> None:
        """Close connections idle for longer than IDLE_CONNECTION_SECONDS."""
        limit = time.monotonic() - IDLE_CONNECTION_SECONDS
        for idle in self._idle.values():
            for conn in [c for c in idle if c.idle_since < limit]:
                idle.pop(conn, None)
                conn.pool_idle = None
                conn.close()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(IDLE_CONNECTION_SECONDS / 2)
            self.sweep()

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=0,
            keepalive_timeout=IDLE_CONNECTION_SECONDS,
            ttl_dns_cache=10,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # Relay bytes untouched: no decompression, no cookies, no headers of our own.
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout or None),
            raise_for_status=False,
        )
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="upstream-sweeper")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for idle in self._idle.values():
            for conn in list(idle):
                conn.close()
            idle.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

"""Keep-alive HTTP connection pools to workers, one set per gateway process.

One `ClientSession` over one connector serves every worker: the connector keeps a pool of
idle connections per worker address and reuses them across requests. There is no cap on
concurrent connections (aiohttp's default of 100 would silently queue the 101st stream
behind the others): admission is the dispatcher's job, not the pool's.
"""

from __future__ import annotations

import aiohttp

# vLLM's HTTP server (uvicorn) closes an idle keep-alive connection after 5 s
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE). Dropping ours a little earlier avoids sending a request
# down a connection the worker is closing at that very moment.
IDLE_CONNECTION_SECONDS = 4.0


class UpstreamPool:
    """The process's connections to workers; relay traffic and probes share them.

    Built with the app, opened when the app starts (a session belongs to a running loop).
    """

    def __init__(self, connect_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "UpstreamPool used before open()"
        return self._session

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

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

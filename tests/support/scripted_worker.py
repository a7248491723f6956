"""A worker whose answers a test scripts byte by byte, for the relay's edge cases.

It answers probes (GET /health, /v1/models for model "m") itself; every POST runs the
test's `script(transport, body)` coroutine, which writes whatever bytes it likes (framing
errors included). `post_connections` says which connection each POST came on, so tests
can see keep-alive reuse.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httptools

Script = Callable[[asyncio.Transport, bytes], Awaitable[None]]

_MODELS = b'{"object":"list","data":[{"id":"m","object":"model"}]}'


def response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        content_type,
        len(body),
        body,
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n"
SSE_HEAD = CHUNKED_HEAD % b"text/event-stream"
LAST_CHUNK = b"0\r\n\r\n"


class _Protocol(asyncio.Protocol):
    def __init__(self, server: ScriptedWorker) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections += 1
        self.server.transports.add(self.transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.closed += 1
        self.server.transports.discard(self.transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()  # type: ignore[union-attr]

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, self.url = self.url, b""
        body = b"".join(self.body)
        self.body.clear()
        t = self.transport
        assert t is not None
        if self.parser.get_method() != b"POST":
            t.write(response(200, _MODELS if url == b"/v1/models" else b"{}"))
            return
        self.server.requests.append(body)
        self.server.post_connections.append(id(self))
        task = asyncio.get_running_loop().create_task(self.server.script(t, body))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)


class ScriptedWorker:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.closed = 0
        self.requests: list[bytes] = []
        self.post_connections: list[int] = []  # which connection each POST came on
        self.transports: set[asyncio.Transport] = set()
        self.tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> ScriptedWorker:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Protocol(self), "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for t in list(self.transports):
            t.abort()
        if self._server is not None:
            self._server.close()

"""Raw HTTP/1.1 over a plain socket, for requests no well-behaved client library would send.

`exchange` (asyncio) and `exchange_sync` (blocking, for hypothesis) send bytes as they are
and read one answer: status, headers, body (by Content-Length or chunked), and whether the
server then closed the connection. `Connection` sends several requests on one connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass, field

import orjson


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    body: bytes = b""
    closed: bool = False  # the server closed the connection after this answer

    def error(self) -> dict:
        """The OpenAI error object of the body (AssertionError if the body is not one)."""
        assert self.headers.get("content-type", "").startswith("application/json"), self
        doc = orjson.loads(self.body)
        assert isinstance(doc, dict) and set(doc) == {"error"}, doc
        assert {"message", "type", "param", "code"} <= set(doc["error"]), doc
        assert isinstance(doc["error"]["message"], str) and doc["error"]["message"], doc
        return doc["error"]


class NoAnswer(Exception):
    """The connection closed (or the time ran out) before a whole answer arrived."""


def parse(buf: bytes) -> tuple[Answer, int] | None:
    """One answer from the front of `buf` and the bytes it used; None if incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buf[:end].decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
        later = parse(buf[end + 4 :])
        return None if later is None else (later[0], end + 4 + later[1])
    headers: dict[str, str] = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    rest = end + 4
    if "content-length" in headers:
        n = int(headers["content-length"])
        if len(buf) < rest + n:
            return None
        return Answer(status, headers, buf[rest : rest + n]), rest + n
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        pos = rest
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size = int(buf[pos:eol].split(b";")[0], 16)
            if len(buf) < eol + 2 + size + 2:
                return None
            body += buf[eol + 2 : eol + 2 + size]
            pos = eol + 2 + size + 2
            if size == 0:
                return Answer(status, headers, body), pos
    return None  # no framing: the body runs to the close


class Connection:
    """One keep-alive connection: send requests on it one after another, read each answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = b""

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, data: bytes, timeout: float = 10.0) -> Answer:
        self.writer.write(data)
        async with asyncio.timeout(timeout):
            while (parsed := parse(self.buf)) is None:
                chunk = await self.reader.read(65536)
                if not chunk:
                    raise NoAnswer(self.buf[:300])
                self.buf += chunk
        answer, used = parsed
        self.buf = self.buf[used:]
        return answer

    def close(self) -> None:
        self.writer.close()


async def exchange(
    port: int, data: bytes | list[bytes], *, gap: float = 0.0, timeout: float = 10.0
) -> Answer:
    """Send `data` (pieces `gap` s apart) to 127.0.0.1:port and read one answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(timeout):
            for piece in [data] if isinstance(data, bytes) else data:
                writer.write(piece)
                await writer.drain()
                if gap:
                    await asyncio.sleep(gap)
            buf = b""
            while (parsed := parse(buf)) is None:
                chunk = await reader.read(65536)
                if not chunk:
                    raise NoAnswer(buf[:300])
                buf += chunk
            answer, _ = parsed
            try:
                async with asyncio.timeout(0.5):
                    answer.closed = (await reader.read(1)) == b""
            except TimeoutError:
                answer.closed = False
            return answer
    except ConnectionResetError as e:
        raise NoAnswer(repr(e)) from None
    finally:
        writer.close()


def exchange_sync(port: int, data: bytes, timeout: float = 10.0) -> Answer:
    """Blocking `exchange` for one request sent whole (a hypothesis example)."""
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)  # a server may refuse early and close; its answer still counts
        buf = b""
        while (parsed := parse(buf)) is None:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                raise NoAnswer(buf[:300])
            buf += chunk
        return parsed[0]


def request(
    body: bytes,
    path: str = "/v1/completions",
    headers: dict[str, str] | list[tuple[str, str]] | None = None,
    *,
    length: bool = True,
    close: bool = True,
) -> bytes:
    """A POST as raw bytes; Content-Length added unless `length` is False."""
    items = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
    lines = [f"POST {path} HTTP/1.1", "Host: gateway"]
    lines += [f"{k}: {v}" for k, v in items]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body

"""What an unauthenticated client connection costs: RSS of one gateway process with N idle
connections, then N connections each sending a request head of LINES lines of 8,100 bytes
and never finishing it (docs/reliability.md quotes the figures).

    python -m benchmarks.client_memory 300 120     # the issue's attack: refused at the bound
    python -m benchmarks.client_memory 300 7       # a head just under the 64 KiB bound, held
    VLLM_GATEWAY_CLIENT_FRONT_PATH=false python -m benchmarks.client_memory 300 7

Loopback only; the gateway is `vllm-gateway serve` with a worker nobody answers for.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

PAD = b"a" * 8100
Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def hold(port: int, lines: int) -> Conn:
    """A connection that sent `lines` header lines of a head it never finishes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if lines:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: g\r\n")
        for i in range(lines):
            try:
                writer.write(b"X-Pad-%d: %s\r\n" % (i, PAD))
                await writer.drain()
            except ConnectionError:
                break  # refused at the bound
    return reader, writer


async def close_all(conns: list[Conn]) -> None:
    for _, writer in conns:
        writer.close()
    await asyncio.sleep(2.0)


async def measure(port: int, pid: int, n: int, lines: int) -> str:
    start = rss_mb(pid)
    idle = [await hold(port, 0) for _ in range(n)]
    await asyncio.sleep(1.0)
    with_idle = rss_mb(pid)
    await close_all(idle)
    before = rss_mb(pid)
    slow = list(await asyncio.gather(*(hold(port, lines) for _ in range(n))))
    await asyncio.sleep(2.0)
    with_slow = rss_mb(pid)
    await close_all(slow)
    after = rss_mb(pid)
    return (
        f"N={n} lines={lines}: start {start:.1f} MB; {n} idle {with_idle:.1f} MB "
        f"({(with_idle - start) * 1024 / n:.1f} KB each); {n} slow-head {with_slow:.1f} MB "
        f"({(with_slow - before) * 1024 / n:.1f} KB each); after they closed {after:.1f} MB"
    )


async def main(n: int, lines: int) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_gateway", "serve", "--worker", "http://127.0.0.1:9"]
    env = dict(os.environ, VLLM_GATEWAY_LOG_LEVEL="warning")
    out = subprocess.DEVNULL
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=env, stdout=out, stderr=out)
    try:
        for _ in range(100):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            writer.close()
            break
        await asyncio.sleep(1.0)
        print(await measure(port, proc.pid, n, lines))
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    head_lines = int(sys.argv[2]) if len(sys.argv) > 2 else 120
    asyncio.run(main(count, head_lines))

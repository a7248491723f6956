"""Split a py-spy raw profile (`py-spy record --native -f raw`) of the gateway by owner.

Each sample goes to the system call it sits in (write, read, epoll_pwait, ...), else to the
package of its innermost Python frame (aiohttp, vllm_gateway, asyncio, structlog, ...).
Prints the share of each: where a request's microseconds go.

    python -m benchmarks.profile_split bench-out/req-native.folded
"""

from __future__ import annotations

import collections
import sys

SYSCALLS = ("write", "read", "epoll_pwait", "getpid", "writev", "sendmsg", "recvfrom")


def owner(frames: list[str]) -> str:
    leaf = frames[-1]
    name = leaf.split(" (")[0]
    if "libc.so" in leaf and name in SYSCALLS:
        return f"syscall {name}"
    for frame in reversed(frames):
        if ".py:" not in frame:
            continue
        path = frame.split(" (", 1)[1]
        for package in ("vllm_gateway", "aiohttp", "structlog", "multidict", "yarl"):
            if f"/{package}/" in path or path.startswith(f"{package}/"):
                return package
        if "asyncio" in path:
            return "asyncio"
        return "other python"
    return "event loop (uvloop, C)"


def main(path: str) -> None:
    counts: collections.Counter[str] = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, n = line.rsplit(" ", 1)
            counts[owner(stack.split(";"))] += int(n)
    total = sum(counts.values())
    for key, n in counts.most_common():
        print(f"{100 * n / total:5.1f}%  {key}")


if __name__ == "__main__":
    main(sys.argv[1])

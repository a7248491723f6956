"""systemd's notify protocol (sd_notify(3)): tell the service manager how the gateway is doing.

A message is one datagram of newline-separated `KEY=VALUE` lines sent to the Unix socket
named by `$NOTIFY_SOCKET`; a name starting with `@` is in the abstract namespace (a leading
NUL byte). Without `$NOTIFY_SOCKET` (not under systemd, or not `Type=notify`) every call is
a no-op, so the daemon calls these unconditionally. No dependency: it is one `sendto`.

The gateway sends, in order: READY=1 once it listens and has probed its workers;
RELOADING=1 (with MONOTONIC_USEC, which systemd >= 253 requires) then READY=1 around a
reload; STOPPING=1 when it starts shutting down; WATCHDOG=1 every half `$WATCHDOG_USEC`
while its event loop runs, so a hung loop gets the service restarted (`WatchdogSec=`).

With `serve --processes N`, systemd knows only the supervisor (NotifyAccess=main): the
processes send to the supervisor's private socket instead, tagged `GATEWAY_PROCESS=i`, and
`ProcessNotifications` tells systemd READY once all N are ready (and again once all N
reloaded), and pings its watchdog only while every process keeps pinging.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import time
from collections.abc import Collection, Mapping

from vllm_gateway.log import get_logger

log = get_logger("vllm_gateway.sd_notify")


class Notifier:
    """Sends notify messages to `$NOTIFY_SOCKET`, or does nothing when it is not set."""

    def __init__(self, env: Mapping[str, str] | None = None, process: int | None = None) -> None:
        env = os.environ if env is None else env
        # One of several processes: say which in every message (to the supervisor).
        self._tag = (f"GATEWAY_PROCESS={process}",) if process is not None else ()
        path = env.get("NOTIFY_SOCKET", "")
        if path.startswith("@"):
            path = "\0" + path[1:]  # abstract namespace
        self.address = path or None
        self.watchdog_seconds = _watchdog_seconds(env)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """Send one message of `KEY=VALUE` lines; return whether it went out. Never raises."""
        if self.address is None:
            return False
        message = "\n".join((*lines, *self._tag)).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(message, self.address)
        except OSError as e:  # systemd gone or socket unwritable: the gateway serves on
            log.warning("sd_notify failed", error=str(e), message=message.decode())
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *_status(status))

    def reloading(self, status: str = "reloading configuration") -> bool:
        # systemd >= 253 wants the CLOCK_MONOTONIC time (µs) of the reload's start with it.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", *_status(status))

    def stopping(self, status: str = "stopping") -> bool:
        return self.send("STOPPING=1", *_status(status))

    def status(self, text: str) -> bool:
        """A one-line status `systemctl status` shows."""
        return self.send(*_status(text))

    async def watchdog(self) -> None:
        """Ping the watchdog every half `WatchdogSec` until cancelled (returns at once without
        one). Runs on the event loop on purpose: a blocked loop stops the pings."""
        if self.watchdog_seconds is None or self.address is None:
            return
        interval = self.watchdog_seconds / 2
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(interval)


def _status(text: str) -> tuple[str, ...]:
    return (f"STATUS={text}",) if text else ()


def _watchdog_seconds(env: Mapping[str, str]) -> float | None:
    """The watchdog period systemd asks for, if it asks this process (`WATCHDOG_PID`)."""
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (e.g. the parent of a forked one)
    with contextlib.suppress(ValueError):
        value = int(usec)
        if value > 0:
            return value / 1_000_000
    return None


class ProcessNotifications:
    """The supervisor's side of `--processes N`: the processes' notify socket, and systemd's.

    Not asyncio: the supervisor is a plain loop that calls `poll` between its other checks.
    """

    def __init__(self, directory: str, count: int, upstream: Notifier) -> None:
        self.path = os.path.join(directory, "notify.sock")
        self.count = count
        self.upstream = upstream
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.bind(self.path)
        self._sock.setblocking(False)
        self.ready: set[int] = set()  # processes that said READY since they started
        self._reloading: set[int] | None = None  # processes yet to finish the reload
        self._refused: list[str] = []  # STATUS of processes that refused the reload
        self._heard: dict[int, float] = {}  # process -> time.monotonic() of its last message
        self._next_ping = 0.0

    def child_env(self) -> dict[str, str]:
        """Environment changes for a process: notify us; keep systemd's watchdog period."""
        return {"NOTIFY_SOCKET": self.path}

    def started(self, index: int) -> None:
        """A process (re)started: it will say READY when it serves."""
        self.ready.discard(index)
        self._heard[index] = time.monotonic()

    def begin_reload(self, alive: Collection[int]) -> None:
        """SIGHUP: tell systemd, then expect READY from every live process."""
        self.upstream.reloading()
        self._reloading = set(alive)
        self._refused = []
        if not self._reloading:
            self._finish_reload()

    def stopping(self) -> None:
        self.upstream.stopping()

    def poll(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for messages, act on them, ping the watchdog."""
        readable, _, _ = select.select([self._sock], [], [], timeout)
        while readable:
            try:
                data = self._sock.recv(4096)
            except BlockingIOError:
                break
            self._handle(dict(_fields(data)))
        self._watchdog()

    def close(self) -> None:
        self._sock.close()

    def _handle(self, msg: dict[str, str]) -> None:
        try:
            index = int(msg.get("GATEWAY_PROCESS", ""))
        except ValueError:
            return
        self._heard[index] = time.monotonic()
        if msg.get("READY") != "1":
            return
        if self._reloading is not None and index in self._reloading:
            self._reloading.discard(index)
            if msg.get("STATUS", "").startswith("reload refused"):
                self._refused.append(msg["STATUS"])
            if not self._reloading:
                self._finish_reload()
            return
        first_time = len(self.ready) < self.count
        self.ready.add(index)
        if first_time and len(self.ready) == self.count:
            self.upstream.ready(f"{self.count} processes ready")

    def _finish_reload(self) -> None:
        self._reloading = None
        status = self._refused[0] if self._refused else f"{self.count} processes reloaded"
        self.upstream.ready(status)

    def _watchdog(self) -> None:
        period = self.upstream.watchdog_seconds
        now = time.monotonic()
        if period is None or now < self._next_ping:
            return
        # Ping only while every process pings us: a hung process gets the unit restarted.
        if all(now - heard < period for heard in self._heard.values()):
            self.upstream.send("WATCHDOG=1")
        self._next_ping = now + period / 2


def _fields(data: bytes) -> list[tuple[str, str]]:
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out.append((key, value))
    return out

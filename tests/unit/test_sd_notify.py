"""sd_notify: datagrams to $NOTIFY_SOCKET (path or abstract), watchdog period, no-op without."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from vllm_gateway.process.sd_notify import Notifier

pytestmark = pytest.mark.timeout(10)


def listener(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(2)
    return s


def fields(message: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in message.decode().splitlines())


def test_path_socket(tmp_path):
    path = str(tmp_path / "notify")
    with listener(path) as s:
        n = Notifier({"NOTIFY_SOCKET": path})
        assert n.enabled
        assert n.ready("serving")
        assert fields(s.recv(4096)) == {"READY": "1", "STATUS": "serving"}
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert n.reloading()
        got = fields(s.recv(4096))
        assert got["RELOADING"] == "1"
        # MONOTONIC_USEC is CLOCK_MONOTONIC in µs, taken when the reload began.
        assert 0 <= int(got["MONOTONIC_USEC"]) - before < 1_000_000
        assert n.stopping()
        assert fields(s.recv(4096))["STOPPING"] == "1"


def test_abstract_socket():
    name = f"vllm-gateway-test-{os.getpid()}-{time.monotonic_ns()}"
    with listener("\0" + name) as s:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert s.recv(4096) == b"READY=1"


def test_without_notify_socket_nothing_is_sent():
    n = Notifier({})
    assert not n.enabled and not n.ready() and not n.stopping()
    assert n.watchdog_seconds is None


def test_a_vanished_socket_is_logged_not_raised(tmp_path):
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}).ready() is False


def test_watchdog_period():
    pid = str(os.getpid())
    assert Notifier({"WATCHDOG_USEC": "3000000"}).watchdog_seconds == 3.0
    assert Notifier({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": pid}).watchdog_seconds == 3.0
    assert Notifier({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}).watchdog_seconds is None
    assert Notifier({"WATCHDOG_USEC": "nope"}).watchdog_seconds is None


async def test_watchdog_pings_at_half_the_period(tmp_path):
    path = str(tmp_path / "notify")
    with listener(path) as s:
        s.setblocking(False)
        n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})  # 0.2 s
        task = asyncio.create_task(n.watchdog())
        await asyncio.sleep(0.45)
        task.cancel()
        pings = []
        while True:
            try:
                pings.append(s.recv(4096))
            except BlockingIOError:
                break
    # At 0, 0.1, 0.2, 0.3, 0.4 s: about five, never fewer than three even on a busy machine.
    assert 3 <= len(pings) <= 6 and set(pings) == {b"WATCHDOG=1"}

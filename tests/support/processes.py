"""Gateway processes for tests: a free port, and `serve` run as a real process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web

from vllm_gateway.app import create_app
from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.fake_worker import FakeWorker
from vllm_gateway.http.server import RunningServer, start_server
from vllm_gateway.process.siblings import socket_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def sibling_apps(
    config: GatewayConfig,
    count: int = 2,
    prepare: Callable[[int, web.Application], None] | None = None,
) -> AsyncIterator[list[RunningServer]]:
    """`count` gateway apps in this process wired as siblings, as `serve --processes N`
    runs them (each with its unix control socket); `prepare(i, app)` may add routes to
    app i before it starts. All are stopped on the way out."""
    with tempfile.TemporaryDirectory() as control_dir:
        servers: list[RunningServer] = []
        try:
            for i in range(count):
                app = create_app(
                    config, process_index=i, process_count=count, control_dir=control_dir
                )
                if prepare is not None:
                    prepare(i, app)
                path = socket_path(control_dir, i)
                servers.append(await start_server(app, unix_path=path, shutdown_timeout=1))
            yield servers
        finally:
            for s in servers:
                await s.stop()


class GatewayProcess:
    """One gateway process, its config file, its notify socket and its JSON log."""

    def __init__(self, tmp_path: Path, workers: list[FakeWorker], **settings: object) -> None:
        self.config_path = tmp_path / "gateway.toml"
        self.log_path = tmp_path / "gateway.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = {"policy": "least_inflight", "shutdown_timeout": 30.0, **settings}
        self.write_config(workers)
        name = f"vllm-gateway-test-{os.getpid()}-{time.monotonic_ns()}"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind("\0" + name)
        self.notify.setblocking(False)
        self.notify_name = "@" + name
        self.proc: asyncio.subprocess.Process | None = None

    def write_config(self, workers: list[FakeWorker], raw: str | None = None) -> None:
        s = self.settings
        text = (
            raw
            if raw is not None
            else (
                f'port = {self.port}\npolicy = "{s["policy"]}"\n'
                '[log]\nformat = "json"\nlevel = "info"\n'
                "[probe]\ninterval = 0.2\ntimeout = 1.0\nstartup_wait = 5.0\n"
                f"[lifecycle]\nshutdown_timeout = {s['shutdown_timeout']}\n"
                + "".join(f'[[workers]]\nurl = "{w.url}"\n' for w in workers)
            )
        )
        self.config_path.write_text(text)

    async def start(self, watchdog_pid: bool = False, **env: str) -> dict[str, str]:
        """Start the process; return its first notification (READY).

        `watchdog_pid`: set WATCHDOG_PID to the gateway's own pid, as systemd does (a shell
        exports its pid, then execs the gateway in its place)."""
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, "-m", "vllm_gateway", "serve", "--config", str(self.config_path)]
        if watchdog_pid:
            cmd = ["sh", "-c", 'export WATCHDOG_PID=$$; exec "$@"', "sh", *cmd]
        self.proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=self._log,
            env={**os.environ, "NOTIFY_SOCKET": self.notify_name, **env},
        )
        return await self.notification()

    async def notification(self, timeout: float = 20.0, skip_watchdog: bool = True) -> dict:
        """The next message on the notify socket, as a dict of its KEY=VALUE lines."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while True:
                data = await loop.sock_recv(self.notify, 4096)
                msg = dict(line.split("=", 1) for line in data.decode().splitlines())
                if not (skip_watchdog and msg == {"WATCHDOG": "1"}):
                    return msg

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout: float = 15.0) -> int:
        assert self.proc is not None
        async with asyncio.timeout(timeout):
            return await self.proc.wait()

    def logs(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line]

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        self.notify.close()
        if hasattr(self, "_log"):
            self._log.close()

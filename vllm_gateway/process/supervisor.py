"""`serve --processes N`: run N gateway processes on one port and keep them running.

The parent process starts N children (fork, before any event loop exists) and does nothing
else: it serves no request. Each child runs a whole gateway (its own pools, probes,
dispatcher) and binds the port with SO_REUSEPORT, so the kernel spreads connections among
them. Each child also listens on a private unix socket in a directory made for this run
(mode 0700), through which control requests reach every sibling (siblings.py).

Port 0 is resolved once, in the parent, by binding a SO_REUSEPORT placeholder socket (it
never listens) so that every child binds the same port. SIGTERM/SIGINT to the parent stop
the children (each finishes its in-flight requests within its shutdown timeout); SIGHUP is
passed on, and each child reloads its configuration from the same sources. A child that
dies unexpectedly is restarted after RESTART_DELAY_SECONDS. Towards systemd the parent
speaks for all children (sd_notify.ProcessNotifications).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable

from vllm_gateway import log as logging_setup
from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.log import get_logger
from vllm_gateway.process.daemon import CANNOT_LISTEN, CLOSE_REST_SECONDS, run_gateway
from vllm_gateway.process.sd_notify import Notifier, ProcessNotifications

log = get_logger("vllm_gateway.supervisor")

RESTART_DELAY_SECONDS = 1.0
# After SIGTERM a child takes up to lifecycle.shutdown_timeout to let requests finish, then
# up to daemon.CLOSE_REST_SECONDS to end the rest; beyond this margin more it is killed.
STOP_MARGIN_SECONDS = 10.0


def serve(config: GatewayConfig, load: Callable[[], GatewayConfig] | None = None) -> int:
    """Run the gateway as configured (one process, or a supervisor of several); `load()`
    re-reads the configuration on SIGHUP (raising ConfigError when it is invalid)."""
    logging_setup.configure(config.log.format, config.log.level)
    if config.processes > 1:
        return run_processes(config, load)
    return run_gateway(config, load)


def _placeholder(host: str, port: int) -> tuple[socket.socket | None, int]:
    """Reserve a port for all children; returns the socket to keep open and the port."""
    if port:
        return None, port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock, sock.getsockname()[1]


def _child(
    config: GatewayConfig,
    load: Callable[[], GatewayConfig] | None,
    index: int,
    count: int,
    control_dir: str,
    env: dict[str, str],
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # A reload passed on before this process's loop handles SIGHUP must not kill it.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    os.environ.update(env)
    if "WATCHDOG_USEC" in os.environ:
        os.environ["WATCHDOG_PID"] = str(os.getpid())  # ping the parent, which pings systemd
    code = run_gateway(
        config, load, process_index=index, process_count=count, control_dir=control_dir
    )
    sys.exit(code)


def run_processes(config: GatewayConfig, load: Callable[[], GatewayConfig] | None = None) -> int:
    """Run `config.processes` gateway processes until SIGTERM/SIGINT; return an exit code.

    SIGHUP is passed on to every process; each reloads with `load()`."""
    placeholder, port = _placeholder(config.host, config.port)
    control_dir = tempfile.mkdtemp(prefix="vllm-gateway-")  # mode 0700
    sup = _Supervisor(dataclasses.replace(config, port=port), load, control_dir)
    old = {s: signal.signal(s, sup.stop) for s in (signal.SIGTERM, signal.SIGINT)}
    old[signal.SIGHUP] = signal.signal(signal.SIGHUP, sup.reload)
    try:
        sup.run()
    finally:
        sup.stop_children()
        for s, handler in old.items():
            signal.signal(s, handler)
        sup.notifications.close()
        if placeholder is not None:
            placeholder.close()
        shutil.rmtree(control_dir, ignore_errors=True)
    log.info("gateway processes stopped")
    return sup.code


class _Supervisor:
    """The parent's state: its children, and the flags its signal handlers set."""

    def __init__(
        self, config: GatewayConfig, load: Callable[[], GatewayConfig] | None, control_dir: str
    ) -> None:
        self.config = config
        self.load = load
        self.count = config.processes
        self.control_dir = control_dir
        self.ctx = multiprocessing.get_context("fork")
        self.children: dict[int, multiprocessing.process.BaseProcess] = {}
        self.notifications = ProcessNotifications(control_dir, self.count, Notifier())
        self.stopping = False
        self.reload_requested = False
        self.code = 0  # the exit code run_processes returns

    def stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def reload(self, signum: int, frame: object) -> None:
        self.reload_requested = True

    def start(self, index: int) -> None:
        env = self.notifications.child_env()
        p = self.ctx.Process(
            target=_child,
            args=(self.config, self.load, index, self.count, self.control_dir, env),
            name=f"gateway-{index}",
        )
        self.notifications.started(index)
        p.start()
        self.children[index] = p

    def run(self) -> None:
        """Start every child, then pass reloads on and restart the dead until stopped."""
        for i in range(self.count):
            self.start(i)
        log.info(
            "gateway processes started",
            processes=self.count,
            port=self.config.port,
            pid=os.getpid(),
        )
        while not self.stopping:
            if self.reload_requested:
                self.reload_requested = False
                alive = {i: p for i, p in self.children.items() if p.is_alive() and p.pid}
                self.notifications.begin_reload(alive)
                for p in alive.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGHUP)  # type: ignore[arg-type]
            for i, p in list(self.children.items()):
                if not p.is_alive() and p.exitcode == CANNOT_LISTEN and not self.stopping:
                    # (its log said which port): the next would fail alike, so all stop
                    log.error("a gateway process cannot listen; stopping them all", index=i)
                    self.stopping, self.code = True, CANNOT_LISTEN
                elif not p.is_alive() and not self.stopping:
                    log.error("gateway process exited; restarting", index=i, code=p.exitcode)
                    time.sleep(RESTART_DELAY_SECONDS)
                    if not self.stopping:
                        self.start(i)
            self.notifications.poll(0.2)

    def stop_children(self) -> None:
        """SIGTERM every child; kill those still running after their grace."""
        self.notifications.stopping()
        for p in self.children.values():
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        grace = self.config.lifecycle.shutdown_timeout + CLOSE_REST_SECONDS + STOP_MARGIN_SECONDS
        deadline = time.monotonic() + grace
        for p in self.children.values():
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)

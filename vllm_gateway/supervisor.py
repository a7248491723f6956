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
import tempfile
import time
from collections.abc import Callable

from vllm_gateway.config import GatewayConfig
from vllm_gateway.daemon import CLOSE_REST_SECONDS
from vllm_gateway.log import get_logger
from vllm_gateway.sd_notify import Notifier, ProcessNotifications

log = get_logger("vllm_gateway.supervisor")

RESTART_DELAY_SECONDS = 1.0
# After SIGTERM a child takes up to lifecycle.shutdown_timeout to let requests finish, then
# up to daemon.CLOSE_REST_SECONDS to end the rest; beyond this margin more it is killed.
STOP_MARGIN_SECONDS = 10.0


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
    from vllm_gateway.daemon import run_gateway

    run_gateway(config, load, process_index=index, process_count=count, control_dir=control_dir)


def run_processes(config: GatewayConfig, load: Callable[[], GatewayConfig] | None = None) -> int:
    """Run `config.processes` gateway processes until SIGTERM/SIGINT; return an exit code.

    SIGHUP is passed on to every process; each reloads with `load()`."""
    count = config.processes
    placeholder, port = _placeholder(config.host, config.port)
    config = dataclasses.replace(config, port=port)
    control_dir = tempfile.mkdtemp(prefix="vllm-gateway-")  # mode 0700
    ctx = multiprocessing.get_context("fork")
    children: dict[int, multiprocessing.process.BaseProcess] = {}
    notifications = ProcessNotifications(control_dir, count, Notifier())
    stopping = False
    reload_requested = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def reload(signum: int, frame: object) -> None:
        nonlocal reload_requested
        reload_requested = True

    def start(index: int) -> None:
        env = notifications.child_env()
        p = ctx.Process(
            target=_child,
            args=(config, load, index, count, control_dir, env),
            name=f"gateway-{index}",
        )
        notifications.started(index)
        p.start()
        children[index] = p

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    old[signal.SIGHUP] = signal.signal(signal.SIGHUP, reload)
    try:
        for i in range(count):
            start(i)
        log.info("gateway processes started", processes=count, port=port, pid=os.getpid())
        while not stopping:
            if reload_requested:
                reload_requested = False
                alive = {i: p for i, p in children.items() if p.is_alive() and p.pid}
                notifications.begin_reload(alive)
                for p in alive.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGHUP)  # type: ignore[arg-type]
            for i, p in list(children.items()):
                if not p.is_alive() and not stopping:
                    log.error("gateway process exited; restarting", index=i, code=p.exitcode)
                    time.sleep(RESTART_DELAY_SECONDS)
                    if not stopping:
                        start(i)
            notifications.poll(0.2)
    finally:
        notifications.stopping()
        for p in children.values():
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        grace = config.lifecycle.shutdown_timeout + CLOSE_REST_SECONDS + STOP_MARGIN_SECONDS
        deadline = time.monotonic() + grace
        for p in children.values():
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        for s, handler in old.items():
            signal.signal(s, handler)
        notifications.close()
        if placeholder is not None:
            placeholder.close()
        shutil.rmtree(control_dir, ignore_errors=True)
    log.info("gateway processes stopped")
    return 0

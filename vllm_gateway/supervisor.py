"""`serve --processes N`: run N gateway processes on one port and keep them running.

The parent process starts N children (fork, before any event loop exists) and does nothing
else: it serves no request. Each child runs a whole gateway (its own pools, probes,
dispatcher) and binds the port with SO_REUSEPORT, so the kernel spreads connections among
them. Each child also listens on a private unix socket in a directory made for this run
(mode 0700), through which control requests reach every sibling (siblings.py).

Port 0 is resolved once, in the parent, by binding a SO_REUSEPORT placeholder socket (it
never listens) so that every child binds the same port. SIGTERM/SIGINT to the parent stop
the children (each finishes its in-flight requests within its shutdown timeout); a child
that dies unexpectedly is restarted after RESTART_DELAY_SECONDS.
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

from vllm_gateway.config import GatewayConfig
from vllm_gateway.log import get_logger

log = get_logger("vllm_gateway.supervisor")

RESTART_DELAY_SECONDS = 1.0
# How long the children get to finish after SIGTERM before they are killed (seconds).
STOP_GRACE_SECONDS = 30.0


def _placeholder(host: str, port: int) -> tuple[socket.socket | None, int]:
    """Reserve a port for all children; returns the socket to keep open and the port."""
    if port:
        return None, port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock, sock.getsockname()[1]


def _child(config: GatewayConfig, index: int, count: int, control_dir: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from vllm_gateway.daemon import run_gateway

    run_gateway(config, process_index=index, process_count=count, control_dir=control_dir)


def run_processes(config: GatewayConfig) -> int:
    """Run `config.processes` gateway processes until SIGTERM/SIGINT; return an exit code."""
    count = config.processes
    placeholder, port = _placeholder(config.host, config.port)
    config = dataclasses.replace(config, port=port)
    control_dir = tempfile.mkdtemp(prefix="vllm-gateway-")  # mode 0700
    ctx = multiprocessing.get_context("fork")
    children: dict[int, multiprocessing.process.BaseProcess] = {}
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def start(index: int) -> None:
        p = ctx.Process(
            target=_child, args=(config, index, count, control_dir), name=f"gateway-{index}"
        )
        p.start()
        children[index] = p

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i in range(count):
            start(i)
        log.info("gateway processes started", processes=count, port=port, pid=os.getpid())
        while not stopping:
            for i, p in list(children.items()):
                if not p.is_alive() and not stopping:
                    log.error("gateway process exited; restarting", index=i, code=p.exitcode)
                    time.sleep(RESTART_DELAY_SECONDS)
                    if not stopping:
                        start(i)
            time.sleep(0.2)
    finally:
        for p in children.values():
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for p in children.values():
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        for s, handler in old.items():
            signal.signal(s, handler)
        if placeholder is not None:
            placeholder.close()
        shutil.rmtree(control_dir, ignore_errors=True)
    log.info("gateway processes stopped")
    return 0

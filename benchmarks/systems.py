"""The processes of one dispatch measurement: fake workers, and the system in front of them.

A system is a dispatcher and its policy: the gateway (`vllm-gateway serve --policy P`,
any name it accepts, passed through) or vllm-router (`--policy P`). With replicas > 1,
that many processes of it are started separately in front of the same workers, each
with its own view of them (as behind an L4 balancer). Logs go to bench-out/.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.procs import Proc, free_port, wait_http
from benchmarks.router import start_router
from benchmarks.workload import WorkerSpec

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench-out"
GATEWAY, ROUTER = "gateway", "vllm-router"


@dataclass(frozen=True)
class System:
    kind: str  # GATEWAY or ROUTER
    policy: str

    @property
    def name(self) -> str:
        return f"{self.kind} {self.policy}"


def kind_of(name: str) -> str:
    """The kind of a system from its name (System.name; neither kind has a space)."""
    return name.split(" ", 1)[0]


def default_policy() -> str:
    """The gateway's default policy, from its own settings (whatever it is today)."""
    from vllm_gateway.config.gateway import GatewayConfig

    return GatewayConfig().policy


def start_workers(
    specs: Sequence[WorkerSpec], log_requests: bool = False
) -> tuple[list[Proc], list[str]]:
    """Start one fake worker process per spec (all at once), wait until each is healthy;
    with `log_requests`, each logs its requests' prefills into its log file
    (`worker_logs` names the files)."""
    procs, urls = [], []
    for i, spec in enumerate(specs):
        port = free_port()
        cmd = [sys.executable, "-m", "vllm_gateway.fake_worker", "--port", str(port)]
        cmd += spec.args() + (["--log-requests"] if log_requests else [])
        procs.append(Proc(f"worker{i}", cmd, str(worker_logs(len(specs))[i]), cwd=ROOT))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for proc, url in zip(procs, urls, strict=True):
            wait_http(url + "/health", 30, proc)
    except Exception:
        stop(procs)
        raise
    return procs, urls


def start_system(
    system: System,
    workers: list[str],
    replicas: int,
    router_bin: str | None,
    processes: int = 1,
    access_log: bool = False,
    sync: bool = False,
) -> tuple[list[Proc], list[str]]:
    """Start `replicas` of `system` in front of `workers`: procs and entry URLs. The
    gateway runs as `serve --processes processes` (vllm-router as it is: one process
    using every core), with its access log into its log file if `access_log`
    (`gateway_logs` names the files); `sync`: its replicas tell each other their
    placements (`[replicas]`, every one given the same list of all of them)."""
    procs: list[Proc] = []
    urls: list[str] = []
    feeds = [f"127.0.0.1:{free_port()}" for _ in range(replicas)] if sync else []
    try:
        for r in range(replicas):
            if system.kind == ROUTER:
                assert router_bin is not None
                name = f"dispatch-router-{system.policy}-{r}"
                proc, url = start_router(router_bin, workers, ["--policy", system.policy], name)
            else:
                peers = (feeds[r], feeds) if feeds else None
                proc, url = _start_gateway(system.policy, workers, r, processes, access_log, peers)
            procs.append(proc)
            urls.append(url)
    except Exception:
        stop(procs)
        raise
    return procs, urls


def worker_logs(count: int) -> list[Path]:
    """The log files of `count` fake workers (start_workers)."""
    return [OUT / f"dispatch-worker{i}.log" for i in range(count)]


def gateway_logs(policy: str, replicas: int) -> list[Path]:
    """The log files of a gateway system's replicas (each replica's processes share one)."""
    return [OUT / f"dispatch-gateway-{policy}-{r}.log" for r in range(replicas)]


def _start_gateway(
    policy: str,
    workers: list[str],
    replica: int,
    processes: int = 1,
    access_log: bool = False,
    peers: tuple[str, list[str]] | None = None,
) -> tuple[Proc, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_gateway", "serve", "--port", str(port)]
    if processes > 1:
        cmd += ["--processes", str(processes)]
    cmd += ["--policy", policy, "--log-level", "warning", "--log-format", "json"]
    for url in workers:
        cmd += ["--worker", url]
    if access_log:
        cmd.append("--access-log")
    env = None
    if peers is not None:  # (listen, every replica's address)
        cmd += ["--replica-listen", peers[0]]
        for address in peers[1]:
            cmd += ["--peer", address]
        env = {**os.environ, "VLLM_GATEWAY_REPLICAS_TOKEN": "bench-dispatch-replicas"}
    log = str(gateway_logs(policy, replica + 1)[replica])
    proc = Proc(f"gateway-{policy}-{replica}", cmd, log, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 30, proc)
    return proc, url


def stop(procs: Sequence[Proc]) -> None:
    for proc in procs:
        proc.stop()

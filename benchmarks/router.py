"""vllm-router for the benchmarks: where it is installed, and starting it in front of workers.

`scripts/bench_overhead --install-router` (or bench_dispatch's) installs it from PyPI into
bench-out/router-venv (scripts/_venv.sh, install_router); it is looked up there, then on
PATH. Every benchmark that compares against it uses these two functions.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.procs import Proc, free_port, wait_http

OUT = Path(__file__).resolve().parent.parent / "bench-out"
INSTALL_HINT = "not installed (scripts/bench_overhead --install-router)"


def find_router(explicit: str | None = None, disabled: bool = False) -> str | None:
    """The vllm-router executable: `explicit`, else bench-out's venv, else PATH; or None."""
    if disabled:
        return None
    for candidate in (explicit, OUT / "router-venv/bin/vllm-router", "vllm-router"):
        if candidate and (path := shutil.which(str(candidate))):
            return path
    return None


def start_router(
    binary: str, workers: list[str], flags: list[str], name: str = "vllm-router"
) -> tuple[Proc, str]:
    """Start vllm-router on 127.0.0.1 in front of `workers`; wait until it answers /health.

    Its log goes to bench-out/<name>.log.
    """
    port = free_port()
    cmd = [binary, "--worker-urls", *workers, "--host", "127.0.0.1", "--port", str(port)]
    # Its Prometheus exporter listens on a fixed port by default (29000): a second router
    # (a replica, or another benchmark's) would fail to start.
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    cmd += [*flags, "--log-level", "warning"]
    proc = Proc(name, cmd, str(OUT / f"{name}.log"))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 60, proc)
    return proc, url

"""Soak: many concurrent streams through a real gateway process for a fixed time, with random
client disconnects and a worker killed and restarted in the middle; then check that nothing
was lost, hung or leaked.

    scripts/soak                        # 2,000 streams for 60 s (python -m benchmarks.soak)
    scripts/soak --streams 300 --duration 15

The fake workers (`vllm-gateway fake-worker`) and the gateway (`vllm-gateway serve`) each
run as their own process on 127.0.0.1, so the gateway's memory, file descriptors and
connections are its own (read from /proc), and the restart is a real SIGKILL followed by a
new process on the same port. The load runs here: `streams` requests at once, each one
replaced by a new one when it ends, until `duration` is over. Before it, a short warm-up at
the same concurrency lets the gateway's memory reach its working size, so "back near its
start" compares like with like.

Every request ends in exactly one outcome:

    completed    every token, then [DONE] (or the whole JSON answer)
    left         the client left on purpose, mid-answer (the random disconnects)
    clean_error  the gateway said what went wrong: an OpenAI error body, or an SSE error
                 event and a proper end of the stream (requests on the killed worker)
    lost         anything else: a stream cut without an error event, a reset, a wrong body
    hung         no end within the client's deadline, or the gateway's 504 (the fake
                 workers never stall, so a first-byte timeout means a request was stuck)

The soak passes when lost and hung are 0 and, once the load is over: every worker's
in-flight count at the gateway is 0; each worker runs and queues nothing; the gateway holds no
client connection and no worker connection beyond the probes' and scrapes' keep-alive ones
(two per worker; the relay's idle ones expire after 4 s); its file descriptors are back to
their start (+2) and its resident memory within `rss_slack` of its warm start; and in a run
of two minutes or more, memory no longer grows from the middle third of the run to the last.
tests/unit/test_soak.py runs a short variant in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.procs import Proc, free_port, rss_bytes
from benchmarks.soak_load import MODEL, OUTCOMES, Load, Report, SoakConfig

__all__ = ["Report", "SoakConfig", "render", "run_soak"]

# --- the processes -------------------------------------------------------------------------


class Cluster:
    """The fake workers and the gateway, as processes."""

    def __init__(self, cfg: SoakConfig, log_dir: Path) -> None:
        self.cfg = cfg
        self.log_dir = log_dir
        self.worker_ports = [free_port() for _ in range(cfg.workers)]
        self.workers: list[Proc | None] = [None] * cfg.workers
        self.gateway: Proc | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.restarts = 0

    def worker_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.worker_ports[i]}"

    def start_worker(self, i: int) -> None:
        cfg = self.cfg
        cmd = [sys.executable, "-m", "vllm_gateway", "fake-worker", "--model", MODEL]
        cmd += ["--port", str(self.worker_ports[i]), "--tpot-ms", str(cfg.tpot_ms)]
        cmd += ["--ttft-ms", str(cfg.ttft_ms), "--max-num-seqs", str(cfg.streams)]
        log = self.log_dir / f"worker{i}-{self.restarts}.log"
        self.workers[i] = Proc(f"worker{i}", cmd, str(log), stdout=subprocess.DEVNULL)

    def kill_worker(self, i: int) -> None:
        """Kill worker i at once (SIGKILL): its connections die with it."""
        proc = self.workers[i]
        assert proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.popen.wait(5)
        proc.log.close()
        self.workers[i] = None
        self.restarts += 1

    def start_gateway(self) -> None:
        text = (
            f'port = {self.port}\n[log]\nformat = "json"\nlevel = "warning"\n'
            f"access_log = {'true' if self.cfg.access_log else 'false'}\n"
            "[probe]\ninterval = 0.5\ntimeout = 2.0\nstartup_wait = 10.0\n"
            "[timeouts]\nfirst_byte = 30.0\nidle = 30.0\n"
            + "".join(
                f'[[workers]]\nurl = "{self.worker_url(i)}"\n' for i in range(len(self.workers))
            )
        )
        path = self.log_dir / "gateway.toml"
        path.write_text(text)
        cmd = [sys.executable, "-m", "vllm_gateway", "serve", "--config", str(path)]
        self.gateway = Proc("gateway", cmd, str(self.log_dir / "gateway.log"))

    def stop(self) -> None:
        for proc in [self.gateway, *self.workers]:
            if proc is not None:
                proc.stop()


async def wait_ok(session: aiohttp.ClientSession, url: str, timeout: float) -> None:
    """Wait until GET `url` answers 200."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {timeout} s")
        await asyncio.sleep(0.1)


# --- what the gateway process holds (from /proc) --------------------------------------------


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def connections(pid: int, own_port: int, worker_ports: list[int]) -> tuple[int, int]:
    """The process's established TCP connections: (from clients, to workers)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    clients = upstream = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.read().splitlines()[1:]:
                parts = line.split()
                if parts[3] != "01" or parts[9] not in inodes:  # 01: ESTABLISHED
                    continue
                local = int(parts[1].rsplit(":", 1)[1], 16)
                remote = int(parts[2].rsplit(":", 1)[1], 16)
                if local == own_port:
                    clients += 1
                elif remote in worker_ports:
                    upstream += 1
    return clients, upstream


async def gateway_numbers(session: aiohttp.ClientSession, url: str) -> tuple[int, float]:
    """(sum of the workers' in-flight counts, retries so far) as the gateway reports them."""
    async with session.get(url + "/list_workers") as r:
        workers = (await r.json())["workers"]
    inflight = sum(w["inflight"] for w in workers)
    retries = 0.0
    with contextlib.suppress(aiohttp.ClientError):
        async with session.get(url + "/metrics") as r:
            text = await r.text()
        match = re.search(r"^vllm_gateway_retries_total\S* (\S+)$", text, re.M)
        if match:
            retries = float(match.group(1))
    return inflight, retries


async def worker_stats(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/fake/stats") as r:
        doc = await r.json()
    return {k: v for k, v in doc.items() if isinstance(v, int)}


# --- the soak ------------------------------------------------------------------------------


async def run_soak(cfg: SoakConfig) -> Report:
    """Start the processes, warm up, run the load with a worker restart, settle, check."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it
    report = Report()
    rng = random.Random(cfg.seed)
    with contextlib.ExitStack() as stack:
        log_dir = Path(cfg.log_dir or stack.enter_context(tempfile.TemporaryDirectory()))
        log_dir.mkdir(parents=True, exist_ok=True)
        cluster = Cluster(cfg, log_dir)
        stack.callback(cluster.stop)
        for i in range(cfg.workers):
            cluster.start_worker(i)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for i in range(cfg.workers):
                await wait_ok(session, cluster.worker_url(i) + "/health", 30)
            cluster.start_gateway()
            await wait_ok(session, cluster.url + "/health", 30)
            assert cluster.gateway is not None
            pid = cluster.gateway.pid
            load = Load(cfg, cluster.url, report, rng)
            if cfg.warmup:
                await load.run(session, cfg.warmup, count=False)
        # A fresh client session for the measured run; the warm-up's connections are gone.
        await settle(cfg, cluster, report, baseline=True)
        report.rss_start, report.fds_start = rss_bytes(pid), fd_count(pid)
        _, report.upstream_start = connections(pid, cluster.port, cluster.worker_ports)

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            report.rss_every = cfg.duration / 10
            sampler = asyncio.create_task(sample_rss(pid, report))
            restarter = asyncio.create_task(restart_worker(cfg, cluster, session))
            t0 = time.monotonic()
            await load.run(session, cfg.duration, count=True)
            report.load_seconds = time.monotonic() - t0
            await restarter
            sampler.cancel()
        await settle(cfg, cluster, report, baseline=False)
        check(cfg, report)
    return report


async def restart_worker(cfg: SoakConfig, cluster: Cluster, session: aiohttp.ClientSession):
    """Kill worker 0 in the middle of the load, then start it again on the same port."""
    await asyncio.sleep(cfg.duration * cfg.restart_at)
    cluster.kill_worker(0)
    await asyncio.sleep(cfg.restart_down)
    cluster.start_worker(0)
    await wait_ok(session, cluster.worker_url(0) + "/health", 30)


async def sample_rss(pid: int, report: Report) -> None:
    """Track the peak, and keep one sample per tenth of the run (growth shows as a trend)."""
    t0 = time.monotonic()
    while True:
        rss = rss_bytes(pid)
        report.rss_peak = max(report.rss_peak, rss)
        elapsed = time.monotonic() - t0
        if not report.rss_timeline or elapsed >= report.rss_timeline[-1][0] + report.rss_every:
            report.rss_timeline.append((elapsed, rss))
        await asyncio.sleep(0.5)


async def settle(cfg: SoakConfig, cluster: Cluster, report: Report, baseline: bool) -> None:
    """Wait until the gateway and the workers are at rest; record what they hold then."""
    assert cluster.gateway is not None
    pid = cluster.gateway.pid
    deadline = time.monotonic() + cfg.settle_timeout
    async with aiohttp.ClientSession() as session:
        while True:
            inflight, retries = await gateway_numbers(session, cluster.url)
            stats = [await worker_stats(session, cluster.worker_url(i)) for i in range(cfg.workers)]
            busy = sum(s["running"] + s["waiting"] for s in stats)
            clients, upstream = connections(pid, cluster.port, cluster.worker_ports)
            clients -= 1  # this session's own connection
            # Probes and scrapes keep up to one keep-alive connection each per worker; the
            # relay's own connections must all be gone (idle ones expire after 4 s).
            at_rest = not inflight and not busy and clients <= 0
            at_rest = at_rest and upstream <= 2 * cfg.workers
            if at_rest or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
    if not baseline:
        report.retries = retries
        report.inflight_end, report.worker_running_end = inflight, busy
        report.clients_end, report.upstream_end = max(0, clients), upstream
        report.worker_stats = stats
        report.rss_end, report.fds_end = rss_bytes(pid), fd_count(pid)


def check(cfg: SoakConfig, report: Report) -> None:
    p = report.problems
    if report.outcomes["lost"] or report.outcomes["hung"]:
        p.append(f"{report.outcomes['lost']} lost and {report.outcomes['hung']} hung requests")
    if sum(report.outcomes.values()) != report.started:
        p.append(f"{report.started} started but {sum(report.outcomes.values())} ended")
    if report.outcomes["completed"] < report.started / 2:
        p.append("fewer than half the requests completed")
    if report.inflight_end:
        p.append(f"in-flight at the gateway after the load: {report.inflight_end}")
    if report.worker_running_end:
        p.append(f"requests still running on the workers: {report.worker_running_end}")
    if report.clients_end:
        p.append(f"client connections still open at the gateway: {report.clients_end}")
    if report.upstream_end > 2 * cfg.workers:
        p.append(f"{report.upstream_end} worker connections after the load (probes keep 2 each)")
    if report.fds_end > report.fds_start + 2:
        p.append(f"file descriptors: {report.fds_start} at start, {report.fds_end} after")
    timeline = [rss for _, rss in report.rss_timeline]
    if cfg.duration >= 120 and len(timeline) >= 9:
        # A long run must have reached its working size: no growth from its middle third
        # to its last one (a leak grows with the requests served; a working size does not).
        third = len(timeline) // 3
        middle, last = max(timeline[third : 2 * third]), max(timeline[2 * third :])
        if last > middle * 1.05:
            p.append(f"RSS still growing: {middle >> 20} MiB mid-run, {last >> 20} MiB late")
    if report.rss_end > report.rss_start * (1 + cfg.rss_slack):
        p.append(f"RSS: {report.rss_start >> 20} MiB at start, {report.rss_end >> 20} MiB after")


def render(cfg: SoakConfig, report: Report) -> str:
    mib = 1 << 20
    o = report.outcomes
    lines = [
        f"soak: {cfg.streams} concurrent requests for {cfg.duration:g} s "
        f"({report.load_seconds:.1f} s measured), {cfg.workers} workers, worker 0 killed at "
        f"{cfg.restart_at * cfg.duration:.0f} s for {cfg.restart_down:g} s",
        f"  requests   {report.started} started: " + ", ".join(f"{k} {o[k]}" for k in OUTCOMES),
        f"  events     {report.events} SSE events received "
        f"({report.events / max(report.load_seconds, 1e-9):.0f}/s); "
        f"peak {report.peak_streams} requests at once; retries {report.retries:g}",
    ]
    for kind, n in report.errors.most_common(8):
        lines.append(f"             {n:6d}  {kind}")
    lines += [
        f"  gateway    RSS {report.rss_start / mib:.1f} MiB at rest after warm-up, "
        f"{report.rss_peak / mib:.1f} peak, {report.rss_end / mib:.1f} after "
        f"({(report.rss_end / max(report.rss_start, 1) - 1) * 100:+.1f}%)",
        "             RSS during the load (MiB): "
        + " ".join(f"{rss / mib:.0f}" for _, rss in report.rss_timeline),
        f"             fds {report.fds_start} -> {report.fds_end}; client connections after "
        f"{report.clients_end}; worker connections {report.upstream_start} -> "
        f"{report.upstream_end} (probes and scrapes keep up to {2 * cfg.workers})",
        f"  after      in-flight at the gateway {report.inflight_end}; running on workers "
        f"{report.worker_running_end}",
    ]
    for i, s in enumerate(report.worker_stats):
        keys = ("received", "completed", "aborted", "errors", "dropped")
        lines.append(f"  worker{i}    " + ", ".join(f"{k} {s.get(k, 0)}" for k in keys))
    for rid, what in report.failures:
        lines.append(f"  failed     {rid}: {what}")
    lines.append("  PASS" if report.ok else "  FAIL: " + "; ".join(report.problems))
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[SoakConfig, int]:
    d = SoakConfig()
    ap = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=d.streams, help="requests at once")
    ap.add_argument("--duration", type=float, default=d.duration, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=d.warmup, help="seconds before the baseline")
    ap.add_argument("--workers", type=int, default=d.workers)
    ap.add_argument("--tpot-ms", type=float, default=d.tpot_ms, help="fake workers' ms per token")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--disconnects", type=float, default=d.disconnect_fraction)
    ap.add_argument("--runs", type=int, default=1, help="repeat the soak this many times")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--log-dir", default="", help="keep the processes' logs here")
    ap.add_argument("--access-log", action="store_true", help="gateway logs every request")
    a = ap.parse_args(argv)
    cfg = SoakConfig(
        streams=a.streams,
        duration=a.duration,
        warmup=a.warmup,
        workers=a.workers,
        tpot_ms=a.tpot_ms,
        max_tokens=a.max_tokens,
        disconnect_fraction=a.disconnects,
        seed=a.seed,
        log_dir=a.log_dir,
        access_log=a.access_log,
    )
    return cfg, a.runs


def main(argv: list[str]) -> None:
    cfg, runs = parse_args(argv)
    failed = 0
    for run in range(runs):
        report = asyncio.run(run_soak(SoakConfig(**{**vars(cfg), "seed": cfg.seed + run})))
        print(render(cfg, report), flush=True)
        failed += not report.ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1:])

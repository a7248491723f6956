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
their start (+2) and its resident memory within `rss_slack` of its warm start.
tests/test_soak.py runs a short variant in CI.
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from benchmarks.procs import Proc, free_port, rss_bytes

MODEL = "m"
OUTCOMES = ("completed", "left", "clean_error", "lost", "hung")


@dataclass
class SoakConfig:
    streams: int = 2000  # requests in flight at once
    duration: float = 60.0  # seconds of load (after the warm-up)
    warmup: float = 5.0  # seconds of the same load before the baseline is taken
    workers: int = 2
    tpot_ms: float = 500.0  # the fake workers' time per token
    ttft_ms: float = 200.0
    min_tokens: int = 4
    max_tokens: int = 24
    unary_fraction: float = 0.1  # requests that are not streamed
    disconnect_fraction: float = 0.1  # requests whose client leaves mid-answer
    restart_at: float = 0.4  # when worker 0 is killed, as a fraction of `duration`
    restart_down: float = 3.0  # seconds worker 0 stays dead
    settle_timeout: float = 20.0  # seconds for counters and connections to come back
    rss_slack: float = 0.25  # allowed RSS growth over the warm baseline (fraction)
    seed: int = 1
    log_dir: str = ""  # where the processes' logs go (default: a temporary directory)
    access_log: bool = False  # the gateway writes one line per request into its log


@dataclass
class Report:
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # clean_error and lost, by kind
    started: int = 0
    events: int = 0  # SSE events the clients received
    retries: float = 0.0  # the gateway's vllm_gateway_retries_total
    peak_streams: int = 0
    rss_start: int = 0  # bytes, at rest after the warm-up
    rss_peak: int = 0
    rss_end: int = 0
    fds_start: int = 0
    fds_end: int = 0
    upstream_start: int = 0  # the gateway's connections to workers, at rest
    upstream_end: int = 0
    clients_end: int = 0  # the gateway's client connections after the load
    inflight_end: int = 0  # sum of the workers' in-flight counts at the gateway
    worker_running_end: int = 0  # sum of the workers' running + waiting
    worker_stats: list[dict] = field(default_factory=list)
    load_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    # The first few lost or hung requests: (request id, what the client saw).
    failures: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


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


# --- the load ------------------------------------------------------------------------------


class Load:
    """Closed-loop load: `streams` requests at once, each replaced when it ends."""

    def __init__(self, cfg: SoakConfig, url: str, report: Report, rng: random.Random) -> None:
        self.cfg = cfg
        self.url = url + "/v1/completions"
        self.report = report
        self.rng = rng
        self.active = 0
        self.serial = 0

    def deadline(self, tokens: int) -> float:
        """How long a request may take before it counts as hung: generous, for a loaded box."""
        cfg = self.cfg
        return 3 * (cfg.ttft_ms + tokens * cfg.tpot_ms) / 1000 + 30

    async def run(self, session: aiohttp.ClientSession, seconds: float, count: bool) -> None:
        end = time.monotonic() + seconds

        async def slot() -> None:
            while time.monotonic() < end:
                await self.one(session, count)

        await asyncio.gather(*(slot() for _ in range(self.cfg.streams)))

    async def one(self, session: aiohttp.ClientSession, count: bool) -> None:
        cfg, rng = self.cfg, self.rng
        tokens = rng.randint(cfg.min_tokens, cfg.max_tokens)
        stream = rng.random() >= cfg.unary_fraction
        leave = rng.random() < cfg.disconnect_fraction
        leave_after = rng.randint(1, tokens - 1) if leave else None
        body = orjson.dumps(
            {"model": MODEL, "prompt": "soak", "max_tokens": tokens, "stream": stream}
        )
        self.serial += 1
        rid = f"soak-{cfg.seed}-{self.serial}"
        headers = {**JSON, "X-Request-Id": rid}
        started = time.monotonic()
        self.active += 1
        self.report.peak_streams = max(self.report.peak_streams, self.active)
        if count:
            self.report.started += 1
        try:
            async with asyncio.timeout(self.deadline(tokens)):
                if stream:
                    outcome, kind = await self.streamed(session, body, headers, tokens, leave_after)
                elif leave:
                    delay = rng.uniform(0, (cfg.ttft_ms + tokens * cfg.tpot_ms) / 1000)
                    try:
                        async with asyncio.timeout(delay):
                            outcome, kind = await self.unary(session, body, headers, tokens)
                    except TimeoutError:
                        outcome, kind = "left", ""
                else:
                    outcome, kind = await self.unary(session, body, headers, tokens)
        except TimeoutError:
            outcome, kind = "hung", "no end within the deadline"
        except (aiohttp.ClientError, ConnectionError) as e:
            outcome, kind = "lost", type(e).__name__
        finally:
            self.active -= 1
        if count:
            self.report.outcomes[outcome] += 1
            if kind:
                self.report.errors[f"{outcome}: {kind}"] += 1
            if outcome in ("lost", "hung") and len(self.report.failures) < 20:
                what = f"{kind}; stream={stream} tokens={tokens}"
                what += f" after {time.monotonic() - started:.1f} s"
                self.report.failures.append((rid, what))

    async def unary(self, session: aiohttp.ClientSession, body: bytes, headers: dict, tokens: int):
        async with session.post(self.url, data=body, headers=headers) as r:
            data = await r.read()
            if r.status != 200:
                return error_answer(r.status, data)
        text = orjson.loads(data)["choices"][0]["text"]
        if text == "".join(f" w{i}" for i in range(tokens)):
            return "completed", ""
        return "lost", "wrong answer"

    async def streamed(
        self, session, body: bytes, headers: dict, tokens: int, leave_after: int | None
    ):
        async with session.post(self.url, data=body, headers=headers) as r:
            if r.status != 200:
                return error_answer(r.status, await r.read())
            seen = 0
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].rstrip()
                if data == b"[DONE]":
                    if seen == tokens:
                        return "completed", ""
                    return "lost", f"[DONE] after {seen} of {tokens} tokens"
                doc = orjson.loads(data)
                if "error" in doc:
                    return "clean_error", "SSE error event"
                if doc["choices"][0]["text"] != f" w{seen}":
                    return "lost", "wrong token"
                seen += 1
                self.report.events += 1
                if leave_after is not None and seen >= leave_after:
                    r.close()  # the client goes away mid-stream
                    return "left", ""
            return "lost", "stream ended without [DONE] or an error event"


JSON = {"Content-Type": "application/json"}


def error_answer(status: int, data: bytes) -> tuple[str, str]:
    """An HTTP error answer: clean when it has an OpenAI error body. A 504 is a request the
    gateway had to give up on (the fake workers never stall): it counts as hung."""
    if status == 504:
        return "hung", "504 from the gateway: no answer within timeouts.first_byte"
    with contextlib.suppress(ValueError):
        doc = orjson.loads(data)
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            return "clean_error", f"{status} {doc['error'].get('code')}"
    return "lost", f"{status} without an OpenAI error body"


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
    while True:
        report.rss_peak = max(report.rss_peak, rss_bytes(pid))
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

"""What a relay costs: the gateway against a direct connection and against vllm-router.

Starts a fixed-answer backend (benchmarks.backend, far cheaper than any relay), the gateway
as its own process, vllm-router when it is installed, and a load generator (wrk when
installed, else benchmarks.loadgen) as another process, all on 127.0.0.1. The figure that
matters is the relay process's CPU time divided by the work it relayed: on a shared,
noisy 2-core machine it is far steadier than requests/s. Every figure is the median of
--runs runs; targets take turns within a run so that noise hits them alike.

    requests   non-streamed requests, closed loop: req/s, p50/p99, CPU µs per request
    stream     N concurrent SSE streams of 64+ events at a 20 ms pace: CPU µs per event,
               delivery delay of an event p50/p99 (added = relay minus direct), RSS per stream
    hold       10,000 streams open at once through one gateway process: errors, RSS per stream
    processes  `serve --processes 2` against 1: req/s ratio

Run it with scripts/bench_overhead (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.backend import MODEL, raise_fd_limit
from benchmarks.procs import Proc, free_port, wait_http
from benchmarks.router import INSTALL_HINT, find_router, start_router
from benchmarks.score_cost import mode_score

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench-out"
PATH = "/v1/completions"


# --- the processes under test -----------------------------------------------------------


def start_backend(args: argparse.Namespace, chunks: int, pace_ms: float) -> tuple[Proc, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.backend", "--port", str(port)]
    cmd += ["--chunks", str(chunks), "--pace-ms", str(pace_ms), "--pad", str(args.pad)]
    cmd += ["--lifetime", "3600"]
    proc = Proc("backend", cmd, str(OUT / "backend.log"), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 20, proc)
    return proc, url


def start_nginx_backend() -> tuple[Proc, str]:
    """nginx answering the fixed completion (cheaper than the Python backend); no streams."""
    from benchmarks.backend import _JSON_ANSWER

    port = free_port()
    root = OUT / "nginx"
    root.mkdir(exist_ok=True)
    answer = _JSON_ANSWER.decode().replace("'", "\\'")
    models = '{"object":"list","data":[{"id":"' + MODEL + '","object":"model"}]}'
    conf = root / "nginx.conf"
    conf.write_text(
        f"""worker_processes 1;
daemon off;
pid {root}/nginx.pid;
error_log stderr warn;
events {{ worker_connections 65535; }}
http {{
  access_log off;
  client_body_temp_path {root}/body; proxy_temp_path {root}/proxy;
  fastcgi_temp_path {root}/fcgi; uwsgi_temp_path {root}/uwsgi; scgi_temp_path {root}/scgi;
  keepalive_requests 10000000; keepalive_timeout 60s;
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    default_type application/json;
    location = /health {{ return 200 ''; }}
    location = /v1/models {{ return 200 '{models}'; }}
    location = /metrics {{ default_type text/plain; return 200 ''; }}
    location / {{ return 200 '{answer}'; }}
  }}
}}
"""
    )
    proc = Proc("nginx", ["nginx", "-c", str(conf), "-p", str(root)], str(OUT / "nginx.log"))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 20, proc)
    return proc, url


def start_fake_worker() -> tuple[Proc, str]:
    """The project's fake vLLM worker answering at once (real wire format, dearer than nginx)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_gateway", "fake-worker", "--port", str(port)]
    cmd += ["--model", MODEL, "--ttft-ms", "0", "--tpot-ms", "0", "--max-num-seqs", "100000"]
    proc = Proc("fake-worker", cmd, str(OUT / "fake-worker.log"), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 20, proc)
    return proc, url


def requests_backend(args: argparse.Namespace) -> tuple[Proc, str]:
    """The backend for non-streamed requests: nginx when installed, else the Python one
    (or the fake vLLM worker with --fake-worker)."""
    if args.fake_worker:
        return start_fake_worker()
    if args.nginx and shutil.which("nginx"):
        return start_nginx_backend()
    return start_backend(args, args.chunks, args.pace_ms)


def start_gateway(backend: str, processes: int = 1) -> tuple[Proc, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_gateway", "serve", "--worker", backend]
    cmd += ["--port", str(port), "--log-level", "warning", "--log-format", "json"]
    if processes > 1:
        cmd += ["--processes", str(processes)]
    proc = Proc(f"gateway-{processes}p", cmd, str(OUT / f"gateway-{processes}p.log"), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 30, proc)
    return proc, url


# "lean": vllm-router doing the least it can (the fairest relay-only comparison);
# "default": as `vllm-router --worker-urls ...` runs out of the box (cache_aware policy,
# retries and circuit breaker on), as the gateway runs with its own defaults.
ROUTER_FLAGS = {
    "lean": ["--policy", "round_robin", "--disable-retries", "--disable-circuit-breaker"],
    "default": [],
}
ROUTER_MODE = "lean"


def start_relay_router(binary: str, backend: str) -> tuple[Proc, str]:
    return start_router(binary, [backend], ROUTER_FLAGS[ROUTER_MODE])


# --- load -------------------------------------------------------------------------------


def _loadgen(args: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "benchmarks.loadgen", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def _wrk_script() -> Path:
    body = json.dumps({"model": MODEL, "prompt": "Say something", "max_tokens": 8})
    path = OUT / "post.lua"
    path.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(body)}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        'wrk.headers["Authorization"] = "Bearer sk-bench"\n'
    )
    return path


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def _wrk(url: str, connections: int, duration: float) -> dict:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--latency"]
    cmd += ["-s", str(_wrk_script()), url + PATH]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60).stdout

    def latency(pct: str) -> float:
        m = re.search(rf"^\s+{pct}%\s+([0-9.]+)(us|ms|s)\s*$", out, re.M)
        return float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")

    m = re.search(r"(\d+) requests in ([0-9.]+)(\w+)", out)
    if not m:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(non2xx.group(1)) if non2xx else 0) + (
        sum(int(x) for x in sock.groups()) if sock else 0
    )
    requests = int(m.group(1))
    return {
        "requests": requests - errors,
        "errors": errors,
        "rps": float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1)),
        "p50_ms": latency("50"),
        "p99_ms": latency("99"),
    }


def requests_load(args: argparse.Namespace, url: str) -> dict:
    if args.wrk:
        return _wrk(url, args.connections, args.duration)
    gen = _loadgen(
        [url + PATH, "--connections", str(args.connections), "--duration", str(args.duration)]
    )
    out, _ = gen.communicate(timeout=args.duration + 60)
    return json.loads(out.strip().splitlines()[-1])


def stream_load(url: str, streams: int, ramp: float, timeout: float, on_open: Callable) -> dict:
    """Run the loadgen's stream mode; call `on_open()` when every stream has started."""
    gen = _loadgen(
        [url + PATH, "--streams", str(streams), "--ramp", str(ramp), "--timeout", str(timeout)]
    )
    assert gen.stdout is not None
    result = None
    for line in gen.stdout:
        if line.startswith("open "):
            on_open()
        elif line.startswith("{"):
            result = json.loads(line)
    gen.wait(30)
    if result is None:
        raise RuntimeError("the load generator printed no result")
    return result


# --- measurements -----------------------------------------------------------------------


def measure_requests(args: argparse.Namespace, url: str, relay: Proc | None, backend: Proc):
    before = relay.cpu() if relay else 0.0
    backend_before = backend.cpu()
    r = requests_load(args, url)
    n = max(1, r["requests"])
    r["relay_cpu_us"] = (relay.cpu() - before) / n * 1e6 if relay else float("nan")
    r["backend_cpu_us"] = (backend.cpu() - backend_before) / n * 1e6
    return r


def measure_streams(args: argparse.Namespace, url: str, relay: Proc | None, streams: int):
    timeout = args.chunks * args.pace_ms / 1000 + args.ramp + 60
    rss_idle = relay.rss() if relay else 0
    sample: dict[str, int] = {}

    def on_open() -> None:
        sample["rss"] = relay.rss() if relay else 0

    before = relay.cpu() if relay else 0.0
    r = stream_load(url, streams, args.ramp, timeout, on_open)
    events = max(1, r["events"])
    r["relay_cpu_us_per_event"] = (relay.cpu() - before) / events * 1e6 if relay else float("nan")
    r["rss_per_stream_kb"] = (
        (sample.get("rss", rss_idle) - rss_idle) / streams / 1024 if relay else float("nan")
    )
    return r


def median(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if r.get(key) == r.get(key)]  # drop NaN
    return statistics.median(values) if values else float("nan")


def fmt(x: float, digits: int = 1) -> str:
    return "-" if x != x else f"{x:,.{digits}f}"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print(
        "  ".join(
            h.rjust(w) if i else h.ljust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=False))
        )
    )
    for r in rows:
        print(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=False))
            )
        )


def start_relays(
    backend_url: str,
    router_bin: str | None,
    procs: list[Proc],
    *,
    direct: bool = True,
    gateway_processes: int = 1,
) -> list[tuple[str, str, Proc | None]]:
    """The targets to measure as (name, url, relay process): the backend itself (`direct`),
    the gateway (`serve --processes gateway_processes`), and vllm-router when installed,
    each started in front of `backend_url` and added to `procs` (which the caller stops)."""
    gateway, gw_url = start_gateway(backend_url, gateway_processes)
    procs.append(gateway)
    targets: list[tuple[str, str, Proc | None]] = [("direct", backend_url, None)] if direct else []
    targets.append(("gateway", gw_url, gateway))
    if router_bin:
        router, router_url = start_relay_router(router_bin, backend_url)
        procs.append(router)
        targets.append(("vllm-router", router_url, router))
    return targets


def measure_rounds(
    args: argparse.Namespace,
    targets: list[tuple[str, str, Proc | None]],
    measure: Callable[[str, Proc | None], dict],
) -> dict[str, list[dict]]:
    """`args.runs` rounds, each measuring every target in turn (so drifts in the machine's
    load touch them all alike); each target's results in run order."""
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in targets}
    for i in range(args.runs):
        for name, url, relay in targets:
            r = measure(url, relay)
            runs[name].append(r)
            print(f"  run {i + 1} {name}: {json.dumps(r)}", file=sys.stderr)
    return runs


# --- modes ------------------------------------------------------------------------------


def mode_requests(args: argparse.Namespace, router_bin: str | None) -> dict:
    backend, backend_url = requests_backend(args)
    procs = [backend]
    try:
        targets = start_relays(
            backend_url, router_bin, procs, gateway_processes=args.gateway_processes
        )
        for _, url, _ in targets:  # warm up: connections, caches, the JIT-less interpreter
            requests_load(argparse.Namespace(**{**vars(args), "duration": 1.0}), url)
        runs = measure_rounds(
            args, targets, lambda url, relay: measure_requests(args, url, relay, backend)
        )
    finally:
        for p in procs:
            p.stop()
    ref = median(runs.get("vllm-router", []), "relay_cpu_us") if router_bin else float("nan")
    rows = []
    for name, rs in runs.items():
        cpu = median(rs, "relay_cpu_us")
        rows.append(
            [
                name,
                fmt(median(rs, "rps"), 0),
                fmt(median(rs, "p50_ms"), 2),
                fmt(median(rs, "p99_ms"), 2),
                fmt(cpu),
                fmt(median(rs, "backend_cpu_us")),
                fmt(cpu / ref, 2),
                str(sum(r["errors"] for r in rs)),
            ]
        )
    gen = "wrk" if args.wrk else "built-in generator"
    print_table(
        f"requests: {args.connections} connections, {args.duration:g} s per run, {gen}, "
        f"median of {args.runs} runs",
        [
            "target",
            "req/s",
            "p50 ms",
            "p99 ms",
            "relay CPU µs/req",
            "backend CPU µs/req",
            "CPU vs router",
            "errors",
        ],
        rows,
    )
    return {name: rs for name, rs in runs.items()}


def mode_stream(args: argparse.Namespace, router_bin: str | None) -> dict:
    backend, backend_url = start_backend(args, args.chunks, args.pace_ms)
    procs = [backend]
    try:
        targets = start_relays(
            backend_url, router_bin, procs, gateway_processes=args.gateway_processes
        )
        runs = measure_rounds(
            args, targets, lambda url, relay: measure_streams(args, url, relay, args.streams)
        )
    finally:
        for p in procs:
            p.stop()
    direct50 = median(runs["direct"], "delay_p50_ms")
    direct99 = median(runs["direct"], "delay_p99_ms")
    ref = median(runs.get("vllm-router", []), "relay_cpu_us_per_event")
    rows = []
    for name, rs in runs.items():
        cpu = median(rs, "relay_cpu_us_per_event")
        p50, p99 = median(rs, "delay_p50_ms"), median(rs, "delay_p99_ms")
        rows.append(
            [
                name,
                fmt(cpu),
                fmt(cpu / ref, 2),
                fmt(p50, 2),
                fmt(p99, 2),
                fmt(p50 - direct50, 2) if name != "direct" else "-",
                fmt(p99 - direct99, 2) if name != "direct" else "-",
                # The first run's growth: later runs reuse memory the first one left behind.
                fmt(max((r["rss_per_stream_kb"] for r in rs), default=float("nan"))),
                str(sum(r["errors"] for r in rs)),
            ]
        )
    print_table(
        f"stream: {args.streams} concurrent streams x {args.chunks} events every "
        f"{args.pace_ms:g} ms, median of {args.runs} runs",
        [
            "target",
            "relay CPU µs/event",
            "CPU vs router",
            "delay p50 ms",
            "delay p99 ms",
            "added p50 ms",
            "added p99 ms",
            "RSS KB/stream",
            "errors",
        ],
        rows,
    )
    return runs


def mode_hold(args: argparse.Namespace, router_bin: str | None) -> dict:
    # Each stream holds two sockets in the gateway (client and worker side): stay within
    # the open-file limit (a sandbox may forbid raising it), and say so.
    limit = raise_fd_limit()
    if args.hold * 2 + 200 > limit:
        held = (limit - 200) // 2
        print(f"\nnote: open-file limit {limit}: holding {held} streams, not {args.hold}")
        args = argparse.Namespace(**{**vars(args), "hold": held})
    # Long, slow streams: every stream stays open for the whole ramp and then some. The
    # pace is slow so that the Python backend and load generator keep up with 10,000.
    pace_ms = 2000.0
    chunks = int(args.hold_ramp / 2 + 8)
    backend, backend_url = start_backend(args, chunks, pace_ms)
    procs = [backend]
    results: dict[str, dict] = {}
    try:
        targets = start_relays(
            backend_url, router_bin if args.hold_router else None, procs, direct=False
        )
        hold_args = argparse.Namespace(
            **{**vars(args), "chunks": chunks, "pace_ms": pace_ms, "ramp": args.hold_ramp}
        )
        for name, url, relay in targets:
            r = measure_streams(hold_args, url, relay, args.hold)
            r["rss_total_mb"] = relay.rss() / 2**20
            results[name] = r
            print(f"  {name}: {json.dumps(r)}", file=sys.stderr)
    finally:
        for p in procs:
            p.stop()
    rows = [
        [
            name,
            str(r["completed"]),
            str(r["errors"]),
            "yes" if r["timed_out"] else "no",
            fmt(r["rss_per_stream_kb"]),
            fmt(r["rss_total_mb"]),
        ]
        for name, r in results.items()
    ]
    print_table(
        f"hold: {args.hold} concurrent streams through one process, {chunks} events 2 s apart",
        ["target", "completed", "errors", "timed out", "RSS KB/stream", "RSS MB idle after"],
        rows,
    )
    return results


def mode_processes(args: argparse.Namespace, router_bin: str | None) -> dict:
    backend, backend_url = requests_backend(args)
    procs = [backend]
    try:
        one, url1 = start_gateway(backend_url, 1)
        procs.append(one)
        two, url2 = start_gateway(backend_url, 2)
        procs.append(two)
        targets = [("1 process", url1, one), ("2 processes", url2, two)]
        for _, url, _ in targets:
            requests_load(argparse.Namespace(**{**vars(args), "duration": 1.0}), url)
        runs = measure_rounds(
            args, targets, lambda url, relay: measure_requests(args, url, relay, backend)
        )
    finally:
        for p in procs:
            p.stop()
    base = median(runs["1 process"], "rps")
    rows = [
        [
            name,
            fmt(median(rs, "rps"), 0),
            fmt(median(rs, "rps") / base, 2),
            fmt(median(rs, "p99_ms"), 2),
            fmt(median(rs, "relay_cpu_us")),
        ]
        for name, rs in runs.items()
    ]
    print_table(
        f"processes: {args.connections} connections, median of {args.runs} runs "
        f"({os.cpu_count()} cores, load generator and backend outside the gateway)",
        ["gateway", "req/s", "ratio", "p99 ms", "CPU µs/req"],
        rows,
    )
    return runs


MODES = {
    "requests": mode_requests,
    "stream": mode_stream,
    "hold": mode_hold,
    "processes": mode_processes,
    "score": mode_score,  # in process: CPU per dispatch by policy (benchmarks/score_cost.py)
}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(
        description="Relay cost of the gateway against direct and vllm-router (loopback only)."
    )
    p.add_argument("modes", nargs="*", default=["requests", "stream"], choices=[*MODES, "all"])
    p.add_argument("--runs", type=int, default=3, help="runs per figure; medians are printed")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per requests run")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--streams", type=int, default=200, help="concurrent streams (stream mode)")
    p.add_argument("--chunks", type=int, default=64, help="events per stream")
    p.add_argument("--pace-ms", type=float, default=20.0, help="time between two events")
    p.add_argument("--pad", type=int, default=0, help="extra bytes per event")
    p.add_argument("--ramp", type=float, default=0.5, help="open the streams over this many s")
    p.add_argument("--hold", type=int, default=10_000, help="streams held open (hold mode)")
    p.add_argument("--hold-ramp", type=float, default=20.0, help="open them over this many s")
    p.add_argument("--hold-router", action="store_true", help="also hold through vllm-router")
    p.add_argument("--router", help="vllm-router executable (default: bench-out venv or PATH)")
    p.add_argument("--no-router", action="store_true", help="skip vllm-router")
    p.add_argument(
        "--router-mode",
        choices=sorted(ROUTER_FLAGS),
        default="lean",
        help="lean: round_robin, no retries, no circuit breaker (default); "
        "default: vllm-router's own defaults (cache_aware policy, retries, breaker)",
    )
    p.add_argument(
        "--wrk",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="use wrk for requests (default: when installed)",
    )
    p.add_argument(
        "--nginx",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="nginx as the backend for non-streamed requests when installed",
    )
    p.add_argument(
        "--fake-worker",
        action="store_true",
        help="requests mode against the fake vLLM worker (answering at once) instead of a "
        "fixed-answer backend: the gateway's added latency over a vLLM-shaped server",
    )
    p.add_argument(
        "--gateway-processes",
        type=int,
        default=1,
        help="requests and stream modes: run the gateway as `serve --processes N` "
        "(its CPU is summed over the processes)",
    )
    p.add_argument("--json", help="also write every run's figures to this file")
    args = p.parse_args(argv)
    global ROUTER_MODE
    ROUTER_MODE = args.router_mode
    if args.wrk is None:
        args.wrk = shutil.which("wrk") is not None
    modes = list(MODES) if "all" in args.modes else args.modes
    OUT.mkdir(exist_ok=True)
    raise_fd_limit()
    router_bin = find_router(args.router, args.no_router)
    print(
        f"vllm-gateway relay benchmark: {os.cpu_count()} cores, python {sys.version.split()[0]}, "
        f"load: {'wrk' if args.wrk else 'built-in'}, "
        f"requests backend: {'nginx' if args.nginx and shutil.which('nginx') else 'python'}, "
        f"vllm-router: {router_bin or INSTALL_HINT}"
        f"{f' ({ROUTER_MODE} flags)' if router_bin else ''}"
    )
    started = time.monotonic()
    results = {}
    for mode in modes:
        results[mode] = MODES[mode](args, router_bin)
    print(f"\n({time.monotonic() - started:.0f} s; logs in {OUT})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])

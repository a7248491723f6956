"""Dispatch under workload families: the gateway's policies beside vllm-router's.

For each family (benchmarks/families.py: hetero, multiturn, burst, longtail, docqa,
agent, docchat, longchat, ragchat, bigbatch, longprompt, gpumix) and each system (vllm-router
with `cache_aware` and `power_of_two` when it is installed; the gateway with each of
--policies), one
measurement starts fresh fake workers (each its own process, with an empty prefix
cache), starts the system in front of them (--replicas processes of it, requests
alternating between them), plays the family's conversations from this process, and stops
everything. Per family and system it reports TTFT p50/p99, end-to-end p99, throughput
(measured turns completed / time from the first one due to the last one done), errors,
and the workers' prefix-cache hit rate (hits / queries, from the increase of their
/metrics counters over the measured window); with --placements, how the gateway placed
the run's requests (its access log's `placed`, counted: benchmarks/placements.py) and the
tokens the workers prefilled for each step (their request logs, joined on request id),
and for every system the later turns moved off their turn before's worker (`moved`),
and every later turn by what its worker held, with the tokens each kind prefilled
(`later`, `later_tokens`: kept, evicted, moved), and for the gateway the popular
preambles its plans moved (`plan_moves`, its /metrics).
Every figure is the median over --runs runs; systems take turns within a run, and every
system sees the same conversations in a run (same seed).

Run it with scripts/bench_dispatch (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

import aiohttp

from benchmarks import dispatch_report as report
from benchmarks.cache_stats import cache_counters, hit_rate, per_worker, total
from benchmarks.families import FAMILIES, Family, Sizes
from benchmarks.machine import cpu_ticks, idle_since, wait_quiet
from benchmarks.placements import brief as placed_brief
from benchmarks.placements import (
    later_of_files,
    of_files,
    plan_moves,
    prefill_brief,
    prefill_of_files,
)
from benchmarks.router import INSTALL_HINT, find_router
from benchmarks.systems import (
    GATEWAY,
    ROUTER,
    System,
    default_policy,
    gateway_logs,
    kind_of,
    start_system,
    start_workers,
    stop,
    worker_logs,
)
from benchmarks.traffic import APIS, Played, play
from benchmarks.workload import WorkerSpec
from vllm_gateway.http.server import new_event_loop

OUT = Path(__file__).resolve().parent.parent / "bench-out"
ROUTER_POLICIES = ("cache_aware", "power_of_two")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(played: Played) -> dict[str, float]:
    ok = played.ok()
    ttft = [s.first - s.due for s in ok if s.first is not None]
    e2e = [s.done - s.due for s in ok if s.done is not None]
    span = (max(s.done for s in ok if s.done) - min(s.due for s in played.samples)) if ok else 0
    return {
        "ttft_p50": pct(ttft, 0.50),
        "ttft_p99": pct(ttft, 0.99),
        "e2e_p99": pct(e2e, 0.99),
        "throughput": len(ok) / span if span > 0 else 0.0,
        "errors": len(played.samples) - len(ok),
        "measured": len(played.samples),
    }


async def drive(family: Family, urls: list[str], workers: list[str], seed: int,
                args: argparse.Namespace, gateway: bool) -> dict:  # fmt: skip
    conversations = family.build(random.Random(seed))
    async with aiohttp.ClientSession() as scrape:
        before: list[list[tuple[float, float]]] = []

        async def at_measure() -> None:
            before.append(await cache_counters(scrape, workers))

        played = await play(urls, conversations, args.warmup, args.drain, at_measure, args.api)
        after = await cache_counters(scrape, workers)
        churn = {}
        if gateway and args.placements:  # each replica plans alone: their moves add up
            pages = [await (await scrape.get(url + "/metrics")).text() for url in urls]
            churn = {"plan_moves": sum(plan_moves(page) for page in pages)}
    hits = {"hit_rate": hit_rate(total(before[0]), total(after))}
    return summarize(played) | hits | {"workers": per_worker(before[0], after)} | churn


def worker_specs(family: Family, args: argparse.Namespace) -> tuple[WorkerSpec, ...]:
    """The family's workers; with --kv-wait, keeping a request waiting while its prompt's
    KV blocks do not fit, as vLLM does (the families were made with workers that
    over-commit)."""
    if not args.kv_wait:
        return tuple(family.workers)
    return tuple(dataclasses.replace(spec, kv_wait=True) for spec in family.workers)


def measure(family: Family, system: System, seed: int, args: argparse.Namespace,
            router_bin: str | None) -> dict:  # fmt: skip
    """One measurement: fresh workers, the system in front, the family's load; all stopped."""
    wait_quiet(args.min_idle, args.quiet_wait)
    logged = args.placements and system.kind == GATEWAY
    worker_procs, workers = start_workers(worker_specs(family, args), args.placements)
    procs = list(worker_procs)
    try:
        system_procs, urls = start_system(
            system,
            workers,
            args.replicas,
            router_bin,
            args.gateway_processes,
            logged,
            args.replica_sync,
        )
        procs += system_procs
        start = cpu_ticks()
        with asyncio.Runner(loop_factory=new_event_loop) as runner:  # uvloop, as the gateway
            result = runner.run(drive(family, urls, workers, seed, args, system.kind == GATEWAY))
        result |= {"cpu_idle": idle_since(start)}
    finally:
        stop(procs)
    if args.placements:  # the workers' logs (and the gateways'), every line written
        result |= later_of_files(worker_logs(len(workers)))
    if logged:
        gateways = gateway_logs(system.policy, args.replicas)
        result["placed"] = placed_brief(of_files(gateways))
        tokens = prefill_of_files(gateways, worker_logs(len(workers)))
        result["prefill"] = prefill_brief(tokens)
    return result


def systems(args: argparse.Namespace, router_bin: str | None) -> list[System]:
    out = [System(ROUTER, p) for p in ROUTER_POLICIES] if router_bin else []
    policies = args.policies.split(",") if args.policies else [default_policy(), "prefix"]
    return out + [System(GATEWAY, p) for p in dict.fromkeys(policies)]


def brief(r: dict) -> str:
    """One measurement on a line; each worker's hit rate as worker_hits=a/b/..."""
    out = []
    for k, v in r.items():
        if k == "workers":
            out.append("worker_hits=" + "/".join(f"{w['hit_rate']:.2f}" for w in v))
        else:
            out.append(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(out)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    ap.add_argument("--policies", default="",
                    help="gateway policies (default: its default and prefix)")  # fmt: skip
    ap.add_argument("--replicas", type=int, default=1,
                    help="processes of each system, requests alternating between them")  # fmt: skip
    ap.add_argument("--replica-sync", action="store_true",
                    help="with --replicas N: the gateway's replicas tell each other where "
                         "they placed which prompt (serve --replica-listen, --peer)")  # fmt: skip
    ap.add_argument("--gateway-processes", type=int, default=1,
                    help="the gateway as serve --processes N (its processes share one port; "
                         "the kernel spreads the client's connections over them)")  # fmt: skip
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1000,
                    help="the first run's conversations (run i plays seed + i - 1)")  # fmt: skip
    ap.add_argument("--duration", type=float, default=15.0, help="measured seconds of arrivals")
    ap.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds first")
    ap.add_argument("--drain", type=float, default=30.0, help="longest wait for the tail")
    ap.add_argument("--load", type=float, default=0.7,
                    help="hetero, longtail, bigbatch, longprompt: offered load, "
                         "fraction of capacity")  # fmt: skip
    ap.add_argument("--cache-share", type=float, default=0.5,
                    help="multiturn: fleet KV blocks / all conversations' blocks")  # fmt: skip
    ap.add_argument("--kv-wait", action="store_true",
                    help="fake workers keep a request waiting while its prompt's KV blocks "
                    "do not fit, as vLLM does (default: they over-commit, as the families "
                    "were made)")  # fmt: skip
    ap.add_argument(
        "--api",
        choices=APIS,
        default="chat",
        help="chat: /v1/chat/completions with messages (default); completions:\n"
        "/v1/completions, each turn's messages rendered as one prompt string",
    )
    ap.add_argument("--router", help="vllm-router executable (default: bench-out venv or PATH)")
    ap.add_argument("--no-router", action="store_true", help="run the gateway only")
    ap.add_argument("--min-idle", type=float, default=0.5,
                    help="before each measurement, wait for this idle CPU share")  # fmt: skip
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="... but at most this many seconds")  # fmt: skip
    ap.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--placements", action="store_true",
                    help="gateway access log on; print how it placed each run's requests "
                         "(placed=history:N/home:N/...;waited:N) and the tokens the workers "
                         "prefilled for each (prefill=history:N/...); for every system, "
                         "the later turns that no worker of the turn before prefilled "
                         "(moved=N), and every later turn by what its worker held "
                         "(later=kept:N/evicted:N/moved:N, later_tokens=... the tokens "
                         "each prefilled); for the gateway, the popular preambles its plans "
                         "moved (plan_moves=N, from its /metrics)")  # fmt: skip
    ap.add_argument("--from-json", metavar="PATH",
                    help="report a bench-out/dispatch-families-r<N>.json again")  # fmt: skip
    args = ap.parse_args()
    if args.replica_sync and args.replicas < 2:
        ap.error("--replica-sync needs --replicas 2 or more")
    return args


def run_all(
    args: argparse.Namespace, families: list[Family], chosen: list[System], router_bin: str | None
) -> dict[str, dict[str, list[dict]]]:
    """Every run of every family on every system; results[family][system] = per-run figures."""
    results: dict[str, dict[str, list[dict]]] = {
        f.name: {s.name: [] for s in chosen} for f in families
    }
    key = report.doc_key(
        "families", args.replicas, args.gateway_processes, args.kv_wait, args.api, args.replica_sync
    )
    key = key.replace(" ", "-")
    raw = OUT / f"dispatch-{key}.json"
    for run in range(args.runs):
        for family in families:
            for system in chosen:
                label = f"run {run + 1} {family.name:9s} {system.name:26s}"
                try:
                    r = measure(family, system, args.seed + run, args, router_bin)
                except RuntimeError as e:  # a process that would not start: say so, go on
                    print(f"{label} failed: {e}", flush=True)
                    continue
                results[family.name][system.name].append(r)
                print(f"{label} {brief(r)}", flush=True)
                # Written after every measurement, so a stopped run keeps what it measured.
                raw.write_text(json.dumps({"args": vars(args), "results": results}))
    return results


def main() -> None:
    args = parse_args()
    OUT.mkdir(exist_ok=True)
    sizes = Sizes(args.warmup, args.duration, args.load, args.cache_share)
    families = [FAMILIES[name](sizes) for name in args.families.split(",")]
    if args.from_json:  # report figures measured before, measure nothing
        results = json.loads(Path(args.from_json).read_text())["results"]
    else:
        router_bin = find_router(args.router, args.no_router)
        print(f"vllm-router: {router_bin or INSTALL_HINT + '; running the gateway only'}")
        results = run_all(args, families, systems(args, router_bin), router_bin)
    for family in families:
        kinds = {name: kind_of(name) for name in results[family.name]}
        kinds_of = Counter(w.describe() for w in worker_specs(family, args))
        workers = "; ".join(f"{n} x {text}" if n > 1 else text for text, n in kinds_of.items())
        setup = f"{len(family.workers)} workers ({workers}); {family.setup}"
        lines = report.table(results[family.name], kinds, args.runs)
        processes = args.gateway_processes
        kv = args.kv_wait
        sync = args.replica_sync
        block = report.section(
            family.name, args.replicas, setup, args.runs, lines, processes, kv, args.api, sync
        )
        print("\n" + "\n".join(block), flush=True)
        if not args.no_doc:
            key = report.doc_key(family.name, args.replicas, processes, kv, args.api, sync)
            report.write_doc(key, block)


if __name__ == "__main__":
    main()

"""How alike two replicas' preamble plans are, simulated in process (no sockets, seconds).

Behind an L4 balancer each replica of the gateway sees every other request, so each
measures the preambles' shares from its own half, and plans from that
(dispatch/preamble_plan.py). Where the two plans differ, a conversation's turns that go
through different replicas go to different workers, and its history is prefilled again.
The dispatch benchmark (`scripts/bench_dispatch --replicas 2`) measures the outcome, with
a spread of hits across seeds wider than most changes to the plan; this measures the
mechanism itself, with the real `Shares`, `PreamblePlan` and rendezvous ranks.

A run plays conversations (each under one of K preambles chosen by Zipf popularity, a
few turns each, interleaved in time) through R replicas in turn. At each request, the
preamble's workers as each replica would choose them now: the plan's, or, unplanned, the
first `wanted` of its order (its own rendezvous order, the workers the plan fills last).
It reports per shape (medians are not taken: each figure is the mean over --seeds runs):

    differ   the share of requests at which two replicas' workers for the request's
             preamble differ (0 with --replicas 1);
    moves    per replica and run, the times a preamble's workers gained one it did not
             have (each a prefill of it there, and of its conversations' histories);
    maxload  the busiest worker's traffic relative to its fair part (its KV cache's part of
             the fleet's), by the preambles' true popularity, over the first replica's
             placements at the end (1.0: every worker its part);
    builds   plans made per replica and run.

    scripts/bench_plan                            # the shapes below, 12 seeds each
    scripts/bench_plan --replicas 1               # one gateway: moves alone
    scripts/bench_plan --seeds 40 --json out.json

To compare two versions of the plan, run it from two worktrees: it is deterministic, so
one run each is the comparison (no noise to take medians of).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass

from vllm_gateway.dispatch.policies.rendezvous import Ranks
from vllm_gateway.dispatch.preamble_plan import Shares, wanted
from vllm_gateway.workers import EngineStats, Worker

BOUND = 1.25  # the default load bound


@dataclass(frozen=True)
class Shape:
    """A fleet and its conversations: `workers` (their KV caches, relative), `preambles`
    by Zipf popularity `zipf`, `conversations` of `turns` (low, high) each."""

    name: str
    caches: tuple[float, ...]
    preambles: int
    zipf: float
    conversations: int
    turns: tuple[int, int]


SHAPES = (
    Shape("docchat-like", (1, 1, 1), 6, 0.8, 60, (5, 5)),
    Shape("ragchat-like", (1, 1, 1, 1, 1), 12, 1.2, 60, (3, 8)),
    Shape("gpumix-like", (3, 3, 1, 1), 10, 1.0, 70, (3, 8)),
    Shape("flat", (1, 1, 1, 1), 4, 0.5, 100, (3, 6)),
    Shape("many tenants", (1,) * 8, 30, 1.0, 300, (2, 8)),
    Shape("long run", (1, 1, 1, 1), 8, 1.0, 1500, (2, 8)),
)


def _stream(
    rng: random.Random, shape: Shape
) -> tuple[list[int], list[tuple[int, int]], list[float]]:
    """The preambles' names, the requests in time order (as (index of the preamble,
    conversation)), and the preambles' popularity weights."""
    names = [rng.getrandbits(60) | 1 for _ in range(shape.preambles)]
    weights = [1 / (i + 1) ** shape.zipf for i in range(shape.preambles)]
    events = []
    for c in range(shape.conversations):
        k = rng.choices(range(shape.preambles), weights)[0]
        t = rng.uniform(0, 100)
        for _ in range(rng.randint(*shape.turns)):
            events.append((t, k, c))
            t += rng.expovariate(1 / 3)  # think time between turns
    events.sort()
    return names, [(k, c) for _, k, c in events], weights


def _workers_of(shares: Shares, ranks: Ranks, preamble: int, fleet: list[Worker]) -> frozenset:
    """The workers a replica sends `preamble` to now: planned, or the first of its order
    (`PreamblePlan.order`: its own, the workers the plan fills last)."""
    urls = shares.plan.urls_of(preamble)
    if urls is not None:
        return urls
    share = shares.counts.get(preamble, 0) / max(1, shares.samples)
    order = shares.plan.order(preamble, fleet, ranks.cached)
    first = order[: wanted(share, len(fleet), BOUND)]
    return frozenset(fleet[j].url for j in first)


def run(shape: Shape, seed: int, replicas: int) -> dict[str, float]:
    """One run of `shape` through `replicas` replicas: its figures (module docstring)."""
    rng = random.Random(seed)
    fleet = []
    for i, cache in enumerate(shape.caches):
        w = Worker(f"http://10.{seed % 250}.0.{i + 1}:8000", models=("m",))
        w.stats = EngineStats(0, 0, 0.1, 0.0, cache_tokens=cache * 100_000)
        fleet.append(w)
    names, requests, weights = _stream(rng, shape)
    sides = [(Shares(BOUND), Ranks()) for _ in range(replicas)]
    last: list[dict[int, frozenset]] = [{} for _ in sides]
    seen: list[set[int]] = [set() for _ in sides]  # conversations each replica has seen
    differ = moves = 0
    for i, (k, c) in enumerate(requests):
        preamble = names[k]
        r = i % replicas
        shares, ranks = sides[r]
        # (counted once per conversation and replica, as cache_aware does by its index)
        share = shares.add(preamble, c not in seen[r])
        seen[r].add(c)
        shares.plan.among(preamble, share, shares.samples, fleet, shares.counts, ranks.cached)
        now = _workers_of(shares, ranks, preamble, fleet)
        if replicas > 1:
            others = [_workers_of(s, rk, preamble, fleet) for s, rk in sides if s.samples]
            differ += any(o != now for o in others)
        before = last[r].get(preamble)
        moves += before is not None and not now <= before
        last[r][preamble] = now
    shares, ranks = sides[0]
    load = {w.url: 0.0 for w in fleet}
    total = sum(weights)
    for k, preamble in enumerate(names):
        urls = _workers_of(shares, ranks, preamble, fleet)
        for url in urls:
            load[url] += weights[k] / total / len(urls)
    part = sum(shape.caches)  # each worker's fair part: its cache's, of the fleet's
    return {
        "differ": differ / len(requests),
        "moves": moves / replicas,
        "maxload": max(load[w.url] * part / c for w, c in zip(fleet, shape.caches, strict=True)),
        "builds": sum(s.plan.builds for s, _ in sides) / replicas,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2, help="replicas, requests alternating")
    ap.add_argument("--seeds", type=int, default=12, help="runs per shape (seeds 0..N-1)")
    ap.add_argument("--json", metavar="FILE", help="also write every run's figures here")
    args = ap.parse_args()
    if not 1 <= args.replicas <= 16 or not 1 <= args.seeds <= 1000:
        ap.error("--replicas 1..16 and --seeds 1..1000")
    if args.json:
        try:
            open(args.json, "a").close()  # (a path it cannot write fails now, not after the runs)
        except OSError as e:
            ap.error(f"--json {args.json}: {e.strerror}")
    out = {}
    print(f"{'shape':14} {'differ':>7} {'moves':>7} {'maxload':>8} {'builds':>7}")
    for shape in SHAPES:
        runs = [run(shape, seed, args.replicas) for seed in range(args.seeds)]
        out[shape.name] = runs
        mean = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
        print(
            f"{shape.name:14} {mean['differ']:7.3f} {mean['moves']:7.1f} "
            f"{mean['maxload']:8.2f} {mean['builds']:7.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""`bench_overhead score`: the CPU one dispatch costs, per policy, in process (no sockets).

One dispatch here is what the request path does between parsing the body and relaying:
`Dispatcher.lease` entered and left (the pick with its policy, the lease, the release),
for a fresh `RequestInfo` each time, so the prompt's prefix hashes (computed once per
request) are in the figure. Workers are ready, with a scrape's worth of stats and some
requests in flight; the prefix index is warm (conversations already placed).

Cases: 4 and 64 workers; a short single-turn chat prompt (~0.2 KB) and a conversation
whose turn is 8 KB (a 1.5 KB system prompt, then history). Each figure is the median of
--runs runs of CPU time (process_time) over many dispatches, in microseconds; `queue` was
the default before `cache_aware`, so the difference is what the new default adds.

`cache_aware, owing` is the same with every worker owing a prefill backlog (0-40 KB of
prompt not yet answered, `Worker.backlog`): the backlog rule (dispatch/backlog.py) then
runs for every request, its worst case. `cache_aware, KV held` has every worker report a
KV cache 90% held, less free than an 8 KB prompt needs: the KV room check
(`_with_kv_room`) then runs for every 8 KB request, its worst case.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import time

import orjson

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.dispatcher import Dispatcher
from vllm_gateway.dispatch.policies import make_policy
from vllm_gateway.dispatch.request_info import parse_request
from vllm_gateway.workers import EngineStats, WorkerRegistry, WorkerState

POLICIES = ("round_robin", "queue", "cache_aware")
SYSTEM = "You are a careful assistant who answers in full sentences. " * 26  # ~1.5 KB


def _fleet(n: int, owing: bool = False, held: bool = False) -> WorkerRegistry:
    """`n` ready workers with a scrape each; `owing`: a prefill backlog each; `held`: each
    reports a KV cache of 10,000 tokens 90% held (less free than an 8 KB prompt needs, so
    cache_aware checks every candidate's room for what it would prefill there)."""
    registry = WorkerRegistry()
    rng = random.Random(n)
    owed = random.Random(n + 1)  # (its own stream: the same fleet owing or not)
    for i in range(n):
        w, _ = registry.add(f"http://127.0.{i // 250}.{i % 250 + 1}:8000", models=("m",))
        registry.set_state(w, WorkerState.READY, "bench")
        w.pace = 0.5 + rng.random()
        running = rng.randrange(8)
        if held:
            registry.set_stats(w, EngineStats(running, 0, 0.9, time.monotonic(), 10_000.0))
        else:
            registry.set_stats(w, EngineStats(running, 0, 0.3, time.monotonic()))
        if owing:  # prompt bytes sent and not yet answered (the lease adds and takes off)
            w.backlog = owed.randrange(40_000)
    return registry


def _bodies(conversations: int, size: int) -> list[bytes]:
    """One request body per conversation, each a turn of about `size` bytes."""
    out = []
    for c in range(conversations):
        messages = [{"role": "system", "content": SYSTEM[: max(64, min(len(SYSTEM), size // 5))]}]
        text_len = len(messages[0]["content"])
        t = 0
        while text_len < size:
            role = "user" if t % 2 == 0 else "assistant"
            content = f"conversation {c} turn {t}: " + "words of the turn " * 24
            messages.append({"role": role, "content": content})
            text_len += len(content)
            t += 1
        if messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": f"and then {c}?"})
        out.append(orjson.dumps({"model": "m", "messages": messages, "stream": True}))
    return out


async def _dispatch_cpu(
    policy_name: str, workers: int, size: int, count: int, owing: bool = False, held: bool = False
) -> float:
    """CPU microseconds per dispatch (lease in and out) for `count` dispatches."""
    registry = _fleet(workers, owing, held)
    policy = make_policy(policy_name, random.Random(1), DispatchConfig())
    dispatcher = Dispatcher(registry, policy, config=DispatchConfig())
    bodies = _bodies(512, size)
    for body in bodies:  # warm: every conversation placed once (the index holds them)
        async with dispatcher.lease(parse_request("/v1/chat/completions", body, "w")):
            pass
    infos = [
        parse_request("/v1/chat/completions", bodies[i % len(bodies)], "r") for i in range(count)
    ]
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        for info in infos:
            async with dispatcher.lease(info):
                pass
        return (time.process_time() - start) / count * 1e6
    finally:
        gc.enable()


def mode_score(args: argparse.Namespace, router_bin: str | None) -> dict:
    """Print CPU per dispatch by policy, workers and prompt size; return the figures."""
    cases = [(4, 200), (4, 8192), (64, 200), (64, 8192)]
    count = 20_000
    results: dict[str, float] = {}
    print("\n## score: CPU per dispatch (lease in and out, prefix hashes included), µs")
    header = "policy".ljust(28) + "".join(
        f"{w} workers {s // 1024 or s}{'KB' if s >= 1024 else 'B'}".rjust(18) for w, s in cases
    )
    print(header)
    variants = [(p, False, False) for p in POLICIES]
    variants += [("cache_aware", True, False), ("cache_aware", False, True)]
    for name, owing, held in variants:
        label = f"{name}, owing" if owing else f"{name}, KV held" if held else name
        row = label.ljust(28)
        for workers, size in cases:
            runs = [
                asyncio.run(_dispatch_cpu(name, workers, size, count, owing, held))
                for _ in range(args.runs)
            ]
            figure = statistics.median(runs)
            results[f"{label}/{workers}/{size}"] = figure
            row += f"{figure:18.2f}"
        print(row)
    for label in ("cache_aware", "cache_aware, owing", "cache_aware, KV held"):
        key = {"cache_aware": "added", "cache_aware, owing": "added owing"}.get(label, "added held")
        for workers, size in cases:
            added = results[f"{label}/{workers}/{size}"] - results[f"queue/{workers}/{size}"]
            results[f"{key}/{workers}/{size}"] = added
        print(
            f"{label} - queue:".ljust(28)
            + "".join(f"{results[f'{key}/{w}/{s}']:18.2f}" for w, s in cases)
        )
    return results

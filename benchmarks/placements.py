"""How the gateway placed a run's requests: the access log's `placed`, counted.

`bench_dispatch --placements` starts each gateway with its access log on (one JSON line
per finished request, into the gateway's log file) and counts the lines' `placed` values
(cache_aware's steps: history, back, preamble, overflow, home, only, load; docs/dispatch.md)
and how many waited in the gateway. Warm-up requests count too: the log has no phases.

`moved` counts the later turns that no worker of their conversation's turn before
prefilled (the benchmark's request ids are `<conversation>-t<turn>`, benchmarks/traffic.py;
read from the workers' logs, so for vllm-router too): each such move prefills the
conversation's history again where it lands (and the shared prefix before it, if that
worker lacks it). `later` counts every later turn by what its worker held: `kept` (it
prefilled what the turn added), `evicted` (the turn before's worker, which had evicted the
history: less than half the turn before's prompt found cached), `moved`; `later_tokens`
the tokens each kind prefilled. So a run says whether its lost reuse is moves or a cache
too small.

`plan_moves` is the gateways' own count of the popular preambles their plans moved
(`vllm_gateway_preamble_plan_moves_total`, read from /metrics as the run ends): the plan's
churn, each move a prefill of a preamble on a worker it was not planned on before.

It also starts the fake workers with `--log-requests` (benchmarks/systems.py: a JSON line
per request as its prefill starts, with its uncached tokens), and `prefill` joins the two
logs on the request id: the tokens the workers prefilled, by the step that placed each
request, which says which decisions cost the fleet its prefills (a document copied into
one more cache is 2000 tokens on docchat; a turn on its history's worker a few dozen).
`inside` reads the same worker logs for the time requests spent queued inside a worker
(arrival to the start of their prefill: a full batch, KV blocks that did not fit, or other
prompts' prefills ahead on the worker's one prefill lane): how many waited over `INSIDE`
seconds and their waits summed, for any system in front. Where prefill is cheap (hetero,
longchat's cached turns) that is mostly the tail the gateway's capacity gate is there to
keep out of the workers (it holds such requests in its own queue for the first free slot
instead), counted directly rather than read from a p99; where cold prompts are long
(ragchat, docchat) it is mostly their prefill, so it follows the cache hits.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

INSIDE = 0.01  # seconds queued inside a worker that count (admission takes ~1 ms anyway)


def _entries(lines: Iterable[str], event: str) -> Iterable[dict[str, object]]:
    """The JSON objects among `lines` whose event is `event` (other lines are skipped)."""
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == event:
            yield entry


def _lines(paths: Iterable[Path]) -> list[str]:
    out: list[str] = []
    for path in paths:
        if path.exists():
            with path.open(errors="replace") as f:
                out += f.readlines()
    return out


def count(lines: Iterable[str]) -> Counter[str]:
    """`placed` values of the access log lines among `lines` (others are skipped), and
    `waited`: the lines whose request waited in the admission queue."""
    out: Counter[str] = Counter()
    for entry in _entries(lines, "request"):
        if "worker" in entry:  # (a refusal's line names no worker)
            out[str(entry.get("placed"))] += 1
            if entry.get("waited"):
                out["waited"] += 1
    return out


def of_files(paths: Iterable[Path]) -> Counter[str]:
    """`count` over the log files that exist among `paths`."""
    return count(_lines(paths))


Turn = tuple[str, int]  # (conversation, turn number), from a `<conversation>-t<turn>` id
Line = tuple[int, int, int]  # (worker, prompt tokens, uncached tokens) of one prefill line


def _turns(workers: Sequence[Iterable[str]]) -> dict[Turn, list[Line]]:
    """Each turn's prefill lines in the fake workers' request logs (`workers[i]`: worker
    i's lines; ids not `<conversation>-t<turn>` and broken lines are skipped). A turn
    retried elsewhere has a line on each worker it tried."""
    where: dict[Turn, list[Line]] = {}
    for i, lines in enumerate(workers):
        for e in _entries(lines, "prefill"):
            rid = e.get("request_id")
            if isinstance(rid, str):
                conversation, sep, turn = rid.rpartition("-t")
                if sep and turn.isascii() and turn.isdigit():
                    prompt, uncached = e.get("prompt_tokens"), e.get("uncached_tokens")
                    if not (isinstance(prompt, int) and isinstance(uncached, int)):
                        prompt = uncached = 0
                    where.setdefault((conversation, int(turn)), []).append((i, prompt, uncached))
    return where


def later_turns(workers: Sequence[Iterable[str]]) -> tuple[Counter[str], Counter[str]]:
    """The later turns (those with a line for the turn before) by what their worker held,
    and the tokens they prefilled: `moved`, no worker of the turn before prefilled it (the
    logs do not say which of a retry's attempts came last: it moved only if none of them
    is one of its turn before's); `evicted`, one of the turn before's workers did, but
    found cached less than half of the turn before's prompt (it had evicted the history;
    measured against the turn before, not this turn's own length, so a new message longer
    than the history is no eviction); `kept`, the rest (it prefilled what the turn added).
    A line whose token counts are not numbers says nothing of what was held. Counts, then
    tokens. From the workers' logs, so it reads any system in front."""
    where = _turns(workers)
    turns: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    for (c, t), lines in where.items():
        before = where.get((c, t - 1)) if t else None
        if before is None:
            continue
        there = {w for w, _, _ in before}
        held = max(p for _, p, _ in before)  # the turn before's prompt, cached where it ran
        cached = [p - u for w, p, u in lines if w in there and p > 0]
        if not any(w in there for w, _, _ in lines):
            kind = "moved"
        elif cached and 2 * max(cached) < held:
            kind = "evicted"
        else:
            kind = "kept"
        turns[kind] += 1
        tokens[kind] += sum(u for _, _, u in lines)
    return turns, tokens


def moved(workers: Sequence[Iterable[str]]) -> int:
    """Later turns that no worker of their turn before prefilled (`later_turns`)."""
    return later_turns(workers)[0]["moved"]


def later_of_files(workers: Iterable[Path]) -> dict[str, object]:
    """`later_turns` over the workers' log files, as result fields: inside=N/S (`inside`),
    moved=N (as before),
    later=kept:N/evicted:N/moved:N and later_tokens=kept:N/evicted:N/moved:N."""
    lines = [_lines([path]) for path in workers]
    turns, tokens = later_turns(lines)
    kinds = ("kept", "evicted", "moved")
    return {
        "inside": inside(lines),
        "moved": turns["moved"],
        "later": "/".join(f"{k}:{turns[k]}" for k in kinds),
        "later_tokens": "/".join(f"{k}:{tokens[k]}" for k in kinds),
    }


def inside(workers: Iterable[Iterable[str]]) -> str:
    """Requests queued inside a worker over `INSIDE` seconds (their prefill lines'
    `waited`: arrival to prefill start), and those waits summed: inside=N/S.SSs."""
    waits = [
        w
        for lines in workers
        for e in _entries(lines, "prefill")
        if isinstance(w := e.get("waited"), (int, float)) and w > INSIDE
    ]
    return f"{len(waits)}/{sum(waits):.2f}s"


def brief(counts: Counter[str]) -> str:
    """One token for a result line: placed=history:812/home:110/...;waited:3 (most first)."""
    placed = "/".join(f"{k}:{v}" for k, v in counts.most_common() if k != "waited")
    return f"{placed or 'none'};waited:{counts['waited']}"


def prefill(gateway_lines: Iterable[str], worker_lines: Iterable[str]) -> Counter[str]:
    """Uncached prompt tokens the workers prefilled (their request logs), by the `placed`
    of the access log line with the same request id ("unlogged": no such line, e.g. a
    request the gateway did not place, or its line lost). A request retried on another
    worker has a line on each, both counted under its last attempt's `placed`."""
    placed = {
        e.get("request_id"): str(e.get("placed"))
        for e in _entries(gateway_lines, "request")
        if "worker" in e
    }
    out: Counter[str] = Counter()
    for e in _entries(worker_lines, "prefill"):
        tokens = e.get("uncached_tokens")
        if isinstance(tokens, int) and tokens > 0:
            out[placed.get(e.get("request_id"), "unlogged")] += tokens
    return out


def prefill_of_files(gateways: Iterable[Path], workers: Iterable[Path]) -> Counter[str]:
    """`prefill` over the log files that exist among `gateways` and `workers`."""
    return prefill(_lines(gateways), _lines(workers))


def prefill_brief(tokens: Counter[str]) -> str:
    """One token for a result line: prefill=only:58157/preamble:52708/... (tokens, most
    first)."""
    return "/".join(f"{k}:{v}" for k, v in tokens.most_common()) or "none"


_PLAN_MOVES = re.compile(r"^vllm_gateway_preamble_plan_moves_total\{([^}]*)\} (\S+)$", re.M)
_MODEL = re.compile(r'model="((?:[^"\\]|\\.)*)"')


def plan_moves(page: str) -> int:
    """The preambles one gateway's plans moved, from its /metrics `page`: summed over its
    models; with `--gateway-processes N` each process makes the same plan (one per
    process, alike), so a model counts its largest process's figure, not their sum."""
    per_model: dict[str, float] = {}
    for labels, value in _PLAN_MOVES.findall(page):
        found = _MODEL.search(labels)
        model = found.group(1) if found else ""
        try:
            moves = float(value)
        except ValueError:
            continue
        per_model[model] = max(per_model.get(model, 0.0), moves)
    return int(sum(per_model.values()))

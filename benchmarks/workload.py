"""What a dispatch benchmark sends: worker specs, conversations of turns, arrival processes.

A workload is a list of conversations. A conversation starts at a scheduled time and
sends its turns one after another: each turn waits for the previous answer, then its
think time, then sends the system prompt, the whole history so far and the new user
message. A workload of independent requests is conversations of one turn.

Capacity is computed, not tuned: a worker runs max_num_seqs requests at once and a
request of n output tokens holds its slot for ttft + (n - 1) x tpot (plus its prefill,
which the families that use it account for themselves), so a worker completes
max_num_seqs / E[ttft + (n - 1) x tpot] requests per second; a cluster, their sum.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

MODEL = "bench-model"


@dataclass(frozen=True)
class WorkerSpec:
    """One fake worker's flags (vllm_gateway.fake_worker)."""

    ttft_ms: float
    tpot_ms: float
    max_num_seqs: int
    num_gpu_blocks: int | None = None
    prefill_ms_per_token: float = 0.0
    # A request whose blocks do not fit waits, as in vLLM (False: the cache over-commits,
    # the fake's behaviour the families were made with; `scripts/bench_dispatch --kv-wait`).
    kv_wait: bool = False

    def args(self) -> list[str]:
        out = ["--model", MODEL, "--ttft-ms", f"{self.ttft_ms:g}", "--tpot-ms", f"{self.tpot_ms:g}"]
        out += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.num_gpu_blocks is not None:
            out += ["--num-gpu-blocks", str(self.num_gpu_blocks)]
            if not self.kv_wait:
                out += ["--kv-overcommit"]
        if self.prefill_ms_per_token:
            out += ["--prefill-ms-per-token", f"{self.prefill_ms_per_token:g}"]
        return out

    def capacity(self, mean_tokens: float) -> float:
        """Requests per second this worker completes with every batch slot busy."""
        return self.max_num_seqs / ((self.ttft_ms + (mean_tokens - 1) * self.tpot_ms) / 1000)

    def describe(self) -> str:
        text = (
            f"ttft {self.ttft_ms:g} ms, tpot {self.tpot_ms:g} ms, max_num_seqs {self.max_num_seqs}"
        )
        if self.num_gpu_blocks is not None:
            text += f", {self.num_gpu_blocks} KV blocks"
            text += "" if self.kv_wait else " (over-committed)"
        if self.prefill_ms_per_token:
            text += f", prefill {self.prefill_ms_per_token:g} ms/uncached token"
        return text


@dataclass(frozen=True)
class Turn:
    user: str  # the new user message
    max_tokens: int
    think: float  # seconds between the previous answer and this turn (0 for the first)


@dataclass(frozen=True)
class Conversation:
    start: float  # seconds after the run begins
    system: str
    session: str  # X-Session-ID, for policies that keep a session on one worker
    turns: tuple[Turn, ...]


# --- arrival processes ----------------------------------------------------------------------


def poisson(rng: random.Random, rate: float, start: float, end: float) -> Iterator[float]:
    """Arrival times of a Poisson process of `rate`/s in [start, end)."""
    t = start + rng.expovariate(rate)
    while t < end:
        yield t
        t += rng.expovariate(rate)


def bursts(
    rng: random.Random, base: float, peak: float, period: float, length: float, end: float
) -> Iterator[float]:
    """Poisson arrivals at `base`/s, raised to `peak`/s for `length` s of every `period` s."""
    t = 0.0
    while t < end:
        burst_end = min(t + length, end)
        yield from poisson(rng, peak, t, burst_end)
        yield from poisson(rng, base, burst_end, min(t + period, end))
        t += period


# --- lengths and texts ----------------------------------------------------------------------

TokenDraw = Callable[[random.Random], int]


def spread(mean: int, share: float = 0.5) -> TokenDraw:
    """Uniform in mean x (1 +- share)."""
    low, high = max(1, round(mean * (1 - share))), round(mean * (1 + share))
    return lambda rng: rng.randint(low, high)


def lognormal(median: float, sigma: float, low: int, high: int) -> TokenDraw:
    """Log-normal (a heavy right tail), clipped to low..high."""
    mu = math.log(median)
    return lambda rng: max(low, min(high, round(rng.lognormvariate(mu, sigma))))


def mean_of(draw: TokenDraw, samples: int = 100_000) -> float:
    """The mean of a length distribution, clipping included (sampled, fixed seed)."""
    rng = random.Random(0)
    return statistics.fmean(draw(rng) for _ in range(samples))


def text(rng: random.Random, words: int, tag: str) -> str:
    """`words` distinct words: the fake worker's tokens, one per word."""
    return " ".join(f"{tag}{rng.randrange(10**6)}" for _ in range(words))


def system_prompts(count: int, words: int) -> list[str]:
    rng = random.Random(7)
    return [f"You are assistant {i}. " + text(rng, words - 3, f"s{i}-") for i in range(count)]


def single_turns(
    rng: random.Random, arrivals: Iterator[float], draw: TokenDraw, systems: list[str]
) -> list[Conversation]:
    """Independent requests: one turn each, a short question after one of `systems`."""
    out = []
    for i, at in enumerate(arrivals):
        turn = Turn(f"Question {i}: " + text(rng, 12, "q"), draw(rng), 0.0)
        out.append(Conversation(at, rng.choice(systems), f"s{rng.randrange(200)}", (turn,)))
    return out

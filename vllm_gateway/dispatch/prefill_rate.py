"""How long a worker takes per byte of prefill, learned from streamed first bytes.

    note(worker, elapsed, work)   a streamed request's first byte came `elapsed` seconds
                                  after it was sent, behind `work` bytes of prefill
    seconds_per_byte(worker)      their ratio, each smoothed; 0.0 while unknown

vLLM sends a streamed answer's first byte with its first token, once the prompt's uncached
part and what was queued ahead of it on the worker's prefill are done: so the time to it
over those bytes is what the worker spends per byte it must prefill, base latency
included. The dispatcher notes only requests whose bytes are as good as known (Lease
`learns`): a cold prompt (by the index the worker holds no part of it: all of it is
prefilled; cache_aware `_cold`) sent with none of this process's backlog ahead. Other
requests' bytes are guesses (dispatch/backlog.py) that count at least the worker's recent
miss share of each prompt (`Worker.miss`), where a turn on its holder misses a few hundred
bytes: learned over those, the rate came out at a third of the fake worker's on `longchat`
(docs/dispatch-rounds.md, "Waiting for a slot on the holder"). A worker sent no cold prompt
while idle has no rate (0.0), and nothing waits on one. A ratio of smoothed sums, not a
mean of ratios: a long prefill weighs more than a short one, whose time is mostly the
worker's fixed latency (which the rate still includes: where cold prompts are all short,
it comes out high). What reads it: patience.py (is a full holder's next free slot sooner
than prefilling the history elsewhere).
"""

from __future__ import annotations

import math

from vllm_gateway.workers import Worker

# Weight of each first byte in the smoothed sums: the last few dozen requests, so the
# figure follows a worker whose load changes within seconds and one odd request moves it
# only a little.
WEIGHT = 0.05


def note(worker: Worker, elapsed: float, work: int) -> None:
    """Fold one streamed request's time to first byte and the prefill bytes it waited
    for into `worker`'s figures (nonsense is ignored: a clock step, no work)."""
    if not (0.0 <= elapsed < math.inf and 0 < work < math.inf):
        return
    # Both sums start from 0, so the ratio weighs the first few requests about alike
    # (one odd first request does not stand for the worker until a few dozen more).
    worker.prefill_seconds += WEIGHT * (elapsed - worker.prefill_seconds)
    worker.prefill_bytes += WEIGHT * (work - worker.prefill_bytes)


def seconds_per_byte(worker: Worker) -> float:
    """Seconds `worker` spends per byte of prefill it owes; 0.0 while unknown."""
    work = worker.prefill_bytes
    return worker.prefill_seconds / work if work > 0.0 else 0.0

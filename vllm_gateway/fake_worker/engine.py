"""The simulated engine: one request's life through batch slot, prefix cache, prefill, decode.

The parts live one call down: batching slots in scheduler.py, KV blocks in
prefix_cache.py, shared prefill compute in prefill.py, the numbers in metrics.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from collections.abc import Awaitable, Callable, Iterable

from vllm_gateway.fake_worker.config import FakeWorkerConfig
from vllm_gateway.fake_worker.metrics import CacheInfo, EngineMetrics
from vllm_gateway.fake_worker.prefill import PrefillLane
from vllm_gateway.fake_worker.prefix_cache import PrefixCache, Sequence
from vllm_gateway.fake_worker.scheduler import Scheduler
from vllm_gateway.fake_worker.stats import FakeStats
from vllm_gateway.fake_worker.tokens import answer_token_id as answer_id

# Characters of a caller's X-Request-Id the request log keeps.
MAX_LOGGED_ID = 128


async def _sleep_until(deadline: float) -> None:
    # Pace from a fixed start so per-token jitter does not add up over a long answer.
    await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))


def _made(role: str | None, start: int, stop: int) -> Iterable[int]:
    """The ids of answer tokens start..stop-1 as a later prompt quoting the answer said
    by `role` has them; none without a role (nor without a cache capacity, the caller
    sees to it: nothing would ever evict generated blocks, and memory would grow with
    every answer)."""
    if role is None:
        return ()
    return (answer_id(j, role) for j in range(start, stop))


class Engine:
    """Runs requests like vLLM's engine would time them, one coroutine per request."""

    def __init__(self, config: FakeWorkerConfig, stats: FakeStats) -> None:
        self.config = config
        self.scheduler = Scheduler(config.max_num_seqs, stats)
        self.cache = PrefixCache(config.block_size, config.num_gpu_blocks, config.kv_overcommit)
        self.prefill_lane = PrefillLane(config.prefill_ms_per_token)
        self.metrics = EngineMetrics(
            config.base_model, len(config.lora_adapters), config.legacy_metrics
        )

    async def generate(
        self,
        arrival: float,
        model: str,
        prompt: list[int],
        n: int,
        on_token: Callable[[int], Awaitable[None]] | None,
        answer_role: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Wait for a slot and room for the prompt's KV blocks, prefill, then make n
        tokens at one per tpot.

        Prefill is the prompt's uncached tokens on the worker's shared prefill lane,
        then ttft. `prompt` is the token ids. With `answer_role` (None: the answer is not
        what a later prompt would quote), the cache keeps the answer's blocks as they
        fill, under the ids a later prompt quoting it said by that role would have.
        `on_token(i)` runs as token i is made, still holding the slot (a stalled writer
        keeps its sequence in the batch, as in vLLM). `arrival` is the loop.time() the
        request came in, for the TTFT and latency histograms. `request_id`: the caller's
        X-Request-Id, for the request log (`FakeWorkerConfig.log_requests`).
        """
        loop = asyncio.get_running_loop()
        ttft, tpot = self.config.ttft_ms / 1000, self.config.tpot_ms / 1000
        m, cache = self.metrics, self.cache
        role = answer_role if cache.capacity is not None else None  # _made says why
        claim = functools.partial(cache.claim, model, prompt)  # runs once its blocks fit
        async with self.scheduler.claimed(model, claim, cache.release) as seq:
            try:
                await self._prefill(seq, len(prompt), arrival, request_id)
                start = loop.time()
                if on_token is None:
                    # Nobody watches the tokens: sleep straight to the first and the last.
                    await _sleep_until(start + ttft)
                    first = loop.time()
                    m.ttft.observe(first - arrival)
                    # The whole answer's blocks at once; the last token's KV is never computed.
                    cache.grow(seq, len(prompt) + n, _made(role, 0, n - 1))
                    await _sleep_until(start + ttft + (n - 1) * tpot)
                    m.generation_tokens += n
                else:
                    for i in range(n):
                        await _sleep_until(start + ttft + i * tpot)
                        if i == 0:
                            first = loop.time()
                            m.ttft.observe(first - arrival)
                        m.generation_tokens += 1
                        # Making token i computes token i-1's KV (none for i == 0).
                        cache.grow(seq, len(prompt) + i + 1, _made(role, max(0, i - 1), i))
                        await on_token(i)
            finally:
                cache.release(seq)
        end = loop.time()
        m.finished["length"] += 1
        m.e2e.observe(end - arrival)
        if n > 1:
            m.tpot.observe((end - first) / (n - 1))

    async def _prefill(
        self, seq: Sequence, prompt: int, arrival: float, request_id: str | None
    ) -> None:
        """Prefill the uncached part of a `prompt`-token prompt on the shared lane, logged
        first with `--log-requests`. The cache is looked up again when the prefill starts
        (prefill.py says why)."""
        cache, lane = self.cache, self.prefill_lane
        async with lane.turn():
            cache.refresh(seq)
            if self.config.log_requests:
                waited = asyncio.get_running_loop().time() - arrival
                _log_prefill(request_id, prompt, seq.uncached_tokens, waited)
            self.metrics.prompt_tokens += prompt
            await lane.compute(seq.uncached_tokens)
            cache.commit(seq)

    async def prefill(self, model: str, prompt: int) -> None:
        """Pooling requests (embed, score, rerank) hold a slot for one prefill."""
        async with self.scheduler.slot(model):
            self.metrics.prompt_tokens += prompt
            await asyncio.sleep(self.config.ttft_ms / 1000)

    def count_abort(self) -> None:
        self.metrics.finished["abort"] += 1

    def metrics_page(self) -> str:
        sched, cache = self.scheduler, self.cache
        lora = set(self.config.lora_adapters)
        usage = cache.usage()
        if usage is None:  # memory not modelled: a full batch stands in for a full cache
            usage = sched.running / sched.max_num_seqs
        return self.metrics.render(
            running=sched.running,
            waiting=sched.waiting,
            usage=usage,
            cache=CacheInfo(cache.block_size, cache.capacity, cache.queries, cache.hits),
            running_loras=[m for m in sched.running_models() if m in lora],
            waiting_loras=[m for m in sched.waiting_models() if m in lora],
        )


def _log_prefill(request_id: str | None, prompt: int, uncached: int, waited: float) -> None:
    """One JSON line on stderr as a request's prefill starts (`--log-requests`): the
    caller's request id (a header anyone may send: cut to `MAX_LOGGED_ID` characters,
    bytes that are not UTF-8 written out as text, so every line is strict JSON), its
    prompt and uncached tokens, and the seconds since it arrived (waiting for a batch
    slot, KV blocks and the prefills ahead of it on the lane; the loop's clock, about a
    millisecond fine under uvloop). benchmarks/placements.py joins it with the gateway's
    access log. Embeddings, score and rerank requests are not logged."""
    if request_id is not None:
        request_id = request_id[:MAX_LOGGED_ID].encode("utf-8", "backslashreplace").decode()
    line = {
        "event": "prefill",
        "request_id": request_id,
        "prompt_tokens": prompt,
        "uncached_tokens": uncached,
        "waited": round(waited, 6),
    }
    sys.stderr.write(json.dumps(line) + "\n")

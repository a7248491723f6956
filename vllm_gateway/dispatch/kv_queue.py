"""What a worker's scrapes and the requests sent to it say of its KV cache.

vLLM keeps a request waiting while its prompt's blocks do not fit beside those its
running requests hold, whatever its batch has free, and admits nobody behind it
meanwhile. What it runs then is no batch size (buckets.py learns one from a queue). A
queue is taken for the KV cache's when the free part of the cache
(`1 - vllm:kv_cache_usage_perc` of `vllm:cache_config_info`'s size in tokens) is less
than the largest prompt sent to the worker lately may need: the largest request body,
at `BYTES_PER_TOKEN`, halving every `HALF_LIFE` seconds from when it was sent
(`KvEvidence.bound`). Such a queue while the worker runs well under the most it has
run marks its KV cache as binding (`Worker.kv_binds`: the admission queue's patience
reads it), until the worker restarts (its counters go back, or its cache has another
size): a new engine is learned anew. Its free blocks (`Worker.kv_free`) are counted from
every scrape that reports its cache, binding seen or not (but a cache read full, usage
1.0, with no queue, not at all: an engine that over-commits or preempts reads 1.0 while
it admits); `has_kv_room` reads them for placement (docs/dispatch.md "No copy into a
full KV cache"): vLLM keeps a prompt waiting while its blocks do not fit, from its first
request on, and copies sent before any queue taught `kv_binds` scattered documents over
every worker (measured: docs/dispatch-rounds.md).

Bytes per token (`TokenBytes`, `Worker.token_bytes`): the mean body this process sends the
worker over the mean prompt its own counters say it processed per request started
(`vllm:prompt_tokens_total` over `vllm:request_success_total` plus the growth of
`vllm:num_requests_running`: vLLM counts a prompt when its prefill runs, the request when
it ends), both as sums halving every
`TOKEN_BYTES_HALF_LIFE` seconds. The counters count every sender's requests: a replica
sending the same mix measures the same figure; other senders with another mix (direct
clients with long documents, say) bias it. The prefix index sizes the worker's cache by
it once measured, binding or not (prefix_index.py `capacity_of`).
"""

from __future__ import annotations

import math

from vllm_gateway.workers import EngineStats, Worker

# Request body bytes per prompt token: about 4 per token of English text (prefix_hash.py's
# figure); a body also carries its JSON, so a prompt counts as more tokens than it has.
BYTES_PER_TOKEN = 4.0
# Half-life, in seconds, of the largest request body a worker was sent.
HALF_LIFE = 10.0
# A queue while the worker runs less than this part of the most it has been seen running
# is not its batch's (a full batch runs its most): its KV cache binds. A scrape may catch
# a batch a request or two short of its most, as one ends and the next starts.
KV_BINDS_BELOW = 0.75
# Half-life, in seconds, of the sums bytes per token is measured over: long beside a
# request's life, as the worker counts a prompt when its prefill runs and the request
# when it ends, and this process counts the bytes when it sends them.
TOKEN_BYTES_HALF_LIFE = 30.0
# Requests (as decayed sums) both sides must have counted before the figure is read.
TOKEN_BYTES_MIN_REQUESTS = 8.0


class TokenBytes:
    """Request bytes per prompt token for one worker, from what this process sends it and
    what the worker's counters say it processed (module docstring)."""

    __slots__ = (
        "bytes", "done_seen", "figure", "requests", "running_seen", "sends", "sent", "sent_bytes",
        "tokens", "tokens_seen",
    )  # fmt: skip

    def __init__(self) -> None:
        self.sent = 0  # requests sent since the last scrape (dispatch counts them)
        self.sent_bytes = 0  # and their bytes
        self.tokens_seen: float | None = None  # the counters at the last scrape
        self.done_seen: float | None = None
        self.running_seen: float | None = None
        # Decayed sums: this process's requests and bytes; the worker's requests and tokens.
        self.sends = self.bytes = self.requests = self.tokens = 0.0
        self.figure = 0.0  # the last figure measured (0: none yet)

    def fold(
        self, tokens: float | None, done: float | None, decay: float, running: float | None = None
    ) -> float:
        """A scrape with these counters (prompt tokens, requests finished) and the requests
        running, `decay` the sums' weight since the last one: the bytes per token now (0:
        not known). Once known, the figure holds while the evidence thins (a quiet spell, a
        page missing a counter for a scrape), and starts over when the worker restarts.

        vLLM counts a prompt's tokens when its prefill runs and the request when it ends:
        the requests whose prompts were counted since the last scrape are those finished
        since plus the growth of those running. Counted by the finished alone, a worker
        ramping up with long answers (seconds of decode) read a fifth of its figure for
        tens of seconds, and its index forgot most of what its cache held."""
        if tokens is None or done is None:
            return self.figure  # the sends and the counters' deltas wait for the next one
        last_t, last_d, last_r = self.tokens_seen, self.done_seen, self.running_seen
        back = self.went_back(tokens, done)
        sent, sent_bytes = self.sent, self.sent_bytes
        self.sent = self.sent_bytes = 0
        self.tokens_seen, self.done_seen, self.running_seen = tokens, done, running
        if last_t is None or last_d is None:
            return self.figure
        if back:  # restarted: its counters start over
            self.sends = self.bytes = self.requests = self.tokens = self.figure = 0.0
            return 0.0
        started = done - last_d
        if running is not None and last_r is not None:
            started = max(0.0, started + running - last_r)
        self.sends = self.sends * decay + sent
        self.bytes = self.bytes * decay + sent_bytes
        self.requests = self.requests * decay + started
        self.tokens = self.tokens * decay + (tokens - last_t)
        least = TOKEN_BYTES_MIN_REQUESTS
        # Fewer than one token a request, or a sum decayed to nothing: no figure from it.
        if self.sends >= least and self.requests >= least and self.tokens >= self.requests:
            figure = (self.bytes / self.sends) / (self.tokens / self.requests)
            if math.isfinite(figure):
                self.figure = figure
        return self.figure

    def went_back(self, tokens: float | None, done: float | None) -> bool:
        """Whether either counter is below what the last scrape read: the worker
        restarted (a counter missing now or then says nothing)."""
        last_t, last_d = self.tokens_seen, self.done_seen
        return (tokens is not None and last_t is not None and tokens < last_t) or (
            done is not None and last_d is not None and done < last_d
        )


class KvEvidence:
    """One worker's KV evidence: the largest request body (bytes) it was sent lately, the
    most requests it was seen running, and its bytes per token (`TokenBytes`)."""

    __slots__ = ("at", "cache", "most", "peak", "sent", "token_bytes")

    def __init__(self) -> None:
        self.token_bytes = TokenBytes()
        self.sent = 0  # the largest since the last scrape (dispatch sets it as it sends)
        self.peak = 0.0  # folded in at each scrape, halving every HALF_LIFE seconds
        self.at: float | None = None  # EngineStats.at of the last scrape
        self.most = 0.0  # the most requests the worker was seen running
        self.cache: float | None = None  # its KV cache size (tokens) at the last scrape

    def note(self, size: int) -> None:
        """A request body of `size` bytes is sent to the worker (dispatch)."""
        if size > self.sent:
            self.sent = size
        counted = self.token_bytes
        counted.sent += 1
        counted.sent_bytes += size

    def fold(self, worker: Worker, stats: EngineStats) -> bool:
        """A scrape: the peak decays since the last one, then takes in the largest body
        sent since; and whether the worker's KV cache binds (`Worker.kv_binds`: a queue
        the KV cache may cause, while it runs less than `KV_BINDS_BELOW` of its most),
        and its free blocks (`Worker.kv_free`, whenever the page reports its cache, but
        not read full with no queue while not binding); and its bytes per token
        (`Worker.token_bytes`). True when the worker restarted (`_restarted`): what was
        learned of the old engine is dropped here, and the caller drops its own."""
        at = stats.at
        since = max(0.0, at - self.at) if self.at is not None else 0.0
        self.peak *= 0.5 ** (since / HALF_LIFE)
        self.at = at
        decay = 0.5 ** (since / TOKEN_BYTES_HALF_LIFE)
        restarted = self._restarted(stats)
        if restarted:  # another engine now: what was learned was the old one's
            self.most, worker.kv_binds = 0.0, False
            self.token_bytes = TokenBytes()
        worker.token_bytes = self.token_bytes.fold(
            stats.prompt_tokens, stats.requests_done, decay, stats.running
        )
        if self.sent > self.peak:
            self.peak = self.sent
        self.sent = 0
        running = stats.running
        if running > self.most:
            self.most = running
        if not worker.kv_binds:
            below = running < KV_BINDS_BELOW * self.most
            worker.kv_binds = stats.waiting > 0 and below and self.bound(stats)
        usage, size = stats.kv_cache_usage, stats.cache_tokens
        # A cache read full with no queue (an engine that over-commits, or preempts, reads
        # 1.0 while it admits) says nothing of room; with a queue, or once a queue showed
        # it binding, it has none.
        if usage is not None and size and (usage < 1.0 or worker.kv_binds or stats.waiting):
            worker.kv_free = max(0.0, 1.0 - usage) * size
        return restarted

    def _restarted(self, stats: EngineStats) -> bool:
        """Whether the worker restarted since the last scrape: its counters went back, or
        its KV cache has another size (a new engine, another `--gpu-memory-utilization`)."""
        cache, size = self.cache, stats.cache_tokens
        if size is not None:  # (a page without it keeps the last size to compare with)
            self.cache = size
            if cache is not None and size != cache:
                return True
        return self.token_bytes.went_back(stats.prompt_tokens, stats.requests_done)

    def bound(self, stats: EngineStats | None) -> bool:
        """Whether a queue in `stats` may be the KV cache's (False when the worker does not
        report its cache)."""
        if stats is None or stats.kv_cache_usage is None or not stats.cache_tokens:
            return False
        free = (1.0 - stats.kv_cache_usage) * stats.cache_tokens
        return free < self.peak / BYTES_PER_TOKEN


def has_kv_room(worker: Worker, size: int) -> bool:
    """Whether `worker`'s free KV blocks at its last scrape (`Worker.kv_free`) hold a
    prompt of `size` bytes (at `BYTES_PER_TOKEN`): where they do not, vLLM keeps it waiting,
    and every request behind it, until its running requests free blocks. True when the
    worker does not report its cache."""
    return worker.kv_free * BYTES_PER_TOKEN >= size

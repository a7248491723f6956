"""Scrape: read each worker's Prometheus /metrics into an `EngineStats` snapshot.

    parse_metrics(page, names, models) -> EngineStats | None     (pure)
    Scraper(registry, pool, config).start() / .stop()           (background task)

The parser reads three gauges, each named in configuration because vLLM renames them
between releases (the first name present on the page wins): requests running, requests
waiting, and KV-cache usage. Running and waiting are summed over the page's samples (one
per engine in a data-parallel server); KV-cache usage is averaged, since it is a fraction
per engine. Samples with a `model_name` label count only when it names one of the worker's
models; unlabelled samples always count. Everything else on the page (histograms, info
gauges, `_created` families, metrics from a newer release) is skipped without being
parsed, so an unknown metric can never break a scrape.

The scraper GETs every worker's /metrics each `interval`, concurrently, each GET bounded by
`timeout`, at most one in flight per worker (a slow worker does not delay the others). A
snapshot reaches the fleet only through `WorkerRegistry.set_stats`; one older than
`stale_after` is withdrawn, so dispatch falls back to the gateway's own in-flight counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Collection, Iterable, Iterator

import aiohttp

from vllm_gateway.config.gateway import ScrapeConfig
from vllm_gateway.fleet.pages import PageTooLarge, parse_off_loop, read_capped
from vllm_gateway.fleet.periodic import Periodic
from vllm_gateway.log import get_logger
from vllm_gateway.proxy.pool import UpstreamPool
from vllm_gateway.workers import EngineStats, Worker, WorkerRegistry

log = get_logger("vllm_gateway.scrape")

_MODEL_LABEL = "model_name"
# What a worker reports is clamped into these bounds (a page claiming 1e308 requests would
# make demand infinite and every sum and ceil downstream overflow): no server runs or
# queues a million requests, and KV-cache usage is a fraction.
MAX_REQUESTS = 1_000_000.0


def _clamp(value: float, high: float) -> float:
    return min(max(value, 0.0), high)


# vLLM's info gauge of its cache configuration: labels num_gpu_blocks and block_size give
# the KV cache's size in tokens (the prefix index is sized like it: dispatch/prefix_index.py).
CACHE_CONFIG = "vllm:cache_config_info"
MAX_CACHE_TOKENS = 1e12  # clamped as the gauges are: no worker holds a trillion tokens
# vLLM's prefix-cache counters (V1; prompt tokens looked up, and found cached; the names
# before 0.10 first on the page win): how much of what it is sent it really finds, which
# the prefix index only guesses (workers.Worker.miss).
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
# Prompt tokens the worker processed (each request's whole prompt, once, at its prefill)
# and requests it finished (every finished_reason), from whomever: their ratio is its
# prompts' mean length in tokens, which the bytes this process sends turn into bytes per
# token (dispatch/kv_queue.py). Not the prefix-cache queries: vLLM releases before the
# fix of vllm#43736 (July 2026) count a request's lookup again each time it retries for
# KV blocks, which is when the figure is read.
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
REQUESTS_DONE = ("vllm:request_success_total",)
MAX_TOKENS_COUNTED = 1e18  # a counter past this is nonsense; clamped like the gauges


class MetricNames:
    """Which gauges to read; for each, the candidate names in order of preference."""

    __slots__ = ("kv_cache", "prefixes", "running", "waiting")

    def __init__(
        self, running: Iterable[str], waiting: Iterable[str], kv_cache: Iterable[str]
    ) -> None:
        self.running = tuple(running)
        self.waiting = tuple(waiting)
        self.kv_cache = tuple(kv_cache)
        # One startswith() per line rejects everything else cheaply.
        self.prefixes = (
            *self.running,
            *self.waiting,
            *self.kv_cache,
            CACHE_CONFIG,
            *PREFIX_QUERIES,
            *PREFIX_HITS,
            *PROMPT_TOKENS,
            *REQUESTS_DONE,
        )

    @classmethod
    def from_config(cls, config: ScrapeConfig) -> MetricNames:
        return cls(config.running_metrics, config.waiting_metrics, config.kv_cache_metrics)


def parse_labels(text: str) -> dict[str, str]:
    """The labels of one sample, `a="x",b="y \\"quoted\\""` -> {"a": "x", "b": ...}."""
    labels: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        eq = text.find("=", i)
        if eq < 0 or eq + 1 >= n or text[eq + 1] != '"':
            raise ValueError(f"malformed labels: {text!r}")
        key = text[i:eq].strip().lstrip(",").strip()
        j = eq + 2
        value: list[str] = []
        while True:
            if j >= n:
                raise ValueError(f"unterminated label value: {text!r}")
            c = text[j]
            if c == "\\" and j + 1 < n:
                nxt = text[j + 1]
                value.append("\n" if nxt == "n" else nxt)
                j += 2
            elif c == '"':
                j += 1
                break
            else:
                value.append(c)
                j += 1
        labels[key] = "".join(value)
        while j < n and text[j] in ", ":
            j += 1
        i = j
    return labels


# Parsed label texts, by text: a worker's page repeats the same label sets on every scrape
# (its model, engine and cache configuration), and parsing them was half of a page's
# parse. Bounded in entries and in the length of a text kept, so a hostile page cannot
# grow it; cleared when full. Values are shared: callers only read them. Parses run in
# threads too (pages.parse_off_loop): one get per lookup, so a clear in between is harmless.
_LABELS_KEPT = 1024
_LABEL_TEXT_KEPT = 512  # vLLM's longest, cache_config_info's, is about 300
_labels_memo: dict[str, tuple[dict[str, str] | None]] = {}


def _labels_of(text: str) -> dict[str, str] | None:
    """`parse_labels(text)`, remembered; None for malformed labels."""
    kept = _labels_memo.get(text)
    if kept is not None:
        return kept[0]
    try:
        parsed: dict[str, str] | None = parse_labels(text)
    except ValueError:
        parsed = None
    if len(text) <= _LABEL_TEXT_KEPT:
        if len(_labels_memo) >= _LABELS_KEPT:
            _labels_memo.clear()
        _labels_memo[text] = (parsed,)
    return parsed


def page_lines(page: bytes, piece: int = 1 << 16) -> Iterator[str]:
    """The lines of a page, decoded and split `piece` bytes at a time: each C call holds
    the GIL briefly, so a parse in a thread lets the event loop run in between (one
    decode and splitlines of a 12 MiB page would hold it for tens of ms)."""
    start, n = 0, len(page)
    while start < n:
        end = page.rfind(b"\n", start, start + piece) + 1 if start + piece < n else n
        if end <= start:  # one line longer than a piece: take it whole
            end = page.find(b"\n", start + piece) + 1 or n
        yield from page[start:end].decode("utf-8", "replace").splitlines()
        start = end


def _samples(
    page: str | Iterable[str], prefixes: tuple[str, ...]
) -> dict[str, list[tuple[str, float]]]:
    """name -> [(label text, value)] for the sample lines whose name is in `prefixes`."""
    found: dict[str, list[tuple[str, float]]] = {}
    for line in page.splitlines() if isinstance(page, str) else page:
        if not line.startswith(prefixes):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace >= 0 and (space < 0 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            if close < brace:
                continue
            labels, rest = line[brace + 1 : close], line[close + 1 :]
        else:
            if space < 0:
                continue
            name, labels, rest = line[:space], "", line[space:]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isfinite(value):  # NaN would poison every comparison downstream
            continue
        found.setdefault(name, []).append((labels, value))
    return found


def _pick(
    found: dict[str, list[tuple[str, float]]], names: tuple[str, ...], models: Collection[str]
) -> list[float] | None:
    """The values of the first of `names` present on the page, for the worker's models."""
    for name in names:
        samples = found.get(name)
        if samples is None:
            continue
        values = []
        for labels, value in samples:
            if models and _MODEL_LABEL in labels:
                parsed = _labels_of(labels)
                if parsed is None:
                    continue
                model = parsed.get(_MODEL_LABEL)
                if model is not None and model not in models:
                    continue
            values.append(value)
        return values
    return None


def parse_metrics(
    page: str | Iterable[str], names: MetricNames, models: Collection[str] = (), at: float = 0.0
) -> EngineStats | None:
    """Read one worker's load from its /metrics page; None when a gauge is missing.

    `page` is the text, or its lines (`page_lines`); `models` are the worker's model names
    (empty: count every sample); `at` stamps the snapshot (time.monotonic() of the scrape).
    """
    found = _samples(page, names.prefixes)
    running = _pick(found, names.running, models)
    waiting = _pick(found, names.waiting, models)
    if running is None or waiting is None:
        return None
    kv = _pick(found, names.kv_cache, models)
    # Each sample is finite (see _samples) and clamped before summing, so no sum overflows.
    kv_usage = sum(_clamp(v, 1.0) for v in kv) / len(kv) if kv else None
    return EngineStats(
        running=_clamp(sum(_clamp(v, MAX_REQUESTS) for v in running), MAX_REQUESTS),
        waiting=_clamp(sum(_clamp(v, MAX_REQUESTS) for v in waiting), MAX_REQUESTS),
        kv_cache_usage=kv_usage,
        at=at,
        cache_tokens=_cache_tokens(found.get(CACHE_CONFIG, ())),
        cache_queries=_counter(found, PREFIX_QUERIES, models),
        cache_hits=_counter(found, PREFIX_HITS, models),
        prompt_tokens=_counter(found, PROMPT_TOKENS, models),
        requests_done=_counter(found, REQUESTS_DONE, models),
    )


def _counter(
    found: dict[str, list[tuple[str, float]]], names: tuple[str, ...], models: Collection[str]
) -> float | None:
    """A counter summed over the worker's engines (and its models), or None if absent."""
    values = _pick(found, names, models)
    if not values:
        return None
    return _clamp(sum(_clamp(v, MAX_TOKENS_COUNTED) for v in values), MAX_TOKENS_COUNTED)


def _cache_tokens(samples: Iterable[tuple[str, float]]) -> float | None:
    """KV cache tokens from vllm:cache_config_info samples (one per engine), or None."""
    total = 0.0
    for labels, _ in samples:
        parsed = _labels_of(labels)
        if parsed is None:
            continue
        try:
            tokens = float(parsed["num_gpu_blocks"]) * float(parsed["block_size"])
        except (KeyError, ValueError):
            continue
        if math.isfinite(tokens) and tokens > 0:
            total += min(tokens, MAX_CACHE_TOKENS)
    return total or None


class Scraper:
    """Scrapes every worker each `interval` and records what it reads in the registry."""

    def __init__(
        self,
        registry: WorkerRegistry,
        pool: UpstreamPool,
        config: ScrapeConfig,
        api_key: str | None = None,
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.config = config
        self.names = MetricNames.from_config(config)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._busy: set[Worker] = set()  # workers with a scrape in flight
        self._last_ok: dict[Worker, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # scrapes in flight
        self._told: dict[Worker, str] = {}  # the refused page last logged for each worker
        self._ticks = Periodic(
            "scraper", self._tick, lambda: self.config.interval, log, "scrape tick failed"
        )
        # Telemetry, read at scrape time by the metrics endpoint.
        self.scrapes = 0
        self.failures = 0
        self.refused_pages = 0  # of the failures, pages over `max_page_bytes`

    async def scrape_worker(self, worker: Worker) -> bool:
        """Scrape one worker now and record the result; return whether it worked."""
        # Requests sent or finished while the GET is out may or may not be in the page. To
        # err toward a busier worker, never a herd, those sent meanwhile count as sent since
        # the scrape (counted on top of the page), and those finished meanwhile as already
        # gone from it (not taken off the page again): `sent` is read before the GET,
        # `finished` after it.
        sent = worker.sent_since_scrape
        inflight = worker.inflight
        timeout = aiohttp.ClientTimeout(total=self.config.timeout)
        url = worker.url + "/metrics"
        self.scrapes += 1
        try:
            async with self.pool.session.get(url, timeout=timeout, headers=self._headers) as r:
                body = await read_capped(r, self.config.max_page_bytes)
                if r.status != 200:
                    raise ValueError(f"/metrics answered {r.status}")
            now = time.monotonic()
            names, models = self.names, worker.models

            def parse(page: bytes) -> EngineStats | None:
                return parse_metrics(page_lines(page), names, models, now)

            stats = await parse_off_loop(parse, body)
            del body
            if stats is None:
                raise ValueError("the page lacks the running or waiting gauge")
        except PageTooLarge as e:
            self.failures += 1
            self.refused_pages += 1
            if self._told.get(worker) != "too large":  # once, until a scrape works again
                self._told[worker] = "too large"
                log.warning("worker /metrics refused", worker=worker.url, reason=str(e))
            return False
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            self.failures += 1
            log.debug("scrape failed", worker=worker.url, error=str(e) or type(e).__name__)
            return False
        self._told.pop(worker, None)
        if self.registry.get(worker.url) is not worker:
            return False  # removed while the scrape was out
        self._last_ok[worker] = now
        finished = worker.finished_since_scrape
        # The most of this process's requests the page may count: those in flight when
        # the GET went out, and all sent while it was out (`Worker.others` is the rest).
        own = inflight + max(0, worker.sent_since_scrape - sent)
        self.registry.set_stats(worker, stats, sent=sent, finished=finished, own=own)
        return True

    async def _guarded(self, worker: Worker) -> None:
        self._busy.add(worker)
        try:
            await self.scrape_worker(worker)
        except Exception:  # a bug here must not end scraping for good
            log.exception("scrape failed unexpectedly", worker=worker.url)
        finally:
            self._busy.discard(worker)

    def expire(self, now: float) -> None:
        """Withdraw snapshots older than `stale_after`; forget removed workers."""
        for worker in [w for w in self._told if self.registry.get(w.url) is not w]:
            del self._told[worker]
        for worker in list(self._last_ok):
            if self.registry.get(worker.url) is not worker:
                del self._last_ok[worker]
            elif now - self._last_ok[worker] > self.config.stale_after and worker.stats:
                self.registry.set_stats(worker, None)

    def _tick(self) -> None:
        """Start a scrape of each idle worker, without waiting for slow ones; expire."""
        for worker in self.registry:
            if worker not in self._busy:
                task = asyncio.create_task(self._guarded(worker))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self.expire(time.monotonic())

    async def start(self) -> None:
        self._tick()
        self._ticks.start()

    async def stop(self) -> None:
        await self._ticks.stop()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

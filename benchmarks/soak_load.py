"""The soak's clients: what they send, how each request ends, and what they count.

benchmarks/soak.py runs them against a gateway; its docstring defines the outcomes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import orjson

MODEL = "m"
OUTCOMES = ("completed", "left", "clean_error", "lost", "hung")


@dataclass
class SoakConfig:
    streams: int = 2000  # requests in flight at once
    duration: float = 60.0  # seconds of load (after the warm-up)
    warmup: float = 5.0  # seconds of the same load before the baseline is taken
    workers: int = 2
    tpot_ms: float = 500.0  # the fake workers' time per token
    ttft_ms: float = 200.0
    min_tokens: int = 4
    max_tokens: int = 24
    unary_fraction: float = 0.1  # requests that are not streamed
    disconnect_fraction: float = 0.1  # requests whose client leaves mid-answer
    restart_at: float = 0.4  # when worker 0 is killed, as a fraction of `duration`
    restart_down: float = 3.0  # seconds worker 0 stays dead
    settle_timeout: float = 20.0  # seconds for counters and connections to come back
    rss_slack: float = 0.25  # allowed RSS growth over the warm baseline (fraction)
    seed: int = 1
    log_dir: str = ""  # where the processes' logs go (default: a temporary directory)
    access_log: bool = False  # the gateway writes one line per request into its log


@dataclass
class Report:
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # clean_error and lost, by kind
    started: int = 0
    events: int = 0  # SSE events the clients received
    retries: float = 0.0  # the gateway's vllm_gateway_retries_total
    peak_streams: int = 0
    rss_start: int = 0  # bytes, at rest after the warm-up
    rss_peak: int = 0
    rss_timeline: list[tuple[float, int]] = field(default_factory=list)  # (s into the run, bytes)
    rss_every: float = 6.0  # seconds between two timeline samples
    rss_end: int = 0
    fds_start: int = 0
    fds_end: int = 0
    upstream_start: int = 0  # the gateway's connections to workers, at rest
    upstream_end: int = 0
    clients_end: int = 0  # the gateway's client connections after the load
    inflight_end: int = 0  # sum of the workers' in-flight counts at the gateway
    worker_running_end: int = 0  # sum of the workers' running + waiting
    worker_stats: list[dict] = field(default_factory=list)
    load_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    # The first few lost or hung requests: (request id, what the client saw).
    failures: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# --- the load ------------------------------------------------------------------------------


class Load:
    """Closed-loop load: `streams` requests at once, each replaced when it ends."""

    def __init__(self, cfg: SoakConfig, url: str, report: Report, rng: random.Random) -> None:
        self.cfg = cfg
        self.url = url + "/v1/completions"
        self.report = report
        self.rng = rng
        self.active = 0
        self.serial = 0

    def deadline(self, tokens: int) -> float:
        """How long a request may take before it counts as hung: generous, for a loaded box."""
        cfg = self.cfg
        return 3 * (cfg.ttft_ms + tokens * cfg.tpot_ms) / 1000 + 30

    async def run(self, session: aiohttp.ClientSession, seconds: float, count: bool) -> None:
        end = time.monotonic() + seconds

        async def slot() -> None:
            while time.monotonic() < end:
                await self.one(session, count)

        await asyncio.gather(*(slot() for _ in range(self.cfg.streams)))

    async def one(self, session: aiohttp.ClientSession, count: bool) -> None:
        cfg, rng = self.cfg, self.rng
        tokens = rng.randint(cfg.min_tokens, cfg.max_tokens)
        stream = rng.random() >= cfg.unary_fraction
        leave = rng.random() < cfg.disconnect_fraction
        leave_after = rng.randint(1, tokens - 1) if leave else None
        # Each request its own prompt, as different users' are: identical prompts would be
        # one conversation to cache_aware, kept on its home (the soak is about the relay).
        prompt = f"soak {self.serial}"
        body = orjson.dumps(
            {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": stream}
        )
        self.serial += 1
        rid = f"soak-{cfg.seed}-{self.serial}"
        headers = {**JSON, "X-Request-Id": rid}
        started = time.monotonic()
        self.active += 1
        self.report.peak_streams = max(self.report.peak_streams, self.active)
        if count:
            self.report.started += 1
        try:
            async with asyncio.timeout(self.deadline(tokens)):
                if stream:
                    outcome, kind = await self.streamed(session, body, headers, tokens, leave_after)
                elif leave:
                    delay = rng.uniform(0, (cfg.ttft_ms + tokens * cfg.tpot_ms) / 1000)
                    try:
                        async with asyncio.timeout(delay):
                            outcome, kind = await self.unary(session, body, headers, tokens)
                    except TimeoutError:
                        outcome, kind = "left", ""
                else:
                    outcome, kind = await self.unary(session, body, headers, tokens)
        except TimeoutError:
            outcome, kind = "hung", "no end within the deadline"
        except (aiohttp.ClientError, ConnectionError) as e:
            outcome, kind = "lost", type(e).__name__
        finally:
            self.active -= 1
        if count:
            self.report.outcomes[outcome] += 1
            if kind:
                self.report.errors[f"{outcome}: {kind}"] += 1
            if outcome in ("lost", "hung") and len(self.report.failures) < 20:
                what = f"{kind}; stream={stream} tokens={tokens}"
                what += f" after {time.monotonic() - started:.1f} s"
                self.report.failures.append((rid, what))

    async def unary(self, session: aiohttp.ClientSession, body: bytes, headers: dict, tokens: int):
        async with session.post(self.url, data=body, headers=headers) as r:
            data = await r.read()
            if r.status != 200:
                return error_answer(r.status, data)
        text = orjson.loads(data)["choices"][0]["text"]
        if text == "".join(f" w{i}" for i in range(tokens)):
            return "completed", ""
        return "lost", "wrong answer"

    async def streamed(
        self, session, body: bytes, headers: dict, tokens: int, leave_after: int | None
    ):
        async with session.post(self.url, data=body, headers=headers) as r:
            if r.status != 200:
                return error_answer(r.status, await r.read())
            seen = 0
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].rstrip()
                if data == b"[DONE]":
                    if seen == tokens:
                        return "completed", ""
                    return "lost", f"[DONE] after {seen} of {tokens} tokens"
                doc = orjson.loads(data)
                if "error" in doc:
                    return "clean_error", "SSE error event"
                if doc["choices"][0]["text"] != f" w{seen}":
                    return "lost", "wrong token"
                seen += 1
                self.report.events += 1
                if leave_after is not None and seen >= leave_after:
                    r.close()  # the client goes away mid-stream
                    return "left", ""
            return "lost", "stream ended without [DONE] or an error event"


JSON = {"Content-Type": "application/json"}


def error_answer(status: int, data: bytes) -> tuple[str, str]:
    """An HTTP error answer: clean when it has an OpenAI error body. A 504 is a request the
    gateway had to give up on (the fake workers never stall): it counts as hung."""
    if status == 504:
        return "hung", "504 from the gateway: no answer within timeouts.first_byte"
    with contextlib.suppress(ValueError):
        doc = orjson.loads(data)
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            return "clean_error", f"{status} {doc['error'].get('code')}"
    return "lost", f"{status} without an OpenAI error body"

"""Plays a workload against one system: conversations of streamed chat turns, timed.

Each conversation starts at its scheduled time; each turn goes out after the previous
answer plus its think time, with the system prompt, the whole history (the answers as
they came back) and the new user message. Requests alternate between the system's
entry URLs (one per replica), as an L4 balancer in front of them would.

With `api="completions"` each turn is a `/v1/completions` request instead: the same
messages rendered as one prompt string by a plain template (`role: content` lines, then
`assistant:`), as a client that applies its own chat template sends them (vLLM's
`benchmark_serving`, completion-only model servers). The router and the gateway then see
no message structure: which part is the system prompt, which the conversation, is theirs
to find.

TTFT and end-to-end time count from the moment a turn was due, so a late client,
gateway or router counts against the system. A turn that is not answered in full
(status, no [DONE], no content, connection error, or not done within `drain` seconds
of the last arrival) is an error; its conversation goes on with an empty answer.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

from benchmarks.workload import MODEL, Conversation, Turn

_CONTENT = re.compile(rb'"(?:content|text)":"((?:[^"\\]|\\.)*)"')
_FIRST = re.compile(rb'"(?:content|text)":"[^"]')  # a token, not the role event's empty content
APIS = ("chat", "completions")


def render(messages: list[dict]) -> str:
    """The completion prompt of chat `messages`: a line per message, then the answer's cue."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@dataclass
class Sample:
    """One measured turn."""

    due: float  # loop time the turn was to be sent
    first: float | None = None  # first content token
    done: float | None = None  # [DONE] read
    ok: bool = False


@dataclass
class Played:
    """What a workload gave on one system: the measured turns."""

    samples: list[Sample] = field(default_factory=list)

    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]


class Player:
    """Sends conversations to `urls` (in turn) over one client session."""

    def __init__(self, session: aiohttp.ClientSession, urls: list[str], api: str = "chat") -> None:
        self.session = session
        self.api = api
        path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
        self._urls = itertools.cycle([u + path for u in urls])

    async def turn(
        self, conv: Conversation, history: list[dict], turn: Turn, sample: Sample, name: str
    ) -> str:
        """Send one turn of the conversation called `name` in this run, timing it into
        `sample`; the answer's text ("" if it failed)."""
        loop = asyncio.get_running_loop()
        messages = [{"role": "system", "content": conv.system}, *history]
        messages.append({"role": "user", "content": turn.user})
        request = {"model": MODEL, "stream": True, "max_tokens": turn.max_tokens}
        if self.api == "chat":
            request["messages"] = messages
        else:
            request["prompt"] = render(messages)
        body = orjson.dumps(request)
        # The request id names the conversation and the turn, so the gateway's access log
        # and the workers' request logs say where each turn of each conversation went.
        rid = f"{name}-t{len(history) // 2}"
        headers = {"Content-Type": "application/json", "X-Session-ID": conv.session,
                   "X-Request-Id": rid}  # fmt: skip
        chunks: list[bytes] = []
        try:
            async with self.session.post(next(self._urls), data=body, headers=headers) as r:
                if r.status != 200:
                    await r.read()
                    return ""
                async for chunk in r.content.iter_any():
                    if sample.first is None and _FIRST.search(chunk):
                        sample.first = loop.time()
                    chunks.append(chunk)
        except (aiohttp.ClientError, TimeoutError):
            return ""
        raw = b"".join(chunks)
        if sample.first is None or b"[DONE]" not in raw[-64:]:
            return ""
        sample.done, sample.ok = loop.time(), True
        answer = b"".join(m.group(1) for m in _CONTENT.finditer(raw))
        return orjson.loads(b'"' + answer + b'"')

    async def conversation(
        self, conv: Conversation, t0: float, measured: bool, out: Played, n: int
    ) -> None:
        """Play `conv`, the run's `n`-th: its turns' request ids are `<session>.<n>-t<turn>`
        (single-turn families reuse a few hundred sessions; `n` makes each id unique)."""
        loop = asyncio.get_running_loop()
        name = f"{conv.session}.{n}"
        history: list[dict] = []
        due = t0 + conv.start
        for turn in conv.turns:
            due += turn.think
            await asyncio.sleep(max(0.0, due - loop.time()))
            sample = Sample(due)
            if measured:  # recorded before it is sent: one cut off by the deadline fails
                out.samples.append(sample)
            answer = await self.turn(conv, history, turn, sample, name)
            history += [{"role": "user", "content": turn.user},
                        {"role": "assistant", "content": answer}]  # fmt: skip
            due = loop.time()


async def play(
    urls: list[str],
    conversations: list[Conversation],
    warmup: float,
    drain: float,
    at_measure: Callable[[], Awaitable[None]],
    api: str = "chat",
) -> Played:
    """Play `conversations`; those starting before `warmup` s are not measured.

    `at_measure()` is awaited when the measured window opens (to snapshot counters).
    """
    loop = asyncio.get_running_loop()
    out = Played()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        player = Player(session, urls, api)
        t0 = loop.time() + 0.2
        tasks = [
            asyncio.create_task(player.conversation(c, t0, c.start >= warmup, out, n))
            for n, c in enumerate(conversations)
        ]
        await asyncio.sleep(max(0.0, t0 + warmup - loop.time()))
        await at_measure()
        last = max((c.start for c in conversations), default=0.0)
        # Every conversation's turns, then `drain` s for stragglers: bounded.
        longest = max((sum(t.think for t in c.turns) for c in conversations), default=0.0)
        budget = t0 + last + longest + drain - loop.time()
        _, pending = await asyncio.wait(tasks, timeout=max(1.0, budget))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return out

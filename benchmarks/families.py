"""The dispatch benchmark's workload families: each a cluster of fake workers and its load.

    hetero     3 workers of unequal batch size (max_num_seqs 16, 8 and 12), the last at
               half speed; Poisson arrivals at --load of the computed capacity; output
               lengths uniform within +-50% of the mean.
    multiturn  4 workers with a prefix cache that holds --cache-share of all the
               conversations' blocks (so not every conversation) and a prefill cost per
               uncached token; 80 conversations of 6 turns over 4 long system prompts,
               each turn's prompt the system prompt + the whole history + a new message,
               with think time between turns.
    burst      3 equal workers; Poisson arrivals at 0.4 x capacity, raised to 2.5 x
               capacity for 1 s of every 6 s.
    longtail   3 equal workers; Poisson arrivals at --load of capacity; log-normal output
               lengths (median 24, sigma 1.2, up to 1024 tokens): a few answers are 20x
               the median and hold their batch slot that long.
    docqa      4 workers with a prefix cache and a prefill cost; single questions about
               one of 24 long documents quoted in the user message (no system prompt
               worth caching), documents chosen by Zipf popularity: the shared prefix is
               in the first user message, not in a system prompt.
    agent      6 workers of mixed speed (4 fast with 16 slots, 2 at half speed with 8),
               each with a prefix cache and a prefill cost; 90 tool-using sessions of
               2-16 turns, 70% of them under one long tool-definition system prompt
               (20% and 10% under two others), each turn a tool output of heavy-tailed
               length (log-normal, up to 600 tokens) after a short think time: prefill
               load that varies by worker, on a fleet that is not uniform.
    docchat    3 workers with a prefix cache and a prefill cost; 60 conversations of 5
               turns, each quoting one of 6 long documents (2000 tokens, Zipf popularity)
               in its first user message, then asking about it: the shared prefix is most
               of every prompt and a large part of a worker's KV cache.
    longchat   6 workers of mixed speed (4 fast, 2 at half speed), each with a prefix
               cache; 110 conversations of 6-16 turns under one short system prompt:
               nothing is shared but each conversation's own long, growing history.
    ragchat    5 workers of mixed speed (3 fast, 2 at half speed), each with a prefix
               cache; 60 conversations of 3-8 turns, each under one of 12 long context
               documents (1200 tokens, Zipf 1.2) sent as its system prompt, think time
               1.5 s: light load, many shared prefixes, caches that hold about three
               documents and their conversations' histories.
    bigbatch   3 workers with large batches (max_num_seqs 64, 32 and 48, the last at half
               speed); short chat at --load of capacity, about 100 requests running at
               once: a fleet far past the few slots the capacity gate assumes at first.
    gpumix     4 workers of two GPU generations: 2 fast with large KV caches, 2 at half
               speed with a third of their cache; 70 conversations under one of 10
               context documents (Zipf 1) as system prompt: each worker's share of the
               documents has to fit its own cache.
    longprompt 4 workers of mixed speed (3 fast, 1 at half speed) with a prefill cost; single
               requests each reading its own long text (log-normal, median 800 tokens, up to
               4000) at --load of capacity: nothing to reuse, prefill-bound, where a long
               prompt holds up every first token queued behind it on its worker.

Every family's rates come from the capacity its workers compute to (workload.py), so a
change of worker speed or batch size changes the load with it. Conversations that start
during --warmup are sent but not measured.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.workload import (
    Conversation,
    TokenDraw,
    Turn,
    WorkerSpec,
    bursts,
    lognormal,
    mean_of,
    poisson,
    single_turns,
    spread,
    system_prompts,
    text,
)

BLOCK_SIZE = 16  # the fake worker's default, as vLLM's


@dataclass(frozen=True)
class Sizes:
    """The knobs every family reads (from the command line)."""

    warmup: float  # seconds of arrivals not measured
    duration: float  # seconds of measured arrivals
    load: float  # hetero, longtail, bigbatch, longprompt: offered load as a fraction of capacity
    cache_share: float  # multiturn: the fleet's KV blocks / all conversations' blocks


@dataclass(frozen=True)
class Family:
    name: str
    workers: tuple[WorkerSpec, ...]
    setup: str  # one line for the report
    build: Callable[[random.Random], list[Conversation]]


def _open_loop(
    name: str, workers: tuple[WorkerSpec, ...], draw: TokenDraw, rate: float, sizes: Sizes
) -> Family:
    systems = system_prompts(8, 24)
    end = sizes.warmup + sizes.duration

    def build(rng: random.Random) -> list[Conversation]:
        return single_turns(rng, poisson(rng, rate, 0.0, end), draw, systems)

    return Family(name, workers, f"{rate:.1f} req/s Poisson", build)


def _capacity(workers: tuple[WorkerSpec, ...], draw: TokenDraw) -> float:
    mean = mean_of(draw)
    return sum(w.capacity(mean) for w in workers)


def hetero(sizes: Sizes) -> Family:
    half = WorkerSpec(ttft_ms=80, tpot_ms=40, max_num_seqs=12)  # half speed
    workers = (WorkerSpec(40, 20, 16), WorkerSpec(40, 20, 8), half)
    draw = spread(48)
    cap = _capacity(workers, draw)
    family = _open_loop("hetero", workers, draw, sizes.load * cap, sizes)
    setup = f"capacity {cap:.1f} req/s, {family.setup} ({sizes.load:g}); max_tokens 24..72"
    return Family("hetero", workers, setup, family.build)


def longtail(sizes: Sizes) -> Family:
    # Small batches, so that a few long answers can fill a worker's slots.
    workers = (WorkerSpec(40, 20, 8),) * 3
    draw = lognormal(median=24, sigma=1.2, low=1, high=1024)
    cap = _capacity(workers, draw)
    family = _open_loop("longtail", workers, draw, sizes.load * cap, sizes)
    setup = (
        f"capacity {cap:.1f} req/s, {family.setup} ({sizes.load:g}); max_tokens log-normal "
        f"(median 24, sigma 1.2, 1..1024, mean {mean_of(draw):.0f})"
    )
    return Family("longtail", workers, setup, family.build)


def burst(sizes: Sizes) -> Family:
    workers = (WorkerSpec(40, 20, 8),) * 3
    draw = spread(32)
    cap = _capacity(workers, draw)
    base, peak, period, length = 0.4 * cap, 2.5 * cap, 6.0, 1.0
    systems = system_prompts(8, 24)
    end = sizes.warmup + sizes.duration

    def build(rng: random.Random) -> list[Conversation]:
        return single_turns(rng, bursts(rng, base, peak, period, length, end), draw, systems)

    setup = (
        f"capacity {cap:.1f} req/s; Poisson {base:.1f} req/s, {peak:.1f} req/s for "
        f"{length:g} s of every {period:g} s; max_tokens 16..48"
    )
    return Family("burst", workers, setup, build)


# multiturn's shape: the issue's ~80 conversations of ~6 turns over 4 long system prompts.
CONVERSATIONS, TURNS, SYSTEMS, SYSTEM_WORDS = 80, 6, 4, 512
USER_WORDS, ANSWER_TOKENS, THINK_MEAN = 32, 24, 0.5
# Prefill per uncached token: a cold last-turn prompt (~850 tokens) then costs about as much
# as its answer's decode (24 x 20 ms), as for long-context chat; a turn whose history is
# cached (the last answer too: the fake caches generated tokens, as vLLM V1 does) prefills
# only its new user message and the last partial block, ~40 tokens (~20 ms).
PREFILL_MS_PER_TOKEN = 0.5


def _turns(rng: random.Random, count: int, user: TokenDraw, answer: TokenDraw, think: float,
           tag: str, opening: str = "") -> tuple[Turn, ...]:  # fmt: skip
    """A conversation's `count` turns: user messages of `user` words tagged `tag` (the
    first after `opening`), answers of `answer` tokens, think time exp. mean `think`."""
    return tuple(
        Turn((opening if t == 0 else "") + text(rng, user(rng), f"{tag}t{t}-"), answer(rng),
             rng.expovariate(1 / think) if t else 0.0)
        for t in range(count)
    )  # fmt: skip


def _started(
    count: int, end: float, make: Callable[[random.Random, int, float], Conversation]
) -> Callable[[random.Random], list[Conversation]]:
    """A family's `build`: `count` conversations starting at random over [0, end), in
    order of start; `make(rng, i, start)` draws the i-th one's content, after all the start
    times (the order of draws the families were measured with)."""

    def build(rng: random.Random) -> list[Conversation]:
        starts = sorted(rng.uniform(0.0, end) for _ in range(count))
        return [make(rng, i, start) for i, start in enumerate(starts)]

    return build


def _alike(
    sizes: Sizes, every: int, count: int, prefill_ms: float
) -> tuple[int, tuple[WorkerSpec, ...]]:
    """`count` alike workers (ttft and tpot 20 ms, 16 seqs, `prefill_ms` per uncached
    token) whose prefix caches together hold --cache-share of `every` blocks."""
    blocks = math.ceil(sizes.cache_share * every / count)
    return blocks, (WorkerSpec(20, 20, 16, blocks, prefill_ms),) * count


def _mixed(blocks: int, prefill_ms: float, fast: int, slow: int) -> tuple[WorkerSpec, ...]:
    """`fast` workers as `_alike`'s and `slow` at half their speed (ttft and tpot 40 ms, 8
    seqs, twice the prefill per token), each with `blocks` KV blocks."""
    return (WorkerSpec(20, 20, 16, blocks, prefill_ms),) * fast + (
        WorkerSpec(40, 40, 8, blocks, 2 * prefill_ms),
    ) * slow


def _mixed_share(
    sizes: Sizes, every: int, prefill_ms: float, fast: int, slow: int
) -> tuple[int, tuple[WorkerSpec, ...]]:
    """`_mixed` workers whose prefix caches together hold --cache-share of `every` blocks."""
    blocks = math.ceil(sizes.cache_share * every / (fast + slow))
    return blocks, _mixed(blocks, prefill_ms, fast, slow)


def multiturn(sizes: Sizes) -> Family:
    systems = system_prompts(SYSTEMS, SYSTEM_WORDS)
    # Blocks to hold every conversation's last prompt, the system prompts once each.
    history = TURNS * (USER_WORDS + ANSWER_TOKENS)
    every = CONVERSATIONS * math.ceil(history / BLOCK_SIZE)
    every += SYSTEMS * math.ceil(SYSTEM_WORDS / BLOCK_SIZE)
    count = 4
    blocks, workers = _alike(sizes, every, count, PREFILL_MS_PER_TOKEN)
    user, answer = spread(USER_WORDS), spread(ANSWER_TOKENS)
    end = sizes.warmup + sizes.duration

    def one(rng: random.Random, i: int, start: float) -> Conversation:
        turns = _turns(rng, TURNS, user, answer, THINK_MEAN, f"c{i}")
        return Conversation(start, rng.choice(systems), f"conv{i}", turns)

    build = _started(CONVERSATIONS, end, one)

    setup = (
        f"{CONVERSATIONS} conversations x {TURNS} turns starting over {end:g} s, "
        f"{SYSTEMS} system prompts of {SYSTEM_WORDS} tokens, user messages "
        f"{USER_WORDS} +-50%, answers {ANSWER_TOKENS} +-50% tokens, think time exp. mean "
        f"{THINK_MEAN:g} s; KV cache {blocks} blocks per worker = {sizes.cache_share:g} of "
        f"all conversations' {every} / {count}"
    )
    return Family("multiturn", workers, setup, build)


# docqa's shape: documents quoted at the start of the user message (RAG, "summarize this",
# few-shot examples in the prompt, models without a system role).
DOCS, DOC_WORDS, QUESTION_WORDS, DOC_ANSWER_TOKENS, ZIPF = 24, 600, 24, 32, 1.0
DOC_PREFILL_MS_PER_TOKEN = 0.1  # a cold document costs ~60 ms, a cached one ~3 ms


def docqa(sizes: Sizes) -> Family:
    rng0 = random.Random(11)
    docs = [f"Document {i}:\n" + text(rng0, DOC_WORDS, f"d{i}-") for i in range(DOCS)]
    weights = [1 / (i + 1) ** ZIPF for i in range(DOCS)]
    every = DOCS * math.ceil(DOC_WORDS / BLOCK_SIZE)
    count = 4
    blocks, workers = _alike(sizes, every, count, DOC_PREFILL_MS_PER_TOKEN)
    draw = spread(DOC_ANSWER_TOKENS)
    rate = sizes.load * _capacity(workers, draw) * 0.7  # prefill eats the rest
    end = sizes.warmup + sizes.duration

    def build(rng: random.Random) -> list[Conversation]:
        out = []
        for i, at in enumerate(poisson(rng, rate, 0.0, end)):
            doc = rng.choices(docs, weights)[0]
            user = doc + "\n\nQuestion: " + text(rng, QUESTION_WORDS, f"q{i}-")
            turn = Turn(user, draw(rng), 0.0)
            out.append(Conversation(at, "You are a helpful assistant.", f"s{i}", (turn,)))
        return out

    setup = (
        f"{rate:.1f} req/s Poisson; {DOCS} documents of {DOC_WORDS} tokens, Zipf {ZIPF:g}, "
        f"each request one document + a {QUESTION_WORDS}-token question in one user message; "
        f"max_tokens {DOC_ANSWER_TOKENS} +-50%; KV cache {blocks} blocks per worker = "
        f"{sizes.cache_share:g} of all documents' {every} / {count}"
    )
    return Family("docqa", workers, setup, build)


# agent's shape: tool-using sessions. Most sessions share one long system prompt (the tool
# definitions), sessions run many short turns whose user messages are tool outputs of
# heavy-tailed length, on a fleet of mixed speed where every worker caches.
AGENT_SESSIONS, AGENT_TOOL_WORDS, AGENT_THINK = 90, 1024, 0.2
AGENT_PREFILL_MS_PER_TOKEN = 0.3


def agent(sizes: Sizes) -> Family:
    systems = system_prompts(3, AGENT_TOOL_WORDS)
    popularity = [0.7, 0.2, 0.1]  # one agent's tool set dominates
    turns = lambda rng: min(16, 2 + int(rng.expovariate(1 / 5)))  # noqa: E731
    tool = lognormal(median=40, sigma=1.0, low=4, high=600)
    answer = lognormal(median=24, sigma=0.7, low=4, high=200)
    mean_turns = mean_of(turns)
    history = mean_turns * (mean_of(tool) + mean_of(answer))
    every = AGENT_SESSIONS * math.ceil(history / BLOCK_SIZE)
    every += len(systems) * math.ceil(AGENT_TOOL_WORDS / BLOCK_SIZE)
    fast, slow = 4, 2
    blocks, workers = _mixed_share(sizes, every, AGENT_PREFILL_MS_PER_TOKEN, fast, slow)
    end = sizes.warmup + sizes.duration

    def one(rng: random.Random, i: int, start: float) -> Conversation:
        system = rng.choices(systems, popularity)[0]
        steps = _turns(rng, turns(rng), tool, answer, AGENT_THINK, f"a{i}")
        return Conversation(start, system, f"agent{i}", steps)

    build = _started(AGENT_SESSIONS, end, one)

    setup = (
        f"{AGENT_SESSIONS} sessions of 2-16 turns (mean {mean_turns:.1f}) starting over "
        f"{end:g} s; 3 tool-definition system prompts of {AGENT_TOOL_WORDS} tokens used "
        f"70/20/10%; tool outputs log-normal (median 40 tokens, 4..600), answers log-normal "
        f"(median 24, 4..200), think time exp. mean {AGENT_THINK:g} s; KV cache {blocks} "
        f"blocks per worker = {sizes.cache_share:g} of all sessions' {every} / {fast + slow}"
    )
    return Family("agent", workers, setup, build)


# docchat's shape: conversations about a long document (a contract, a paper, a codebase
# file) quoted in the first user message, then questions about it: the shared prefix is
# inside the conversation's key, most of each prompt, and a document takes a large part
# of a worker's KV cache, so a document copied to one worker too many evicts others.
CHAT_DOCS, CHAT_DOC_WORDS, CHAT_DOC_ZIPF, CHAT_CONVERSATIONS, CHAT_TURNS = 6, 2000, 0.8, 60, 5
CHAT_USER_WORDS, CHAT_ANSWER_TOKENS, CHAT_THINK = 24, 32, 0.67
CHAT_PREFILL_MS_PER_TOKEN = 0.1  # a cold document ~200 ms


def docchat(sizes: Sizes) -> Family:
    rng0 = random.Random(9)
    docs = [f"Doc {i}:\n" + text(rng0, CHAT_DOC_WORDS, f"D{i}-") for i in range(CHAT_DOCS)]
    weights = [1 / (i + 1) ** CHAT_DOC_ZIPF for i in range(CHAT_DOCS)]
    history = CHAT_TURNS * (CHAT_USER_WORDS + CHAT_ANSWER_TOKENS)
    every = CHAT_DOCS * math.ceil(CHAT_DOC_WORDS / BLOCK_SIZE)
    every += CHAT_CONVERSATIONS * math.ceil(history / BLOCK_SIZE)
    count = 3
    blocks, workers = _alike(sizes, every, count, CHAT_PREFILL_MS_PER_TOKEN)
    user, answer = spread(CHAT_USER_WORDS), spread(CHAT_ANSWER_TOKENS)
    end = sizes.warmup + sizes.duration

    def one(rng: random.Random, i: int, start: float) -> Conversation:
        doc = rng.choices(docs, weights)[0]
        turns = _turns(rng, CHAT_TURNS, user, answer, CHAT_THINK, f"c{i}", doc + "\n\nQ: ")
        return Conversation(start, "You are a helpful assistant.", f"doc{i}", turns)

    build = _started(CHAT_CONVERSATIONS, end, one)

    setup = (
        f"{CHAT_CONVERSATIONS} conversations x {CHAT_TURNS} turns starting over {end:g} s, "
        f"each quoting one of {CHAT_DOCS} documents of {CHAT_DOC_WORDS} tokens (Zipf "
        f"{CHAT_DOC_ZIPF:g}) in its first user message, then questions of {CHAT_USER_WORDS} "
        f"+-50% tokens; answers {CHAT_ANSWER_TOKENS} +-50% tokens, think time exp. mean "
        f"{CHAT_THINK:g} s; KV cache {blocks} blocks per worker = {sizes.cache_share:g} of "
        f"all documents' and conversations' {every} / {count}"
    )
    return Family("docchat", workers, setup, build)


# longchat's shape: the most common chat deployment. A short system prompt (below a
# block: nothing shared across conversations), long conversations whose own history is
# most of every prompt, on a fleet of mixed speed: a turn sent away from its history
# prefills all of it again (up to ~1600 tokens, ~0.5 s on a fast worker).
LONG_CONVERSATIONS, LONG_TURNS, LONG_USER_WORDS, LONG_ANSWER_TOKENS = 110, (6, 16), 60, 40
LONG_THINK, LONG_PREFILL_MS_PER_TOKEN = 0.6, 0.3


def longchat(sizes: Sizes) -> Family:
    low, high = LONG_TURNS
    history = (low + high) / 2 * (LONG_USER_WORDS + LONG_ANSWER_TOKENS)
    every = LONG_CONVERSATIONS * math.ceil(history / BLOCK_SIZE)
    fast, slow = 4, 2
    blocks, workers = _mixed_share(sizes, every, LONG_PREFILL_MS_PER_TOKEN, fast, slow)
    user, answer = spread(LONG_USER_WORDS), spread(LONG_ANSWER_TOKENS)
    end = sizes.warmup + sizes.duration

    def one(rng: random.Random, i: int, start: float) -> Conversation:
        turns = _turns(rng, rng.randint(low, high), user, answer, LONG_THINK, f"L{i}")
        return Conversation(start, "You are a helpful assistant.", f"long{i}", turns)

    build = _started(LONG_CONVERSATIONS, end, one)

    setup = (
        f"{LONG_CONVERSATIONS} conversations of {low}-{high} turns starting over {end:g} s "
        f"under one short system prompt; user messages {LONG_USER_WORDS} +-50%, answers "
        f"{LONG_ANSWER_TOKENS} +-50% tokens, think time exp. mean {LONG_THINK:g} s; KV cache "
        f"{blocks} blocks per worker = {sizes.cache_share:g} of all conversations' {every} / "
        f"{fast + slow}"
    )
    return Family("longchat", workers, setup, build)


# ragchat's shape: retrieval-grounded or product assistants, each conversation under one of
# many long context documents sent as the system prompt, a few far more used than the
# rest, on a mixed fleet lightly loaded: the caches, not the batches, are what binds (a
# worker holds about three documents and their conversations' histories), so where each
# document's conversations go decides the reuse.
RAG_DOCS, RAG_DOC_WORDS, RAG_ZIPF, RAG_CONVERSATIONS, RAG_TURNS = 12, 1200, 1.2, 60, (3, 8)
RAG_USER_WORDS, RAG_ANSWER_TOKENS, RAG_THINK, RAG_PREFILL_MS_PER_TOKEN = 30, 40, 1.5, 0.2


@dataclass(frozen=True)
class _Documents:
    """Conversations each under one of `count` context documents of `words` tokens, chosen
    by Zipf popularity (`zipf`), sent as the system prompt (ragchat, gpumix)."""

    title: str  # each document starts "<title> <k>:", then words "<mark><k>-<n>"
    mark: str
    seed: int  # of the documents' text
    count: int
    words: int
    zipf: float
    conversations: int
    turns: tuple[int, int]
    user_words: int
    answer_tokens: int
    think: float
    tag: str  # the turns' tag, "<tag><i>"
    session: str  # the sessions' names, "<session><i>d<k>": the name says its document

    def blocks(self) -> int:
        """KV blocks to hold every document and every conversation's history."""
        low, high = self.turns
        history = (low + high) / 2 * (self.user_words + self.answer_tokens)
        every = self.count * math.ceil(self.words / BLOCK_SIZE)
        return every + self.conversations * math.ceil(history / BLOCK_SIZE)

    def build(self, sizes: Sizes) -> Callable[[random.Random], list[Conversation]]:
        rng0 = random.Random(self.seed)
        docs = [
            f"{self.title} {i}:\n" + text(rng0, self.words, f"{self.mark}{i}-")
            for i in range(self.count)
        ]
        weights = [1 / (i + 1) ** self.zipf for i in range(self.count)]
        user, answer = spread(self.user_words), spread(self.answer_tokens)

        def one(rng: random.Random, i: int, start: float) -> Conversation:
            k = rng.choices(range(self.count), weights)[0]
            turns = _turns(
                rng, rng.randint(*self.turns), user, answer, self.think, f"{self.tag}{i}"
            )
            return Conversation(start, docs[k], f"{self.session}{i}d{k}", turns)

        return _started(self.conversations, sizes.warmup + sizes.duration, one)

    def setup(self, sizes: Sizes) -> str:
        low, high = self.turns
        return (
            f"{self.conversations} conversations of {low}-{high} turns starting over "
            f"{sizes.warmup + sizes.duration:g} s, each under one of {self.count} context "
            f"documents of {self.words} tokens (Zipf {self.zipf:g}) as its system prompt; user "
            f"messages {self.user_words} +-50%, answers {self.answer_tokens} +-50% tokens, think "
            f"time exp. mean {self.think:g} s; KV cache "
        )


RAG = _Documents(
    "Context", "R", 5, RAG_DOCS, RAG_DOC_WORDS, RAG_ZIPF, RAG_CONVERSATIONS, RAG_TURNS,
    RAG_USER_WORDS, RAG_ANSWER_TOKENS, RAG_THINK, "G", "rag",
)  # fmt: skip


def ragchat(sizes: Sizes) -> Family:
    every = RAG.blocks()
    fast, slow = 3, 2
    blocks, workers = _mixed_share(sizes, every, RAG_PREFILL_MS_PER_TOKEN, fast, slow)
    setup = RAG.setup(sizes) + (
        f"{blocks} blocks per worker = {sizes.cache_share:g} of all documents' and "
        f"conversations' {every} / {fast + slow}"
    )
    return Family("ragchat", workers, setup, RAG.build(sizes))


# gpumix's shape: a fleet of two GPU generations, as fleets grow: two large, fast workers
# and two small, slow ones with a third of their KV cache (an H100 beside an L4 holds
# several times the blocks). Conversations under context documents sent as system
# prompts, lightly loaded: where each document lives has to fit each worker's cache.
MIX_DOCS, MIX_DOC_WORDS, MIX_ZIPF, MIX_CONVERSATIONS, MIX_TURNS = 10, 1000, 1.0, 70, (3, 8)
MIX_USER_WORDS, MIX_ANSWER_TOKENS, MIX_THINK, MIX_PREFILL_MS_PER_TOKEN = 30, 40, 1.2, 0.2
MIX_BIG = 3  # a large worker's KV blocks per small worker's


MIX = _Documents(
    "Manual", "M", 11, MIX_DOCS, MIX_DOC_WORDS, MIX_ZIPF, MIX_CONVERSATIONS, MIX_TURNS,
    MIX_USER_WORDS, MIX_ANSWER_TOKENS, MIX_THINK, "X", "mix",
)  # fmt: skip


def gpumix(sizes: Sizes) -> Family:
    every = MIX.blocks()
    small = math.ceil(sizes.cache_share * every / (2 * MIX_BIG + 2))
    big = MIX_BIG * small
    workers = (WorkerSpec(20, 20, 16, big, MIX_PREFILL_MS_PER_TOKEN),) * 2 + (
        WorkerSpec(40, 40, 8, small, 2 * MIX_PREFILL_MS_PER_TOKEN),
    ) * 2
    setup = MIX.setup(sizes) + (
        f"{big} blocks on each fast worker, {small} on each slow one: together "
        f"{sizes.cache_share:g} of all documents' and conversations' {every}"
    )
    return Family("gpumix", workers, setup, MIX.build(sizes))


# bigbatch's shape: vLLM's batches as GPUs run them (hundreds of sequences; here 32-64, as
# many as a 2-core machine streams), one worker at half speed, short chat at --load.
BIG_SEQS, BIG_TOKENS = (64, 32, 48), 24


def bigbatch(sizes: Sizes) -> Family:
    # Each step 50 ms (100 ms on the slow one): at 70% of capacity about 100 requests run
    # at once, about 70% of the fleet's 144 slots, several times the 8 the gate assumes
    # of a worker it knows nothing of (buckets.py PROBE_START) until it has seen it run more.
    fast, mid, slow = BIG_SEQS
    workers = (WorkerSpec(50, 50, fast), WorkerSpec(50, 50, mid), WorkerSpec(100, 100, slow))
    draw = spread(BIG_TOKENS)
    cap = _capacity(workers, draw)
    family = _open_loop("bigbatch", workers, draw, sizes.load * cap, sizes)
    low, high = BIG_TOKENS // 2, BIG_TOKENS * 3 // 2
    setup = f"capacity {cap:.1f} req/s, {family.setup} ({sizes.load:g}); max_tokens {low}..{high}"
    return Family("bigbatch", workers, setup, family.build)


# longprompt's shape: each request its own long text to read (summarize, extract, classify
# a user's upload), log-normal length; nothing is shared, and the prefill is most of the work.
LONG_MEDIAN, LONG_SIGMA, LONG_RANGE, LONG_ANSWER = 800, 0.8, (50, 4000), 32
LONG_PREFILL_MS_PER_TOKEN = 0.05  # a median prompt 40 ms on a fast worker, the longest 200 ms


def longprompt(sizes: Sizes) -> Family:
    fast = WorkerSpec(20, 20, 16, None, LONG_PREFILL_MS_PER_TOKEN)
    slow = WorkerSpec(40, 40, 8, None, 2 * LONG_PREFILL_MS_PER_TOKEN)
    workers = (fast,) * 3 + (slow,)
    length = lognormal(LONG_MEDIAN, LONG_SIGMA, *LONG_RANGE)
    draw = spread(LONG_ANSWER)
    prompt, answer = mean_of(length), mean_of(draw)
    # A worker prefills one prompt at a time (its prefill lane) while it decodes a batch:
    # it completes the fewer of the two rates.
    cap = sum(min(1000 / (prompt * w.prefill_ms_per_token), w.capacity(answer)) for w in workers)
    rate = sizes.load * cap
    systems = system_prompts(2, 24)
    end = sizes.warmup + sizes.duration

    def build(rng: random.Random) -> list[Conversation]:
        out = []
        for i, at in enumerate(poisson(rng, rate, 0.0, end)):
            turn = Turn(f"Summarize text {i}: " + text(rng, length(rng), f"u{i}-"), draw(rng), 0.0)
            out.append(Conversation(at, rng.choice(systems), f"u{i}", (turn,)))
        return out

    low, high = LONG_RANGE
    setup = (
        f"capacity {cap:.1f} req/s, {rate:.1f} req/s Poisson ({sizes.load:g}); prompts each "
        f"its own text, log-normal (median {LONG_MEDIAN}, sigma {LONG_SIGMA:g}, {low}..{high}, "
        f"mean {prompt:.0f} tokens); max_tokens {LONG_ANSWER} +-50%"
    )
    return Family("longprompt", workers, setup, build)


FAMILIES: dict[str, Callable[[Sizes], Family]] = {
    "hetero": hetero,
    "multiturn": multiturn,
    "burst": burst,
    "longtail": longtail,
    "docqa": docqa,
    "agent": agent,
    "docchat": docchat,
    "longchat": longchat,
    "ragchat": ragchat,
    "bigbatch": bigbatch,
    "longprompt": longprompt,
    "gpumix": gpumix,
}

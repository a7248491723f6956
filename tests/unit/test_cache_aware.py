"""cache_aware: prefix hashes, the prefix index, and the choice, table by table (pure)."""

from __future__ import annotations

import math
import random
import zlib
from collections import Counter

import orjson
import pytest

from vllm_gateway.config.gateway import DispatchConfig
from vllm_gateway.dispatch.policies import make_policy
from vllm_gateway.dispatch.policies.cache_aware import PLACED, CacheAware
from vllm_gateway.dispatch.prefix_hash import BLOCK_BYTES, KEY_BYTES, prefix_blocks
from vllm_gateway.dispatch.prefix_index import DEFAULT_CAPACITY, PrefixIndex, capacity_of
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.workers import EngineStats, Worker

SYSTEM = "You are a helpful assistant. " * 40  # ~1.2 KB, shared by many conversations


def chat(*turns: str, system: str = SYSTEM) -> dict:
    """A chat body: the system prompt, then user/assistant turns alternating."""
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages}


def no_system(*turns: str) -> dict:
    """A chat body without a system prompt: user/assistant turns alternating."""
    roles = ("user", "assistant")
    return {"model": "m", "messages": [
        {"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}  # fmt: skip


def info(doc: dict) -> RequestInfo:
    return RequestInfo("/v1/chat/completions", b"", "m", True, "r", {}, doc)


def workers(n: int) -> list[Worker]:
    return [Worker(f"http://10.0.0.{i}:8000", models=("m",)) for i in range(n)]


def long(tag: str, n: int = 700) -> str:
    return (tag + " ") * (n // (len(tag) + 1))


# --- prefix hashes ------------------------------------------------------------------------


def test_a_conversations_next_turn_repeats_every_hash_of_the_turn_before():
    t1 = prefix_blocks(chat("hello " * 100, long("answer", 3000), long("question", 3000)))
    t2 = prefix_blocks(
        chat("hello " * 100, long("answer", 3000), long("question", 3000), long("b", 3000), "q")
    )
    assert t1 is not None and t2 is not None
    assert t1.key == t2.key and t1.first == t2.first
    assert len(t2.blocks) > len(t1.blocks) >= 2
    assert t2.blocks[: len(t1.blocks)] == t1.blocks


@pytest.mark.parametrize(
    ("a", "b", "same_key"),
    [
        (chat("hi"), chat("hi", "hello!", "more"), True),  # turns of one conversation
        (chat("hi"), chat("bye"), False),  # same system prompt, another conversation
        (chat("hi"), chat("hi", system="other"), False),  # another system prompt
        ({"prompt": "x" * 5000}, {"prompt": "x" * 5000 + "y"}, True),  # first KEY_BYTES
        ({"prompt": "a" * 100}, {"prompt": ["a" * 100, "b"]}, True),  # list: its first
    ],
)
def test_the_key_is_a_conversations_stable_start(a, b, same_key):
    ka, kb = prefix_blocks(a), prefix_blocks(b)
    assert ka is not None and kb is not None
    assert (ka.key == kb.key) is same_key


@pytest.mark.parametrize(
    ("doc", "continued"),
    [
        (chat("first"), False),
        (chat("first", "answer", "next"), True),
        (chat("first", "answer"), True),  # an answer to continue: its history was sent
        ({"messages": [{"role": "system", "content": "only a system prompt"}]}, False),
        ({"prompt": "a completion prompt " * 100}, False),
    ],
)
def test_a_later_turn_is_told_from_a_first(doc, continued):
    blocks = prefix_blocks(doc)
    assert blocks is not None and blocks.continued is continued


def test_the_key_hash_is_the_same_in_every_process():
    """CRC-32 of the key, not Python's salted hash() of text; a block inside the key is
    named by the CRC-32 of its whole prefix, tagged with its length in blocks."""
    data = b"z" * (KEY_BYTES + 3 * BLOCK_BYTES)
    p = prefix_blocks({"prompt": data.decode()})
    # A completion prompt's key is its first KiB: no block ends inside it, before its end.
    assert p is not None and p.first == 0
    assert p.key == zlib.crc32(data[:KEY_BYTES]) and p.blocks[0] == p.key
    assert len(p.blocks) == 4 and len(set(p.blocks)) == 4  # and 3 blocks after the key
    long_key = {"messages": [{"role": "user", "content": "x" * 5000}]}
    q = prefix_blocks(long_key)
    assert q is not None and q.first == 4  # blocks of 1..4 KiB, all before the key's end
    assert q.blocks[0] == zlib.crc32(orjson.dumps(long_key["messages"])[:BLOCK_BYTES]) | 1 << 32


# 3043: without a system prompt, the key (the first user message) ends on a block boundary.
@pytest.mark.parametrize("system", ["", "s" * 900, "s" * 3000, "s" * 40_000])
@pytest.mark.parametrize("user", [10, 1500, 3043, 5000, 40_000])
def test_names_inside_the_key_are_crcs_of_prefixes_wherever_the_cuts_fall(system, user):
    """Preamble, blocks inside the key and key in one chained CRC pass: each as if
    computed from scratch, and the same in every process; the blocks inside the key named
    are those a block or more past the preamble (up to 32 KiB deep), and after the key one
    name per block (up to 32 more)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": "u" * user}, {"role": "assistant", "content": "a"}]
    messages += [{"role": "user", "content": "v" * 3000}]
    p = prefix_blocks({"messages": messages})
    assert p is not None and p.continued
    data = orjson.dumps(messages)
    key_end = len(orjson.dumps(messages[:-2])) - 1  # through the first user message
    assert p.key == zlib.crc32(data[:key_end]) == p.blocks[p.first]
    preamble_end = len(orjson.dumps(messages[:1])) - 1 if system else 0
    if preamble_end >= BLOCK_BYTES:
        assert p.preamble == zlib.crc32(data[:preamble_end])
    else:
        assert p.preamble == 0
    # Named inside the key: the blocks ending a block or more past the preamble and before
    # the key's end (one ending at it would be the key), up to 32 KiB deep.
    depths = [d for d in range(1, 33) if preamble_end + BLOCK_BYTES <= d * BLOCK_BYTES < key_end]
    assert p.blocks[: p.first] == [zlib.crc32(data[: d * BLOCK_BYTES]) | d << 32 for d in depths]
    after = min(len(data) // BLOCK_BYTES, key_end // BLOCK_BYTES + 32) - key_end // BLOCK_BYTES
    assert len(p.blocks) == p.first + 1 + after
    # After the key: the CRC chained on from the key's over each block (the one holding the
    # key's end read from its start), tagged with where the block ends, in blocks.
    start = key_end // BLOCK_BYTES
    names = [
        zlib.crc32(data[start * BLOCK_BYTES : (start + i) * BLOCK_BYTES], p.key) | start + i << 32
        for i in range(1, after + 1)
    ]
    assert p.blocks[p.first + 1 :] == names


@pytest.mark.parametrize(
    "doc",
    [{"prompt": [1, 2, 3]}, {"messages": []}, {"messages": "hi"}, {}],
)
def test_no_text_no_hashes(doc):
    assert prefix_blocks(doc) is None


def test_multipart_content_is_hashed_too():
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "u"}}]
    a = prefix_blocks({"messages": [{"role": "user", "content": parts}]})
    b = prefix_blocks({"messages": [{"role": "user", "content": parts[:1]}]})
    assert a is not None and b is not None and a.key != b.key


# --- the prefix index ---------------------------------------------------------------------


def test_the_index_finds_the_deepest_holder_among_the_candidates():
    a, b, c = workers(3)
    index = PrefixIndex()
    t1 = prefix_blocks(chat("q1 " * 200, long("a1")))
    t2 = prefix_blocks(chat("q1 " * 200, long("a1"), long("q2"), long("a2"), "q3"))
    assert t1 is not None and t2 is not None
    index.record(a, t1)
    index.record(b, t2)
    assert index.deepest(t2.blocks, [a, b, c]) == ([b], len(t2.blocks))
    assert index.deepest(t2.blocks, [a, c]) == ([a], len(t1.blocks))  # b full: the next best
    assert index.deepest(t2.blocks, [c]) == ([], 0)
    assert t1.preamble == t2.preamble != 0  # the same system prompt


def test_the_index_is_bounded_like_the_workers_cache_and_forgets_removed_workers():
    (a,) = workers(1)
    assert capacity_of(a) == DEFAULT_CAPACITY  # never scraped
    # 2048 tokens, counted at up to 16 bytes each: 32 KiB of text, 32 blocks.
    a.stats = EngineStats(0, 0, None, 0.0, cache_tokens=2048)
    index = PrefixIndex()
    for i in range(20):
        p = prefix_blocks({"prompt": f"{i} " + "y" * (KEY_BYTES + 2 * BLOCK_BYTES)})
        assert p is not None
        index.record(a, p)
    assert index.blocks_of(a) == capacity_of(a) == 32
    index.forget_missing(set())
    assert index.blocks_of(a) == 0 and len(index) == 0


# --- the choice ---------------------------------------------------------------------------


def policy() -> CacheAware:
    p = make_policy("cache_aware", random.Random(1), DispatchConfig())
    assert isinstance(p, CacheAware)
    return p


def test_cache_aware_is_the_default_policy():
    from vllm_gateway.config.gateway import GatewayConfig

    assert GatewayConfig().policy == "cache_aware"


def test_every_turn_of_a_conversation_goes_to_its_home_and_replicas_agree():
    ws = workers(4)
    one, other = policy(), policy()  # two gateways, each seeing every other turn
    for c in range(12):
        turns: list[str] = []
        placed = set()
        for t in range(6):
            turns.append(f"conversation {c} turn {t} " * 30)
            replica = one if t % 2 == 0 else other
            placed.add(replica.select(ws, info(chat(*turns))))
            turns.append(long(f"answer{t}"))
        assert len(placed) == 1, (c, placed)


def test_a_shared_system_prompt_does_not_draw_conversations_together():
    """Conversations sharing the one system prompt spread by their own keys."""
    ws = workers(4)
    p = policy()
    homes = Counter(p.select(ws, info(chat(f"user {i} says hi"))) for i in range(400))
    assert min(homes.values()) >= 60, homes  # ~100 each


def test_a_system_prompt_shorter_than_a_block_is_no_preamble():
    """A short system prompt saves a few milliseconds of prefill: not worth gathering its
    conversations onto few workers, so they spread by their keys like any others."""
    short = "You are assistant 3. Answer briefly and politely."
    assert prefix_blocks(chat("hi", system=short)).preamble == 0
    assert prefix_blocks(chat("hi", system=short * 30)).preamble != 0
    ws = workers(4)
    p = policy()
    homes = Counter(p.select(ws, info(chat(f"user {i} says hi", system=short))) for i in range(400))
    assert min(homes.values()) >= 60, homes  # ~100 each, not one worker's worth


DOCUMENTS = [f"Document {d}: " + " ".join(f"d{d}w{i}" for i in range(500)) for d in range(4)]


def question(doc: int, i: int, system: str = "Be brief.") -> dict:
    """A chat whose first user message quotes document `doc` (~3.5 KB), then asks."""
    return chat(f"{DOCUMENTS[doc]}\n\nQuestion {i}: what does it say?", system=system)


def test_a_document_quoted_in_the_first_user_message_is_shared_like_a_preamble():
    """Questions about one of 4 equally popular documents, the document at the start of
    the user message (no system prompt worth caching): each document's questions go to
    the one worker its share needs, as a system prompt's would; by their keys alone (each
    question its own), every worker would prefill every document."""
    assert prefix_blocks(question(0, 1)).preamble == 0  # no preamble by itself
    ws = workers(4)
    p = policy()
    where: dict[int, Counter] = {d: Counter() for d in range(4)}
    for i in range(800):
        chosen = p.select(ws, info(question(i % 4, i)))
        if i >= 200:
            where[i % 4][chosen] += 1
    assert all(len(on) == 1 for on in where.values()), where
    assert len({w for on in where.values() for w in on}) == 4, where


@pytest.mark.parametrize(("repeat", "gathers"), [(10, False), (60, True)])  # ~0.5, ~3 KB
def test_a_shared_start_of_the_user_message_gathers_only_past_a_block(repeat, gathers):
    """What requests share past the system prompt must be worth a block (~256 tokens) of
    prefill before their placement gives way to it, as for a preamble: 4 instructions
    quoted at the start of the user message, each on a quarter of the requests."""
    ws = workers(4)
    p = policy()
    starts = [f"Instruction {k}: answer from the text below, in one sentence. " * repeat
              for k in range(4)]  # fmt: skip
    where: dict[int, Counter] = {k: Counter() for k in range(4)}
    for i in range(800):
        chosen = p.select(ws, info(chat(f"{starts[i % 4]}\nuser {i}: " + "x" * 300)))
        # After the plan made at 256 requests: the first ones, counted under the system
        # prompt until each instruction was known, made a plan with it among the popular.
        if i >= 300:
            where[i % 4][chosen] += 1
    if gathers:
        assert all(len(on) == 1 for on in where.values()), where
    else:  # by their keys: every instruction on every worker
        assert all(len(on) == 4 for on in where.values()), where


def test_a_shared_document_stays_known_when_the_index_has_forgotten_it():
    """The index, sized like a worker's cache, forgets a document under other traffic;
    its share, counted over the recent requests, keeps it known, so its next questions
    still go where its earlier ones went."""
    ws = workers(4)
    for w in ws:  # 2048 tokens x 16 B: 32 blocks remembered, a document is 3
        w.stats = EngineStats(0, 0, None, 0.0, cache_tokens=2048)
    p = policy()

    def place(start: int, count: int) -> dict[int, set[Worker]]:
        where: dict[int, set[Worker]] = {d: set() for d in range(4)}
        for i in range(start, start + count):
            where[i % 4].add(p.select(ws, info(question(i % 4, i))))
        return where

    place(0, 200)
    before = place(200, 200)
    assert all(len(on) == 1 for on in before.values()), before
    for k in range(40):  # other traffic: 2 blocks of its own each, on every worker
        for w in ws:
            p.index.record(w, prefix_blocks(chat(f"other {k} " + "y" * 1200, system="s")))
    names = [prefix_blocks(question(d, 0)) for d in range(4)]
    assert not any(p.index.known(h) for b in names for h in b.blocks[: b.first])  # forgotten
    assert place(400, 100) == before


def test_a_conversations_own_first_message_is_not_a_shared_start_on_its_later_turns():
    """A long first user message (3 KB, past a 2.7 KB system prompt) is its conversation's
    own: its later turns find its names in the index (their first turn put them there),
    yet still count under the system prompt, so the system prompts keep their shares and
    their plan, and no conversation gets a plan entry of its own."""
    ws = workers(4)
    p = policy()
    systems = [f"system prompt {s} " * 160 for s in range(2)]
    rng = random.Random(3)
    history: dict[int, list[str]] = {}
    for i in range(1200):
        c = rng.randrange(30)
        turns = history.setdefault(c, [f"conversation {c} {i}: " + "q" * 3000])
        p.select(ws, info(chat(*turns, system=systems[c % 2])))
        turns += [long(f"a{i}", 300), f"next {i}"]
        if len(turns) > 9:  # a new conversation in its place
            del history[c]
    counted = set(p.shares["m"].counts)
    preambles = {prefix_blocks(chat("x", system=s)).preamble for s in systems}
    assert counted == preambles, len(counted)
    assert set(plan_of(p)) == preambles
    c, turns = next((c, t) for c, t in history.items() if len(t) > 1)  # one in progress
    later = prefix_blocks(chat(*turns, system=systems[c % 2]))
    assert later.first > 0 and any(p.index.known(h) for h in later.blocks[: later.first])
    assert p._shared(later, p.shares["m"].counts) == later.preamble


def test_two_replicas_keep_a_conversation_about_an_unpopular_document_on_one_worker():
    """A document too rare for the plan (each replica has seen it once, each placing that
    question by its own key): a conversation about it whose turns alternate between the
    two replicas stays on one worker, the first of the document's own order, which both
    compute alike (not each replica's own copy of it: the index is a private guess)."""
    for doc in range(4):
        ws = workers(4)
        one, other = policy(), policy()
        for i in range(100):  # other traffic: the document stays far below the plan's share
            one.select(ws, info(chat(f"hello {i}", system="Be brief.")))
            other.select(ws, info(chat(f"hey {i}", system="Be brief.")))
        one.select(ws, info(question(doc, 0)))
        other.select(ws, info(question(doc, 1)))
        turns = [f"{DOCUMENTS[doc]}\n\nQuestion 77: what does it say?"]
        where = set()
        for t in range(6):
            where.add(((one, other)[t % 2]).select(ws, info(chat(*turns, system="Be brief."))))
            turns += [f"answer {t} " * 50, f"follow-up {t}"]
        assert len(where) == 1, (doc, where)


def test_two_replicas_place_a_documents_questions_alike():
    """Requests alternating between two gateways: the name of a shared document is the
    same in both (CRC-32), and so are its share, plan and order."""
    ws = workers(4)
    one, other = policy(), policy()
    where: dict[int, set[str]] = {d: set() for d in range(4)}
    for i in range(800):
        p = (one, other)[i % 2]
        d = (i // 2) % 4
        chosen = p.select(ws, info(question(d, i)))
        if i >= 200:
            where[d].add(chosen.url)
    assert all(len(on) == 1 for on in where.values()), where


def preambles_placed(p: CacheAware, ws: list[Worker], systems: list[str], count: int,
                     skip: int = 100, tag: str = "") -> dict[int, Counter]:  # fmt: skip
    """Where `count` first turns (new conversations), cycling over `systems`, go (after
    the first `skip`)."""
    where: dict[int, Counter] = {s: Counter() for s in range(len(systems))}
    for i in range(count):
        s = i % len(systems)
        chosen = p.select(ws, info(chat(f"user {tag}{i} says hi", system=systems[s])))
        if i >= skip:  # once the shares are known (the first requests see fewer prompts)
            where[s][chosen] += 1
    return where


@pytest.mark.parametrize(("prompts", "each"), [(4, 1), (2, 2), (1, 4)])
def test_conversations_sharing_a_preamble_go_to_as_few_workers_as_its_share_needs(prompts, each):
    """A worker may carry load_bound x its fair share, so a preamble with share s needs
    ceil(n x s / load_bound) of n workers: 4 equally popular system prompts on 4 workers
    take one worker each, 2 take two each, one takes all four (its conversations spread
    by their own keys)."""
    ws = workers(4)
    systems = [f"system prompt number {s} " * 60 for s in range(prompts)]
    where = preambles_placed(policy(), ws, systems, 800)
    assert all(len(on) == each for on in where.values()), where


@pytest.mark.parametrize("fleet", range(8))
def test_popular_preambles_are_planned_apart_and_alike_in_every_replica(fleet):
    """Each of 4 equally popular system prompts on its own rendezvous order would share a
    worker with another 91% of the time (that worker then caches two preambles and their
    histories, another none); planned together they take one worker each, and a second
    replica, seeing the same mix, makes the same plan."""
    ws = [Worker(f"http://10.{fleet}.0.{i}:8000", models=("m",)) for i in range(4)]
    systems = [f"system prompt {fleet}-{s} " * 60 for s in range(4)]
    one, other = policy(), policy()
    placed = [preambles_placed(p, ws, systems, 400, 200) for p in (one, other)]
    homes = [{s: set(on) for s, on in where.items()} for where in placed]
    assert homes[0] == homes[1]
    assert all(len(on) == 1 for on in homes[0].values()), homes[0]
    assert len(set().union(*homes[0].values())) == 4, homes[0]


def plan_of(p: CacheAware) -> dict[int, tuple[int, frozenset[str]]]:
    return dict(p.shares["m"].plan._planned)


def test_the_same_mix_keeps_its_plan_and_a_new_preamble_or_worker_makes_a_new_one():
    """Made again on its schedule, the plan of the same mix is the same plan; a new
    popular preamble, or a worker that joins, is planned."""
    ws = workers(4)
    p = policy()
    systems = [f"system prompt number {s} " * 60 for s in range(4)]
    preambles_placed(p, ws, systems, 400, 400)
    before = plan_of(p)
    assert len(before) == 4
    preambles_placed(p, ws, systems, 1200, 1200, "again")  # past a scheduled plan
    assert plan_of(p) == before
    more = [*systems, "a fifth system prompt " * 60]
    preambles_placed(p, ws, more, 1000, 1000, "fifth")
    assert len(plan_of(p)) == 5
    joined = workers(5)[4]
    preambles_placed(p, [*ws, joined], more, 400, 400, "joined")
    assert any(joined.url in urls for _, urls in plan_of(p).values())


def mixed_traffic(rng: random.Random, replicas: list[CacheAware], ws: list[Worker],
                  count: int, tag: str) -> None:  # fmt: skip
    """Two popular system prompts (40% each: two workers each, clear of a boundary where
    the two replicas' samples could tell 1 or 2) and many rare ones, requests alternating."""
    hot = [f"system prompt {x} " * 70 for x in "PQ"]  # past MIN_PREAMBLE_BYTES
    for i in range(count):
        r = rng.random()
        s = hot[0] if r < 0.4 else hot[1] if r < 0.8 else f"rare {rng.randrange(300)} " * 150
        replicas[i % len(replicas)].select(ws, info(chat(f"{tag} {i} hi", system=s)))


@pytest.mark.parametrize("seed", range(4))
def test_alternating_replicas_make_the_same_plan_and_keep_a_conversation_on_one_worker(seed):
    """Plans made at other moments from other samples converge: each is made from scratch
    from the shares, on a schedule both replicas keep."""
    ws = workers(4)
    one, other = policy(), policy()
    mixed_traffic(random.Random(seed), [one, other], ws, 3000, "a")
    assert plan_of(one) and plan_of(one) == plan_of(other)
    turns: list[str] = []
    homes = set()
    for t in range(6):
        turns.append(f"conversation turn {t} " * 30)
        homes.add(
            (one, other)[t % 2].select(ws, info(chat(*turns, system="system prompt P " * 70)))
        )
        turns.append(f"answer {t} " * 100)
    assert len(homes) == 1, homes


def test_two_replicas_count_each_conversation_once_whichever_sees_its_turns():
    """Behind an L4 balancer each replica sees half the requests, but nearly every
    conversation: counted in conversations, the two measure the same shares. Three short
    conversations under P, one long one under Q, turns alternating between the replicas:
    each counts P 3 and Q 1 (by requests they would count P 3 and Q 6, or 3 and 6 split
    unevenly), and a retry of a turn counts nothing more."""
    ws = workers(4)
    replicas = [policy(), policy()]
    systems = {s: f"system prompt {s} " * 70 for s in "PQ"}
    talks = [("P", 2), ("P", 2), ("P", 2), ("Q", 12)]
    sent = 0
    for c, (s, turns) in enumerate(talks):
        history: list[str] = []
        for t in range(turns):
            history.append(f"conversation {c} turn {t} " * 10)
            body = chat(*history, system=systems[s])
            replicas[sent % 2].select(ws, info(body))
            sent += 1
            if t == 1:  # a retry of it, where it was that replica's first of the conversation
                replicas[(sent - 1) % 2].select(ws, info(body))
            history.append(f"answer {t} " * 20)
    named = {s: info(chat("x", system=text)).prefix_blocks() for s, text in systems.items()}
    names = {s: blocks.preamble for s, blocks in named.items() if blocks is not None}
    for replica in replicas:
        shares = replica.shares["m"]
        assert shares.samples == 4
        assert {s: shares.counts[name] for s, name in names.items()} == {"P": 3, "Q": 1}
    # A sibling process's request of a conversation it had seen (told as -1) is not counted.
    replicas[0].told("m", None, -1, names["Q"], [1, 2, 3])
    assert replicas[0].shares["m"].samples == 4


def test_first_turns_that_share_their_key_count_once_each():
    """A flood of one prompt, or completions under one template (their key: the first
    KiB), count per request: as one sample they would inflate every other preamble's share."""
    ws = workers(4)
    p = policy()
    template = "Few-shot examples follow. " * 60  # past the 1 KiB key
    for i in range(30):
        doc = {"model": "m", "prompt": template + f"question {i}"}
        p.select(ws, RequestInfo("/v1/completions", b"", "m", True, "r", {}, doc))
    for _ in range(10):
        p.select(ws, info(chat("hello", system="system prompt S " * 70)))  # one prompt, 10x
    assert p.shares["m"].samples == 40


def test_a_registry_change_that_removes_nobody_keeps_the_plan():
    ws = workers(4)
    p = policy()
    rng = random.Random(3)
    mixed_traffic(rng, [p], ws, 5000, "a")
    before = plan_of(p)
    assert before
    p.forget_missing(set(ws))  # a state change, a circuit, another model's worker...
    mixed_traffic(rng, [p], ws, 200, "b")
    assert plan_of(p) == before


@pytest.mark.parametrize("seed", range(4))
def test_no_worker_is_planned_two_preambles_while_another_is_planned_none(seed):
    ws = [Worker(f"http://s{seed}.{i}:8000", models=("m",)) for i in range(6)]
    rng = random.Random(seed)
    p = policy()
    for i in range(4000):  # 5 equally popular system prompts over 6 workers
        p.select(ws, info(chat(f"u{i}", system=f"system prompt {seed}-{rng.randrange(5)} " * 60)))
    per = Counter(u for _, urls in plan_of(p).values() for u in urls)
    assert max(per.values()) == 1 or len(per) == len(ws), per


def test_a_preambles_share_is_of_all_the_traffic_with_or_without_one():
    """Half the requests name system prompt P, half none: P needs ceil(4 x 0.5 / 1.25) = 2
    of 4 workers, not all four (as it would if only requests with a preamble counted)."""
    ws = workers(4)
    p = policy()
    system = "system prompt P " * 70
    for i in range(1200):
        p.select(ws, info(no_system(f"u{i}") if i % 2 else chat(f"u{i}", system=system)))
    planned = plan_of(p)
    assert [want for want, _ in planned.values()] == [2], planned


def test_preferred_names_only_gated_workers_the_request_loses_something_by_missing():
    ws = workers(4)
    p = policy()
    long_system = "system prompt P " * 70
    first = chat("q " * 300, system=long_system)
    later = chat("q " * 300, long("a"), "q2 " * 300, system=long_system)
    a = p.select(ws, info(first))
    b = p.select([w for w in ws if w is not a], info(later))  # the history moved to b
    rest = [w for w in ws if w not in (a, b)]
    nxt = info(chat("q " * 300, long("a"), "q2 " * 300, long("a2"), "q3", system=long_system))
    # a holds less of the history than candidate b: nothing lost by missing a.
    assert p.preferred([a], [b, *rest], nxt) == []
    # b gated: it holds more than any candidate.
    assert p.preferred([b], [a, *rest], nxt) == [b]
    # A new conversation: its preamble's holders, unless a candidate holds it too.
    fresh = info(chat("another question", system=long_system))
    assert p.preferred([a], rest, fresh) == [a]
    assert p.preferred([a], [b, *rest], fresh) == []
    # No preamble, nothing known: a first turn misses nothing; a later turn its key's home.
    assert p.preferred(ws[:2], ws[2:], info(no_system("new"))) == []
    unknown = info(no_system("unseen", "answer", "more"))
    home = policy().select(ws, info(no_system("unseen")))  # every replica's first choice
    gated = [home]
    assert p.preferred(gated, [w for w in ws if w is not home], unknown) == [home]


def test_preferred_tells_the_bytes_a_later_turn_would_prefill_again_elsewhere():
    """`RequestInfo.saved` (patience.py reads it): what the gated holders hold of the
    turn's own history and the best candidate does not; a candidate holding the preamble
    holds that part too. 0 for a first turn, and where the gated hold no history."""
    ws = workers(3)
    p = policy()
    long_system = "system prompt P " * 70
    first = chat("q " * 300, system=long_system)
    a = p.select(ws, info(first))
    others = [w for w in ws if w is not a]
    doc = chat("q " * 300, long("a"), "q2 " * 300, system=long_system)
    blocks = prefix_blocks(doc)
    assert blocks is not None
    _, depth = p.index.deepest(blocks.blocks, [a])
    held = blocks.held_bytes(depth)
    nxt = info(doc)
    assert p.preferred([a], others, nxt) == [a]
    assert nxt.saved == held > blocks.preamble_end > 0  # none of it on the others
    c = others[0]
    p.select([c], info(chat("another conversation", system=long_system)))  # c: the preamble
    assert p.preferred([a], [c], nxt) == [a]
    assert nxt.saved == held - blocks.preamble_end
    fresh = info(chat("a new question", system=long_system))
    assert p.preferred([a], [others[1]], fresh) == [a] and fresh.saved == 0
    unknown = info(no_system("unseen", "answer", "more"))
    home = policy().select(ws, info(no_system("unseen")))
    assert p.preferred([home], [w for w in ws if w is not home], unknown) == [home]
    assert unknown.saved == 0  # its key's home, guessed: no history known there


def test_a_worker_of_weight_0_is_planned_nothing_and_all_of_weight_0_still_answer():
    ws = workers(4)
    ws[3].weight = 0.0
    p = policy()
    for i in range(400):
        p.select(ws, info(chat(f"u{i}", system=f"system prompt {i % 4} " * 70)))
    assert len(plan_of(p)) == 4
    assert all(ws[3].url not in urls for _, urls in plan_of(p).values())
    for w in ws:
        w.weight = 0.0
    assert p.select(ws, info(chat("any of them"))) in ws  # as queue would choose


def test_a_worker_that_is_out_is_planned_no_more_and_its_preamble_moves():
    """Unhealthy (or draining, or its circuit open), a planned worker is no candidate; the
    next plan leaves it out and gives its preamble the spare worker, not another's."""
    from vllm_gateway.workers import WorkerState

    ws = workers(5)
    for w in ws:
        w.state = WorkerState.READY
    p = policy()
    systems = [f"system prompt number {s} " * 60 for s in range(4)]
    preambles_placed(p, ws, systems, 400, 400)
    planned = plan_of(p)
    out = next(iter(planned[next(iter(planned))][1]))
    down = next(w for w in ws if w.url == out)
    down.state = WorkerState.UNHEALTHY
    up = [w for w in ws if w is not down]
    preambles_placed(p, up, systems, 2000, 2000, "after")
    per = Counter(u for _, urls in plan_of(p).values() for u in urls)
    assert out not in per and max(per.values()) == 1 and len(per) == 4, per


@pytest.mark.parametrize("n", [4, 5, 10])
def test_conversations_without_a_shared_prompt_or_with_one_for_all_use_every_worker(n):
    ws = workers(n)
    p = policy()
    bare = Counter(p.select(ws, info({"model": "m", "messages": [
        {"role": "user", "content": f"question {i}"}]})) for i in range(40 * n))  # fmt: skip
    p = policy()  # (after the bare ones, the system prompt would have a small share)
    one = Counter(p.select(ws, info(chat(f"user {i} says hi"))) for i in range(40 * n))
    assert len(bare) == n and len(one) == n, (bare, one)


@pytest.mark.parametrize("fleet", range(3))
def test_rare_preambles_keep_off_the_worker_a_hot_one_fills(fleet):
    """A hot system prompt has 22% of 5 workers' traffic, planned on one (its fair part is
    20%), three warm ones 16% each, and twenty rare ones (1.6% each, too rare to plan) the
    rest: no rare one goes to the hot one's worker, where its copy would take the cache
    the hot one's many conversations need; each goes first to a worker with traffic to
    spare (by its own order there, `PreamblePlan.order`). On their own orders alone, some
    of the twenty would land there (each with odds 1 in 5)."""
    ws = [Worker(f"http://10.{fleet}.1.{i}:8000", models=("m",)) for i in range(5)]
    mix = [0] * 14 + [1, 2, 3] * 10 + list(range(4, 24))  # 64 conversations a cycle
    systems = [f"system prompt {fleet}-{s} " * 60 for s in range(24)]
    p = policy()
    where: dict[int, Counter] = {s: Counter() for s in range(len(systems))}
    for i in range(64 * 30):
        s = mix[i % 64]
        chosen = p.select(ws, info(chat(f"user {i} says hi", system=systems[s])))
        if i >= 64 * 12:
            where[s][chosen] += 1
    assert len(where[0]) == 1, where[0]
    (hot,) = where[0]
    rare = set().union(*(set(where[s]) for s in range(4, 24)))
    assert hot not in rare and len(rare) == 4, rare
    assert all(len(where[s]) == 1 for s in range(4, 24))  # (one worker each: no spreading)


def test_a_preambles_overflow_goes_to_its_next_worker_in_every_replica():
    """Past the load bound on its home, a preamble's new conversations go to the next
    worker in the preamble's own order, all to the same one, and another replica (its
    own index and shares) sends them there too: one more worker caches the preamble,
    not every worker its keys would pick."""
    ws = workers(4)
    systems = [f"system prompt number {s} " * 60 for s in range(4)]
    one, other = policy(), policy()
    homes = {s: next(iter(on)) for s, on in preambles_placed(one, ws, systems, 200).items()}
    preambles_placed(other, ws, systems, 200)
    hot = [homes[0]]
    for step in range(2):  # its home past the bound, then the worker it overflowed to
        for w in hot:
            w.inflight = 40  # far past its fair share
        spilled: set[Worker] = set()
        for p in (one, other):
            spilled |= set(preambles_placed(p, ws, systems, 40, 0, f"new{step}-")[0])
        assert len(spilled) == 1 and not spilled & set(hot), (step, spilled)
        hot += spilled


@pytest.mark.parametrize(
    ("usage", "spills"),
    [
        (0.99, False),  # 100 tokens free: no room for the 1500-byte preamble's copy
        (0.5, True),  # 5000 free: room
        (None, True),  # the cache not reported: as before
    ],
)
def test_a_preambles_overflow_goes_only_where_its_kv_cache_has_room_for_it(usage, spills):
    """Past the load bound on its home, a preamble's new conversations go to its next
    worker only when that worker has free KV blocks for the preamble's copy (vLLM's usage
    gauge: blocks its running requests hold). Where its cache is held, the copy would wait
    there for blocks, and hold up the requests behind it: the home takes them, past its
    bound."""
    ws = workers(4)
    systems = [f"system prompt number {s} " * 60 for s in range(4)]
    p = policy()
    homes = {s: next(iter(on)) for s, on in preambles_placed(p, ws, systems, 200).items()}
    home = homes[0]
    p.index = PrefixIndex()  # no worker but its home is known to hold the preamble
    home.inflight = 40  # far past its fair share
    for w in ws:
        w.kv_free = (1.0 - usage) * 10_000.0 if usage is not None else math.inf  # (a scrape)
    placed = preambles_placed(p, ws, systems, 40, 0, "new-")[0]
    assert (set(placed) != {home}) is spills, placed


@pytest.mark.parametrize(("answer", "back"), [("a short answer", True), (long("a", 2000), False)])
def test_a_conversation_that_strayed_from_its_preambles_worker_goes_back_if_shorter(answer, back):
    """A first turn sent away from its preamble's planned worker (full then) copies the
    preamble into another worker's cache; its next turn goes back while its history past
    the preamble is shorter than the preamble (prefilled once where it would have been,
    rather than the preamble held twice for the conversation's life); a longer one stays
    with its history. Another replica, which never saw the first turn, sends it home too."""
    ws = workers(4)
    systems = [f"system prompt number {s} " * 60 for s in range(4)]
    one, other = policy(), policy()
    homes = {s: next(iter(on)) for s, on in preambles_placed(one, ws, systems, 200).items()}
    preambles_placed(other, ws, systems, 200)
    home = homes[0]
    first = chat("a question of my own", system=systems[0])
    strayed = one.select([w for w in ws if w is not home], info(first))
    later = chat("a question of my own", answer, "and then?", system=systems[0])
    # Above its fair share (1 of 2 in flight), though within the new conversations' bound:
    # the preamble's traffic may need the stray worker; the turn stays with its history.
    home.inflight = 1
    assert one.select(ws, info(later)) is strayed
    home.inflight = 0
    assert (one.select(ws, info(later)) is home) is back
    assert other.select(ws, info(later)) is home


@pytest.mark.parametrize("conversation", range(8))
def test_a_conversation_back_with_its_preambles_worker_stays_there(conversation):
    """Back on its planned worker, a conversation's short turns add few blocks: the stray
    worker holds as much of it for a while, and the turn must stay on the planned one,
    not follow the key's order back to the stray (each bounce a prefill again)."""
    ws = workers(4)
    systems = [f"system prompt number {s} " * 60 for s in range(4)]
    p = policy()
    home = next(iter(preambles_placed(p, ws, systems, 200)[0]))
    turns = [f"conversation {conversation}: a question of my own"]
    strayed = p.select([w for w in ws if w is not home], info(chat(*turns, system=systems[0])))
    path = [strayed]
    for t in range(1, 6):
        turns += [f"short answer {t} " * 8, f"and then {t}? " * 4]
        path.append(p.select(ws, info(chat(*turns, system=systems[0]))))
    assert path[1:] == [home] * 5, [ws.index(w) for w in path]


def test_a_hot_home_sheds_new_conversations_within_the_bound():
    ws = workers(4)
    p = policy()
    doc = chat("the same first question")
    home = p.select(ws, info(doc))
    # Its home is loaded far past its share: new conversations keyed there go elsewhere...
    home.inflight = 10
    for w in ws:
        if w is not home:
            w.inflight = 2
    fresh = chat("another first question")
    first_choice = p.select([w for w in ws if w is not home], info(fresh))
    assert p.select(ws, info(fresh)) is first_choice or p.select(ws, info(fresh)) is not home
    # ...and so does a conversation whose history is there, once past the looser bound.
    assert p.select(ws, info(chat("the same first question", "answer", "next"))) is not home
    home.inflight = 3  # within the history bound again: it keeps its conversation
    assert p.select(ws, info(chat("the same first question", "answer", "next"))) is home


@pytest.mark.parametrize(
    ("capacity", "max_num_seqs", "load", "others", "stays"),
    [
        (16.0, 0, 15, 0, True),  # the gate learned its capacity: one batch slot is free
        (0.0, 16, 15, 0, True),  # declared in the configuration: the same
        (16.0, 0, 16, 0, False),  # no slot free: moving beats waiting in its queue
        (0.0, 0, 15, 0, False),  # no capacity known: the gate is open, the bound is all
        # Its last scrape reports requests another replica sent: they fill slots too.
        (16.0, 0, 12, 3, True),
        (16.0, 0, 12, 4, False),
    ],
)
def test_a_later_turn_past_its_bound_stays_while_its_holder_has_a_free_slot(
    capacity, max_num_seqs, load, others, stays
):
    """Moving a history prefills all of it again elsewhere; where it is, a free batch
    slot takes the turn at once."""
    ws = workers(4)
    for w in ws:
        w.capacity, w.max_num_seqs = capacity, max_num_seqs
    p = policy()
    turn = chat("the same first question", "answer", "next")
    home = p.select(ws, info(chat("the same first question")))
    home.inflight = load  # past the history bound: ceil(fair 5.5 + 0.5 x 16) = 14
    if others:  # its scrape counts them (the load view), beyond all this process has there
        home.stats, home.others = EngineStats(load + others, 0, None, 0.0), others
    for w in ws:
        if w is not home:
            w.inflight = 2
    assert (p.select(ws, info(turn)) is home) is stays
    # A first turn with the same start (the same prompt again) keeps the bound.
    assert p.select(ws, info(chat("the same first question"))) is not home
    # Full (the gate leaves it out of the candidates): the turn goes elsewhere.
    assert p.select([w for w in ws if w is not home], info(turn)) is not home


def test_a_history_held_twice_past_the_bound_goes_to_the_less_loaded_holder():
    ws = workers(8)
    for w in ws:
        w.capacity = 16.0
    p = policy()
    first = chat("q " * 300)
    a = p.select(ws, info(first))
    b = p.select([w for w in ws if w is not a], info(first))  # a was full once
    later = chat("q " * 300, "answer", "next")
    a.inflight, b.inflight = 14, 12  # both past ceil(fair 3.4 + 0.5 x 16) = 12
    assert p.select(ws, info(later)) is b
    a.inflight, b.inflight = 12, 14
    assert p.select(ws, info(later)) is a
    a.inflight = b.inflight = 13  # a tie: the key's rendezvous order, as in every replica
    assert p.select(ws, info(later)) is p.select(list(reversed(ws)), info(later))


def test_a_later_turn_another_replica_placed_goes_to_its_home_past_this_replicas_bound():
    """Replicas share no index: a turn whose history the other replica placed goes to the
    home every replica computes from the request, gated by capacity only, since the load
    bound reads each replica's own in-flight view and would differ between them."""
    a_ws, b_ws = workers(4), workers(4)  # the same URLs, each replica its own view
    for w in a_ws + b_ws:
        w.capacity = 16.0
    a, b = policy(), policy()
    home = a_ws.index(a.select(a_ws, info(chat("the same first question"))))
    b_ws[home].inflight = 12  # in replica b's view past the bound, ceil(3.25 + 0.25 x 16) = 8
    later = chat("the same first question", "answer", "next")
    assert b.select(b_ws, info(later)) is b_ws[home]
    # A new conversation with that home is shed in the same view...
    fresh = [chat(f"first question {i}") for i in range(40)]
    homes_in_a = [a_ws.index(policy().select(a_ws, info(doc))) for doc in fresh]
    shed = [doc for doc, h in zip(fresh, homes_in_a, strict=True) if h == home]
    assert shed and all(b.select(b_ws, info(doc)) is not b_ws[home] for doc in shed)
    # ...and without a known capacity (the gate is open) the bound decides for a later
    # turn too.
    for w in b_ws:
        w.capacity = 0.0
    assert policy().select(b_ws, info(later)) is not b_ws[home]


def test_history_wins_over_the_rendezvous_home():
    ws = workers(4)
    p = policy()
    home = p.select(ws, info(chat("q " * 300)))
    # Its second turn was moved (its home was full): its history is elsewhere now.
    others = [w for w in ws if w is not home]
    moved = p.select(others, info(chat("q " * 300, long("a"), "q2 " * 300)))
    assert moved is not home
    nxt = chat("q " * 300, long("a"), "q2 " * 300, long("a2"), "q3")
    assert p.select(ws, info(nxt)) is moved


def test_placed_names_the_step_that_chose():
    """`RequestInfo.placed` (the access log's `placed`) says which step chose the worker."""
    ws = workers(4)
    for w in ws:
        w.capacity = 16.0
    p = policy()

    def placed(candidates: list[Worker], doc: dict) -> tuple[str, Worker]:
        i = info(doc)
        w = p.select(candidates, i)
        assert w is not None and i.placed in PLACED
        return i.placed, w

    short = "Be brief."  # shorter than a block: nothing shared, placed by the key
    step, home = placed(ws, chat("q " * 300, system=short))
    assert step == "home"
    assert placed(ws, chat("q " * 300, "answer", "next", system=short)) == ("history", home)
    assert placed(ws[:1], chat("another", system=short)) == ("only", ws[0])
    no_text = {"model": "m", "prompt": [1, 2, 3]}  # token ids: nothing to hash
    assert placed(ws, no_text)[0] == "load"
    # Four system prompts, a quarter of the traffic each: one planned worker each.
    systems = [f"System {k}. " + long(f"s{k}", 1500) for k in range(4)]
    for i in range(64):
        assert placed(ws, chat(f"question {i}", system=systems[i % 4]))[0] == "preamble"
    step, mine = placed(ws, chat("one more", system=systems[0]))
    assert step == "preamble"
    # Its next turn, short past the system prompt, on the planned worker that has it.
    assert placed(ws, chat("one more", "answer", "next", system=systems[0])) == ("history", mine)
    mine.inflight = 16  # past its bound: the preamble's next worker in its own order
    step, other = placed(ws, chat("and another", system=systems[0]))
    assert step == "overflow" and other is not mine
    mine.inflight = 0
    assert placed(ws, chat("a third", system=systems[0])) == ("preamble", mine)
    # A stray: its first turn where the plan does not put its system prompt (the planned
    # worker was full), its next turn back to the planned worker.
    placed([w for w in ws if w is not mine], chat("a stray", system=systems[0]))
    assert placed(ws, chat("a stray", "answer", "next", system=systems[0])) == ("back", mine)


@pytest.mark.parametrize(("slow_pace", "most"), [(1.0, 0.40), (0.5, 0.25)])
def test_a_slower_worker_takes_less_under_load(slow_pace, most):
    """Bounded load per unit of speed: a worker half as fast holds about half as much."""
    ws = workers(4)
    for w in ws:
        w.pace = 1.0
    ws[0].pace = slow_pace
    p = policy()
    for i in range(400):  # requests pile up (nothing finishes): the bound decides
        p.select(ws, info(chat(f"question {i}"))).inflight += 1
    assert ws[0].inflight <= most * 400, [w.inflight for w in ws]


def test_token_prompts_go_to_the_least_expected_wait():
    ws = workers(3)
    ws[0].inflight, ws[1].inflight, ws[2].inflight = 3, 1, 2
    doc = {"model": "m", "prompt": [1, 2, 3]}
    assert (
        policy().select(ws, RequestInfo("/v1/completions", b"", "m", True, "r", {}, doc)) is ws[1]
    )


# --- the prefill backlog ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "depth", "expected"),
    [
        # The key's own entry holds the prompt up to the key's end.
        (chat("q " * 300, "answer " * 200, "next"), "key", "key_end"),
        # The last entry holds the prompt's last full block (the rest is never named).
        (chat("q " * 300, "answer " * 200, "next"), "last", "full"),
        # Nothing held: nothing.
        (chat("q " * 300), 0, 0),
    ],
)
def test_held_bytes_is_how_much_of_the_prompt_an_entry_stands_for(doc, depth, expected):
    blocks = prefix_blocks(doc)
    assert blocks is not None
    n = {"key": blocks.first + 1, "last": len(blocks.blocks)}.get(depth, depth)
    full = blocks.size // BLOCK_BYTES * BLOCK_BYTES
    want = {"key_end": blocks.key_end, "full": full}.get(expected, expected)
    data = orjson.dumps(doc["messages"])
    assert blocks.size == len(data)
    assert blocks.held_bytes(n) == want
    # Each entry after the key stands for a block more of the prompt, in order.
    ends = [blocks.held_bytes(i) for i in range(len(blocks.blocks) + 1)]
    assert ends == sorted(ends) and ends[-1] <= blocks.size


def test_a_shared_document_entry_holds_up_to_its_block():
    doc = chat("Document: " + "d " * 2000 + "Question: why?", system="Be brief.")
    blocks = prefix_blocks(doc)
    assert blocks is not None and blocks.first >= 2
    for i in range(1, blocks.first + 1):
        assert blocks.held_bytes(i) % BLOCK_BYTES == 0
        assert blocks.held_bytes(i) < blocks.key_end


def backlogged(ws: list[Worker], owed: dict[int, int]) -> None:
    for w in ws:
        w.capacity, w.pace, w.backlog = 16.0, 1.0, 0
    for j, b in owed.items():
        ws[j].backlog = b


def test_a_later_turn_leaves_a_holder_only_behind_more_prefill_than_moving_costs():
    """Moving costs the turn its whole prompt's prefill elsewhere, and the requests behind
    it there the part the holder would not have prefilled: it leaves a holder only when
    the holder owes more than that above what a typical candidate owes (the lower
    median)."""
    ws = workers(4)
    backlogged(ws, {})
    p = policy()
    home = p.select(ws, info(chat("q " * 300)))

    def turn() -> RequestInfo:
        return info(chat("q " * 300, "answer " * 100, "next question"))

    assert p.select(ws, turn()) is home  # now the index says it holds this turn too
    later = turn()
    assert p.select(ws, later) is home
    size, own = later.prefix_blocks().size, later.prefill  # type: ignore[union-attr]
    limit = 2 * size - own  # owed past the typical candidate before it leaves
    h = ws.index(home)

    for owed, stays in [(size, True), (limit, True), (limit + 1, False)]:
        backlogged(ws, {h: owed})
        assert (p.select(ws, turn()) is home) is stays, owed
    # Measured from what a typical candidate owes, not from nothing...
    backlogged(ws, {j: 3 * size for j in range(4)} | {h: 3 * size + limit})
    assert p.select(ws, turn()) is home
    # ...nor from the least: on a fleet all busy prefilling, one worker owing nothing for
    # a moment does not move the history (its key's home among the rest owes as the rest).
    idle = (h + 1) % 4
    backlogged(ws, {j: 3 * size for j in range(4)} | {idle: 0, h: 3 * size + limit})
    assert p.select(ws, turn()) is home
    backlogged(ws, {j: 3 * size for j in range(4)} | {idle: 0, h: 3 * size + limit + 1})
    assert p.select(ws, turn()) is not home
    # A worker of another speed class (half as fast) drains at half the pace: its backlog
    # counts twice; a pace learned a little lower (the same class) changes nothing.
    backlogged(ws, {h: limit // 2 + 1})
    home.pace = 0.9
    assert p.select(ws, turn()) is home
    home.pace = 0.5
    assert p.select(ws, turn()) is not home
    # A holder that misses most of what it is sent (it evicts) is left behind less.
    backlogged(ws, {h: size + 1})
    assert p.select(ws, turn()) is home
    home.miss = 1.0
    assert p.select(ws, turn()) is not home


def test_the_chosen_workers_share_of_the_prompt_it_lacks_is_set_on_the_request():
    ws = workers(4)
    backlogged(ws, {})
    p = policy()
    first = info(chat("q " * 300))
    home = p.select(ws, first)
    assert first.prefill == first.prefix_blocks().size  # type: ignore[union-attr]
    assert first.cold  # none of it anywhere: its bytes are known (prefill_rate.py)
    later = info(chat("q " * 300, "answer " * 100, "next question"))
    blocks = later.prefix_blocks()
    assert blocks is not None
    assert p.select(ws, later) is home
    # It holds the first turn's prompt: what the turn adds is left (to a block).
    assert 0 < later.prefill <= blocks.size - blocks.key_end + BLOCK_BYTES
    assert not later.cold
    # Another worker lacks all of it, by this process's index; but a later turn whose
    # history is on none of the candidates may have been placed there by another
    # replica: not counted cold.
    other = info(chat("q " * 300, "answer " * 100, "next question"))
    assert p.select([w for w in ws if w is not home], other) is not home
    assert other.prefill == blocks.size and not other.cold
    # A worker that misses all it is sent is counted as lacking all; still not cold.
    home.miss = 1.0
    again = info(chat("q " * 300, "answer " * 100, "next question"))
    assert p.select([home], again) is home
    assert again.prefill == blocks.size and not again.cold


def test_a_worker_holding_an_earlier_part_of_a_history_is_not_cold():
    """Its deepest holder owes too much prefill (left for its backlog): the turn goes to
    a worker holding the conversation's first turn only. It lacks most of the prompt,
    but not all of it: not a cold prompt to learn the prefill rate from."""
    ws = workers(2)
    backlogged(ws, {})
    p = policy()
    early, deep = ws
    turns = ("q " * 300, "answer " * 100, "next " * 100, "answer " * 100, "last")
    assert p.select([early], info(chat(*turns[:1], system="Be brief."))) is early
    assert p.select([deep], info(chat(*turns[:3], system="Be brief."))) is deep
    last = info(chat(*turns, system="Be brief."))
    blocks = last.prefix_blocks()
    assert blocks is not None
    deep.backlog = 10 * blocks.size
    assert p.select(ws, last) is early
    assert not last.cold


def test_a_worker_that_lost_only_the_head_of_a_history_from_the_index_is_not_cold():
    """The index forgets a prompt's names from its head (its first block first), so a
    worker can still hold most of an older turn without its first name: not cold."""
    ws = workers(2)
    backlogged(ws, {})
    p = policy()
    early, deep = ws
    turns = ("q " * 300, "answer " * 1000, "next " * 1000, "answer " * 1000, "last")
    third = info(chat(*turns[:3], system="Be brief."))
    assert p.select([early], third) is early
    names = third.prefix_blocks().blocks  # type: ignore[union-attr]
    # A cache of a few blocks more than that turn's: one more prompt evicts its head.
    early.stats = EngineStats(0, 0, None, 0.0, cache_tokens=(len(names) + 4) * 64)
    p.select([early], info(chat("other " * 900, system="Be brief.")))
    assert not p.index.holds(names[0], early) and p.index.holds(names[-1], early)
    assert p.select([deep], info(chat(*turns[:5], system="Be brief."))) is deep
    last = info(chat(*turns, system="Be brief."))
    deep.backlog = 10 * last.prefix_blocks().size  # type: ignore[union-attr]
    assert p.select(ws, last) is early
    assert not last.cold


def test_a_worker_holding_the_system_prompt_is_not_cold_for_a_documents_question():
    """The shared start a request is counted under may be a document in its first user
    message, not its system prompt; a worker holding the system prompt is not cold."""
    ws = workers(3)
    backlogged(ws, {})
    p = policy()
    held, seeded, _ = ws
    p.select([held], info(chat("an unrelated question " * 10)))  # SYSTEM only, in common
    document = "document text " * 400
    p.select([seeded], info(chat(document + " question one")))
    asked = info(chat(document + " question two"))
    assert p.select([held], asked) is held
    assert p.shared != asked.prefix_blocks().preamble  # type: ignore[union-attr]
    assert not asked.cold


def test_a_first_turn_stays_with_its_congested_preamble_holder_a_later_turn_leaves():
    """A first turn sent away from its preamble's worker would copy the preamble into one
    more cache (a cost to every conversation sharing it): only later turns, whose history
    moves with them, leave a worker for its prefill backlog."""
    ws = workers(4)
    backlogged(ws, {})
    p = policy()
    systems = [f"system prompt number {s} " * 60 for s in range(4)]
    where = preambles_placed(p, ws, systems, 400)
    hot = next(iter(where[0]))
    backlogged(ws, {ws.index(hot): 100 * BLOCK_BYTES})
    fresh = chat("a brand new conversation", system=systems[0])
    assert p.select(ws, info(fresh)) is hot
    later = chat("a brand new conversation", "answer", "and then", system=systems[0])
    assert p.select(ws, info(later)) is not hot


@pytest.mark.parametrize("system", [None, "Be brief."])  # none; one under a block: no preamble
def test_a_first_turn_sharing_nothing_leaves_its_key_home_behind_a_prompts_more_prefill(system):
    """A first turn that shares nothing with other conversations (no system prompt, or one
    too short to cache) costs the same prefill on every worker: it leaves its key's home
    when the home owes more than that prompt's prefill above what a typical candidate
    owes, as a later turn leaves a holder (for a later turn's holder the margin is larger:
    what it would not have prefilled there). Within that margin it stays home, so a
    replica that never saw it finds its next turn where its key says."""
    ws = workers(4)
    question = "a long question " * 200
    doc = no_system(question) if system is None else chat(question, system=system)
    size = info(doc).prefix_blocks().size  # type: ignore[union-attr]

    def placed(owed: dict[int, int] | None = None) -> tuple[Worker | None, str]:
        p = policy()  # a new gateway (replica): the conversation is new to it
        backlogged(ws, {})
        if owed is not None:
            backlogged(ws, owed)
        first = info(doc)
        return p.select(ws, first), first.placed

    home, step = placed()
    assert home is not None and step == "home"
    h = ws.index(home)
    for owed, stays in [(size // 2, True), (size, True), (size + 1, False), (10 * size, False)]:
        worker, step = placed({h: owed})
        assert (worker is home) is stays and step == "home", owed
    # Measured from the typical candidate: all owing alike, it stays.
    assert placed({j: 10 * size for j in range(4)})[0] is home
    assert placed({j: 10 * size for j in range(4)} | {h: 11 * size + 1})[0] is not home


def stats_with(queries: float | None, hits: float | None) -> EngineStats:
    return EngineStats(0, 0, None, 0.0, None, queries, hits)


@pytest.mark.parametrize(
    ("before", "now", "miss"),
    [
        ((1000, 900), (2000, 1900), 0.0),  # all of the last 1000 tokens hit
        ((1000, 900), (2000, 900), 0.25),  # none hit: a quarter of the way to 1
        ((1000, 900), (1000, 900), 0.0),  # nothing sent: nothing learned
        ((5000, 900), (2000, 1900), 0.0),  # counters went back (restarted): skipped
        ((1000, 900), (2000, 2900), 0.0),  # more hits than queries: nonsense, skipped
        ((None, None), (2000, 1000), 0.0),  # no counters before: a first reading only
        ((1000, 900), (None, None), 0.0),  # counters gone
    ],
)
def test_a_workers_miss_share_follows_its_own_prefix_cache_counters(before, now, miss):
    from vllm_gateway.workers import note_cache

    (w,) = workers(1)
    note_cache(w, stats_with(*before), stats_with(*now))
    assert w.miss == pytest.approx(miss)


def test_a_worker_missing_what_the_index_says_it_holds_owes_that_share_of_the_prompt():
    """The index says the holder has the history; its counters say it misses 60% of what
    it is sent (it evicts): it is counted as owing at least that share of the prompt."""
    ws = workers(4)
    backlogged(ws, {})
    p = policy()
    home = p.select(ws, info(chat("q " * 300)))
    later = info(chat("q " * 300, "answer " * 100, "next question"))
    size = later.prefix_blocks().size  # type: ignore[union-attr]
    assert p.select(ws, later) is home and later.prefill < size // 2
    home.miss = 0.6
    again = info(chat("q " * 300, "answer " * 100, "next question"))
    assert p.select(ws, again) is home and again.prefill == int(0.6 * size)


@pytest.mark.parametrize("odd_weight", [0.0, 1e-300, 1e300])
def test_a_backlog_veto_survives_a_worker_of_odd_weight(odd_weight):
    """A worker of weight 0 (speed 0) among the candidates neither switches the backlog
    comparison off (0 x inf is NaN) nor, at an extreme weight, makes it raise."""
    ws = workers(5)
    backlogged(ws, {})
    p = policy()
    holders = [w for w in ws[1:]]
    home = p.select(holders, info(chat("q " * 300)))
    ws[0].weight = odd_weight
    later = chat("q " * 300, "answer " * 100, "next question")
    assert p.select(ws, info(later)) is home
    backlogged(ws, {ws.index(home): 1 << 20})
    ws[0].weight = odd_weight
    assert p.select(ws, info(later)) is not home


def test_a_history_longer_than_the_names_is_counted_held_on_its_holder():
    """Names stop 32 KiB after the key; a worker holding the deepest of them has the
    conversation: it owes about the last block of it, not everything past the names."""
    ws = workers(4)
    backlogged(ws, {})
    p = policy()
    turns = ["q " * 300] + [f"turn {i} " * 2000 for i in range(5)]  # ~50 KB of history
    home = p.select(ws, info(chat(*turns)))
    again = info(chat(*turns, "answer", "next"))
    assert p.select(ws, again) is home
    blocks = again.prefix_blocks()
    assert blocks is not None and blocks.size > 48 * BLOCK_BYTES
    assert again.prefill <= BLOCK_BYTES


def test_only_a_later_turn_stretches_a_guessed_limit():
    """`stretches`: a later turn goes past its history holder's probing limit as the probe
    (its history elsewhere is prefilled again whole); a first turn, a document's question,
    or a prompt without text (token ids) does not."""
    p = policy()
    assert p.stretches(info(chat("hello", "hi there", "and then?")))
    assert not p.stretches(info(chat("hello")))
    assert not p.stretches(info(question(1, 2)))
    assert not p.stretches(info({"model": "m", "prompt": [1, 2, 3]}))


def test_a_conversation_leaves_its_one_holder_once_that_is_set_to_weight_0() -> None:
    # Weight 0 is a last resort: the one holder of a history is not taken at that weight
    # (the shortcut that skips the rendezvous rank for a lone holder must not skip that).
    ws = workers(2)
    policy = CacheAware(random.Random(0))
    first = policy.select(ws, info(no_system("hello there")))
    assert first is not None
    first.weight = 0.0
    turn = info(no_system("hello there", "hi!", "second turn"))
    assert policy.select(ws, turn) is not first
    assert turn.placed != "history"


@pytest.mark.parametrize(
    ("home_free", "other_free", "goes_home"),
    [
        (math.inf, math.inf, True),  # caches not reported: its history's holder
        (10_000.0, 0.0, True),  # room where its history is: there
        (0.0, 10_000.0, False),  # none there, room elsewhere: elsewhere, not stalled
        (0.0, 0.0, True),  # room nowhere: no candidate is left out
        (100.0, 500.0, True),  # room there for what it adds, not elsewhere for all of it
    ],
)
def test_a_worker_without_free_kv_blocks_for_what_it_would_prefill_is_left_out(
    home_free, other_free, goes_home
):
    """vLLM keeps a request waiting while its prompt's blocks do not fit beside those its
    running requests hold, and everyone behind it: a candidate whose free blocks
    (`Worker.kv_free`, tokens) do not hold what the request would prefill there is left
    out, unless that leaves none. Its history's holder adds a block or two; any other
    worker prefills the whole prompt (about 1200 tokens at 4 bytes each)."""
    ws = workers(2)
    p = policy()
    first = chat("q " * 2000)
    home = p.select(ws, info(first))
    other = ws[1] if home is ws[0] else ws[0]
    home.kv_free, other.kv_free = home_free, other_free
    later = chat("q " * 2000, "an answer", "next")
    assert (p.select(ws, info(later)) is home) is goes_home


def test_a_replica_waits_for_the_planned_worker_of_a_preamble_it_never_sent_there():
    """Another replica sent a system prompt's conversations to its planned worker, which
    this replica's plan names too (the same shares), though its own index never saw the
    prompt there: with that worker full and another free, the worker it would rather
    have had is the planned one, as it would be for the replica that sent them."""
    ws = workers(4)
    replica = policy()
    systems = [f"system prompt number {s} " * 60 for s in range(4)]
    for i in range(400):
        body = chat(f"user {i} says hi", system=systems[i % 4])
        if i % 4:
            replica.select(ws, info(body))
        else:  # the other replica's: counted alike, sent where this one never looked
            blocks = prefix_blocks(body)
            assert blocks is not None
            replica.told("m", None, blocks.preamble, blocks.preamble, blocks.blocks)
    first = prefix_blocks(chat("hi", system=systems[0]))
    assert first is not None
    urls = plan_of(replica)[first.preamble][1]
    assert len(urls) == 1 and not any(replica.index.holds(first.preamble, w) for w in ws)
    planned = [w for w in ws if w.url in urls]
    rest = [w for w in ws if w.url not in urls]
    assert replica.preferred(planned, rest, info(chat("a new one", system=systems[0]))) == planned
    # A planned candidate has it as much: nothing to wait for.
    assert (
        replica.preferred(rest[:1], [*planned, *rest[1:]], info(chat("b", system=systems[0]))) == []
    )


def planned_by_the_other_replica(
    ws: list[Worker], system: str, share: float
) -> tuple[CacheAware, int, tuple[int, frozenset[str]]]:
    """A replica that counted `share` of 1000 requests, those with `system`, which the
    other replica sent (its own index never saw them), and sent the rest itself; its plan
    for the system prompt as its next request for it makes it: (replica, preamble, plan)."""
    replica = policy()
    for i in range(1000):
        theirs = (i * share) % 1.0 < share - 1e-9  # `share` of them, spread evenly
        body = chat(f"user {i} says hi", system=system) if theirs else no_system(f"u{i}")
        blocks = prefix_blocks(body)
        assert blocks is not None
        if theirs:  # counted alike, sent where this one never looked
            replica.told("m", None, blocks.preamble, blocks.preamble, blocks.blocks)
        else:
            replica.select(ws, info(body))
    first = prefix_blocks(chat("hi", system=system))
    assert first is not None
    shares = replica.shares["m"]
    counted = shares.counts[first.preamble] / shares.samples
    shares.plan.among(
        first.preamble, counted, shares.samples, ws, shares.counts, replica._ranks.cached
    )
    return replica, first.preamble, plan_of(replica)[first.preamble]


def test_a_planned_worker_that_is_out_leaves_the_others_of_the_plan_preferred():
    """Planned on 2 of 3 workers (60% of the traffic, sent by the other replica), one of
    them out of this pick (a retry excluded it, or it is draining): the other, full, is
    still the worker to wait for rather than the third, which would copy the prompt."""
    ws = workers(3)
    system = "system prompt number P " * 60
    replica, preamble, (want, urls) = planned_by_the_other_replica(ws, system, 0.6)
    assert want == 2 and not any(replica.index.holds(preamble, w) for w in ws)
    out, full = [w for w in ws if w.url in urls]
    (free,) = [w for w in ws if w.url not in urls]
    fresh = info(chat("a new one", system=system))
    assert replica.preferred([full], [free], fresh) == [full]  # `out` is neither
    assert replica.preferred([out, full], [free], fresh) == [out, full]
    assert replica.preferred([free], [out, full], fresh) == []


def test_a_later_turn_another_replica_placed_waits_for_its_planned_workers_not_a_copy():
    """A system prompt planned on one of 4 workers (the other replica sent its requests:
    this one only counted them), and held by another in this replica's index, where its
    overflow went once. A later turn whose earlier turns the other replica placed is not
    known here; every replica sent them to the planned worker while it had room. With it
    full and the copy's holder free, the turn waits for the planned one: on the copy's
    holder it would prefill its history, and keep a second copy of the prompt cached."""
    ws = workers(4)
    system = "system prompt number P " * 60
    replica, preamble, (want, urls) = planned_by_the_other_replica(ws, system, 0.25)
    (planned,) = [w for w in ws if w.url in urls]
    copy, *others = [w for w in ws if w.url not in urls]
    assert want == 1 and not any(replica.index.holds(preamble, w) for w in ws)
    replica.select([copy], info(chat("an overflow", system=system)))  # its only candidate
    assert [w for w in ws if replica.index.holds(preamble, w)] == [copy]
    later = info(chat("a conversation's first turn", "its second turn", system=system))
    fresh = info(chat("a new one", system=system))
    assert replica.preferred([planned], [copy, *others], later) == [planned]
    assert replica.preferred([copy], [planned, *others], later) == []  # the planned is free
    # A new conversation is as well off on the copy's holder: nothing to wait for.
    assert replica.preferred([planned], [copy, *others], fresh) == []
    # The planned worker not in this pick (a retry left it out, it drains): the copy's
    # holder, full, is wanted rather than a worker that would copy the prompt again.
    assert replica.preferred([copy], others, later) == [copy]
    assert replica.preferred([copy], others, fresh) == [copy]
    planned.weight = 0.0  # takes nothing now (the plan is not made again yet): as a first turn
    after = replica.preferred([planned, copy], others, later)
    assert copy in after and after == replica.preferred([planned, copy], others, fresh)

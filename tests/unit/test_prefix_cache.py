"""The fake worker's block pool and tokenizer, without sockets."""

from __future__ import annotations

from vllm_gateway.fake_worker.prefix_cache import PrefixCache, block_hashes
from vllm_gateway.fake_worker.protocol import output_text
from vllm_gateway.fake_worker.tokens import answer_token_id, prompt_token_ids


def test_chained_hashes_share_exactly_the_common_aligned_prefix() -> None:
    a = block_hashes("m", list(range(40)), 8)
    b = block_hashes("m", [*range(20), 99, *range(21, 40)], 8)
    assert len(a) == 5  # full blocks only
    assert a[:2] == b[:2] and not set(a[2:]) & set(b[2:])
    assert not set(block_hashes("other", list(range(40)), 8)) & set(a)
    assert block_hashes("m", list(range(40)), 8) == a  # deterministic


def test_concurrent_identical_prompts_share_blocks_once_computed() -> None:
    cache = PrefixCache(block_size=4, capacity=100)
    first = cache.admit("m", list(range(9)))  # 2 full blocks + 1 partial
    early = cache.admit("m", list(range(9)))  # first is still computing: no hit
    assert (first.hit_tokens, early.hit_tokens) == (0, 0)
    cache.commit(first)
    late = cache.admit("m", list(range(9)))
    assert late.hit_tokens == 8 and late.uncached_tokens == 1
    cache.commit(early)  # shares first's blocks rather than caching its own
    assert cache.blocks_cached == 2
    assert cache.blocks_in_use == 2 + 3 * 1  # the shared full blocks + three partial ones
    for seq in (first, early, late):
        cache.release(seq)
        cache.release(seq)  # twice is harmless
    assert cache.blocks_in_use == 0 and cache.blocks_cached == 2
    assert (cache.queries, cache.hits) == (27, 8)


def test_unbounded_cache_reports_no_usage_and_never_evicts() -> None:
    cache = PrefixCache(block_size=2, capacity=None)
    for i in range(50):
        seq = cache.admit("m", [i, i, i, i, i])
        cache.commit(seq)
        cache.release(seq)
    assert cache.usage() is None and cache.blocks_cached == 100


def test_tokenizer_counts_words_and_folds_roles_into_ids() -> None:
    chat = {"messages": [{"role": "system", "content": "a b"}, {"role": "user", "content": "c"}]}
    as_user = {"messages": [{"role": "user", "content": "a b"}, {"role": "user", "content": "c"}]}
    assert len(prompt_token_ids(chat)) == 3
    ids, user_ids = prompt_token_ids(chat), prompt_token_ids(as_user)
    assert ids[0] != user_ids[0] and ids[1:] == user_ids[1:]
    assert prompt_token_ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_token_ids({"prompt": "x y"}) == prompt_token_ids({"prompt": ["x", "y"]})
    assert prompt_token_ids({"prompt": ""}) == [0]  # never an empty prompt


def test_generated_tokens_fill_blocks_that_a_later_prompt_hits() -> None:
    cache = PrefixCache(block_size=4, capacity=100)
    prompt, answer = list(range(6)), [50, 51, 52, 53, 54]
    seq = cache.admit("m", prompt)
    cache.commit(seq)  # one full prompt block; tokens 4, 5 wait in the tail
    for i in range(len(answer)):  # making token i computes token i-1's KV
        cache.grow(seq, len(prompt) + i + 1, answer[i - 1 : i] if i else ())
    assert cache.blocks_cached == 2  # prompt block + [4, 5, 50, 51]; [52, 53] still partial
    cache.release(seq)
    later = cache.admit("m", prompt + answer + [60, 61, 62])
    assert later.hit_tokens == 8  # the next turn finds the answer's full block
    # The answer's last token never had its KV computed: no block ends with it.
    assert block_hashes("m", prompt + answer[:2], 4)[1] in cache._refs
    cache.release(later)


def test_a_generated_block_another_sequence_cached_is_shared() -> None:
    cache = PrefixCache(block_size=4, capacity=100)
    first = cache.admit("m", [1, 2])
    cache.commit(first)
    cache.grow(first, 5, [3, 4])  # fills [1, 2, 3, 4]
    other = cache.admit("m", [1, 2, 3, 4, 9])  # hits it, and holds its own tail
    assert other.hit_tokens == 4
    second = cache.admit("m", [1, 2])
    cache.commit(second)
    cache.grow(second, 5, [3, 4])  # the same block: shared, not cached twice
    assert cache.blocks_cached == 1
    assert cache.blocks_in_use == 1 + 1 + 1 + 1  # shared block + each sequence's partial one
    for seq in (first, other, second):
        cache.release(seq)
    assert cache.blocks_in_use == 0 and cache.blocks_cached == 1


def test_answer_token_ids_are_the_answer_as_a_later_prompt_quotes_it() -> None:
    text = output_text(5)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}]}
    said = [answer_token_id(i, "assistant") for i in range(5)]
    plain = [answer_token_id(i) for i in range(5)]
    assert prompt_token_ids(chat)[1:] == said
    assert prompt_token_ids({"prompt": "hi" + text})[1:] == plain
    assert said[0] != plain[0] and said[1:] == plain[1:]


def test_a_claim_is_refused_when_its_blocks_do_not_fit_beside_running_ones() -> None:
    cache = PrefixCache(block_size=4, capacity=6)
    running = cache.claim("m", list(range(16)))  # 4 blocks
    assert running is not None and cache.blocks_in_use == 4
    # 3 more blocks do not fit beside 4 of 6: refused, nothing held or counted.
    assert cache.claim("m", list(range(100, 112))) is None
    assert cache.blocks_in_use == 4 and cache.queries == 0
    assert cache.claim("m", list(range(100, 108))) is not None  # 2 do
    forced = cache.claim("m", list(range(200, 212)), force=True)
    assert forced is not None and cache.blocks_in_use == 9  # past the capacity, as asked


def test_cached_blocks_nobody_uses_are_free_but_not_the_ones_a_claim_hits() -> None:
    cache = PrefixCache(block_size=4, capacity=6)
    done = cache.admit("m", list(range(17)))  # 4 full blocks + 1 partial
    cache.commit(done)
    cache.release(done)
    assert (cache.blocks_in_use, cache.blocks_cached) == (0, 4)
    # Another prompt of 6 blocks fits: the 4 cached ones are evicted for it.
    other = cache.claim("m", list(range(50, 74)))
    assert other is not None and cache.blocks_cached == 0
    cache.release(other)
    again = cache.admit("m", list(range(17)))
    cache.commit(again)
    cache.release(again)  # 4 cached again (and 2 empty)
    # Hitting 4 cached blocks pins them: with 3 more (new ones) it needs 7 of 6.
    assert cache.claim("m", [*range(16), *range(300, 309)]) is None
    hit = cache.claim("m", [*range(16), *range(300, 305)])  # 4 hit + 2 new
    assert hit is not None and hit.hit_tokens == 16 and cache.blocks_in_use == 6


def test_a_refresh_takes_the_blocks_computed_since_the_claim_as_hits() -> None:
    cache = PrefixCache(block_size=4, capacity=100)
    first = cache.claim("m", list(range(9)))
    second = cache.claim("m", list(range(9)))  # first is still computing: nothing hit
    assert first is not None and second is not None
    assert second.hit_tokens == 0 and cache.blocks_in_use == 6
    cache.refresh(first)
    cache.commit(first)
    cache.refresh(second)  # its prefill starts after first's: 2 blocks hit now
    assert second.hit_tokens == 8 and second.uncached_tokens == 1
    assert cache.blocks_in_use == 2 + 2  # shared full blocks, each its partial one
    assert (cache.queries, cache.hits) == (18, 8)
    for seq in (first, second):
        cache.release(seq)
    assert cache.blocks_in_use == 0 and cache.blocks_cached == 2

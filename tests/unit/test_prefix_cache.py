"""The fake worker's block pool and tokenizer, without sockets."""

from __future__ import annotations

from vllm_gateway.fake_worker.prefix_cache import PrefixCache, block_hashes
from vllm_gateway.fake_worker.tokens import prompt_token_ids


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

"""KV-cache blocks: allocation, freeing, prefix caching, LRU eviction, integrity checks.

No model: requests are token lists, and "computing" a request's tokens is just what
`allocate_slots` records (the manager caches a full block's hash as soon as its slots are
allocated, since the step that fills it runs before any later lookup).
"""

from __future__ import annotations

import pytest

from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request
from ember.sampling_params import SamplingParams

BS = 16


def make_request(request_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(), 16, cache_salt=cache_salt)


def compute_prompt(kv: KVCacheManager, request: Request) -> list[int]:
    """Admits a request as the scheduler would (prefix hits + the rest) and computes it all."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    kv.record_admission(request, num_hit)
    request.num_computed_tokens = request.num_tokens
    return kv.block_ids(request.request_id)


def num_hit_tokens(kv: KVCacheManager, token_ids: list[int], cache_salt: str | None = None) -> int:
    return kv.get_computed_blocks(make_request("probe", token_ids, cache_salt))[1]


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---------------------------------------------------------------- allocation and freeing


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 40, 160])
def test_allocate_slots_gives_one_block_per_block_size_tokens(num_tokens):
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    request = make_request("a", tokens(0, num_tokens))
    new_blocks = kv.allocate_slots(request, num_tokens)
    num_expected = -(-num_tokens // BS)
    assert new_blocks is not None and len(new_blocks) == num_expected
    assert kv.block_ids("a") == [b.block_id for b in new_blocks]
    assert len(set(kv.block_ids("a"))) == num_expected
    assert kv.num_free_blocks == 10 - num_expected
    assert kv.check_integrity()


def test_decode_takes_a_new_block_only_when_the_last_one_is_full():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    request = make_request("a", tokens(0, 30))
    assert len(kv.allocate_slots(request, 30)) == 2
    request.num_computed_tokens = 30
    for num_new_blocks in [0, 0, 1]:  # tokens 31 and 32 fill block 2, token 33 opens block 3
        request.token_ids.append(7)
        assert len(kv.allocate_slots(request, 1)) == num_new_blocks
        request.num_computed_tokens += 1
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 1
    assert kv.check_integrity()


def test_allocate_slots_returns_none_and_changes_nothing_when_out_of_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", tokens(0, 32))
    compute_prompt(kv, a)
    b = make_request("b", tokens(100, 48))
    assert kv.allocate_slots(b, 48) is None
    assert kv.num_free_blocks == 2 and kv.block_ids("b") == []
    assert kv.check_integrity()
    # A running request that needs more than is free gets nothing either.
    assert kv.allocate_slots(a, 3 * BS) is None
    assert len(kv.block_ids("a")) == 2 and kv.num_free_blocks == 2
    assert kv.allocate_slots(b, 32) is not None  # exactly what is left still fits
    assert kv.num_free_blocks == 0 and kv.check_integrity()


def test_failed_admission_with_prefix_hits_leaves_the_hit_blocks_cached_and_free():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", tokens(0, 32))
    compute_prompt(kv, a)
    kv.free(a)
    b = make_request("b", tokens(0, 32) + tokens(500, 48))  # 2 hits + 3 new blocks > 4 - 2
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert kv.num_free_blocks == 4 and all(block.ref_cnt == 0 for block in hits)
    assert kv.check_integrity()
    assert num_hit_tokens(kv, tokens(0, 33)) == 32  # nothing was evicted


def test_hit_blocks_taken_from_the_free_queue_are_not_counted_as_free_room():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", tokens(0, 32))
    compute_prompt(kv, a)
    kv.free(a)
    b = make_request("b", tokens(0, 32) + tokens(500, 32))  # 2 hits + exactly 2 new blocks
    hits, num_hit = kv.get_computed_blocks(b)
    new_blocks = kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert new_blocks is not None and len(new_blocks) == 2
    assert kv.block_ids("b")[:2] == [block.block_id for block in hits]
    assert len(set(kv.block_ids("b"))) == 4 and kv.num_free_blocks == 0
    assert kv.check_integrity()


def test_free_returns_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    requests = [make_request(str(i), tokens(100 * i, 20 + 7 * i)) for i in range(3)]
    for request in requests:
        compute_prompt(kv, request)
    assert kv.num_free_blocks == 8 - (2 + 2 + 3)  # 20, 27 and 34 tokens
    for request in requests:
        kv.free(request)
        assert kv.block_ids(request.request_id) == []
        assert kv.check_integrity()
    assert kv.num_free_blocks == 8 and kv.usage == 0.0


def test_double_free_of_a_block_is_caught():
    kv = KVCacheManager(num_blocks=2, block_size=BS, enable_prefix_caching=False)
    blocks = kv.pool.allocate(1)
    kv.pool.free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        kv.pool.free(blocks)


def test_pool_rejects_an_empty_cache():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=BS, enable_prefix_caching=True)


# ---------------------------------------------------------------- prefix caching


def test_request_sharing_the_first_40_tokens_gets_two_cached_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    prefix = tokens(0, 40)
    a = make_request("a", prefix + tokens(900, 10))
    a_blocks = compute_prompt(kv, a)
    b = make_request("b", prefix + tokens(700, 25))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32
    assert [block.block_id for block in hits] == a_blocks[:2]
    # Only whole blocks are shared: 20 common tokens give one block.
    assert num_hit_tokens(kv, tokens(0, 20) + tokens(300, 20)) == 16
    assert num_hit_tokens(kv, tokens(1, 40)) == 0


def test_hit_is_found_as_soon_as_the_first_request_slots_are_allocated():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", tokens(0, 50))
    assert num_hit_tokens(kv, tokens(0, 50)) == 0
    kv.allocate_slots(a, 20)  # a first chunk: block 0 full, block 1 partial
    assert num_hit_tokens(kv, tokens(0, 50)) == 16
    a.num_computed_tokens = 20
    kv.allocate_slots(a, 30)
    assert num_hit_tokens(kv, tokens(0, 50)) == 48


@pytest.mark.parametrize(("num_tokens", "num_expected"), [(32, 16), (33, 32), (16, 0), (17, 16)])
def test_at_least_one_token_is_left_to_compute(num_tokens, num_expected):
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    compute_prompt(kv, make_request("a", tokens(0, 64)))
    assert num_hit_tokens(kv, tokens(0, num_tokens)) == num_expected


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    compute_prompt(kv, make_request("a", tokens(0, 40), cache_salt="alice"))
    assert num_hit_tokens(kv, tokens(0, 40), cache_salt="alice") == 32
    assert num_hit_tokens(kv, tokens(0, 40), cache_salt="bob") == 0
    assert num_hit_tokens(kv, tokens(0, 40)) == 0


def test_a_block_is_keyed_by_its_whole_prefix_not_its_own_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    compute_prompt(kv, make_request("a", tokens(0, 16) + tokens(50, 16) + [1]))
    # Same second block after a different first block: no hit at all.
    assert num_hit_tokens(kv, tokens(200, 16) + tokens(50, 16) + [1]) == 0


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", tokens(0, 40))
    compute_prompt(kv, a)
    kv.free(a)
    assert num_hit_tokens(kv, tokens(0, 40)) == 0
    assert all(block.block_hash is None for block in kv.pool.blocks)


def test_freed_blocks_keep_their_hash_and_are_hit_again():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", tokens(0, 40))
    a_blocks = compute_prompt(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 10
    b = make_request("b", tokens(0, 40))
    b_blocks = compute_prompt(kv, b)
    assert b_blocks[:2] == a_blocks[:2]
    assert kv.num_free_blocks == 10 - 3  # the two reclaimed blocks are in use again
    assert kv.check_integrity()


def test_shared_blocks_are_ref_counted():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a, b = make_request("a", tokens(0, 40)), make_request("b", tokens(0, 40) + [9])
    a_blocks, b_blocks = compute_prompt(kv, a), compute_prompt(kv, b)
    shared = a_blocks[:2]
    assert b_blocks[:2] == shared and set(a_blocks[2:]).isdisjoint(b_blocks[2:])
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert kv.num_free_blocks == 10 - 4
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert kv.num_free_blocks == 10 - 3  # only a's private block came back
    assert kv.check_integrity()
    kv.free(b)
    assert kv.num_free_blocks == 10 and kv.check_integrity()


def test_identical_prompts_computed_at_once_do_not_both_claim_a_hash():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a, b = make_request("a", tokens(0, 32)), make_request("b", tokens(0, 32))
    kv.allocate_slots(a, 32)
    kv.allocate_slots(b, 32)  # no lookup: computes its own copy
    assert kv.check_integrity()
    kv.free(a)
    kv.free(b)
    assert num_hit_tokens(kv, tokens(0, 33)) == 32 and kv.check_integrity()


def test_eviction_takes_unhashed_blocks_first_then_the_least_recently_freed():
    bs = 4
    kv = KVCacheManager(num_blocks=4, block_size=bs, enable_prefix_caching=True)
    old, new = make_request("old", tokens(0, 4)), make_request("new", tokens(100, 6))
    compute_prompt(kv, old)  # block 0, hashed
    kv.free(old)
    compute_prompt(kv, new)  # blocks 1 (hashed) and 2 (partial: no hash)
    kv.free(new)
    assert num_hit_tokens(kv, tokens(0, 5)) == 4 and num_hit_tokens(kv, tokens(100, 5)) == 4

    def take_one(request_id: str) -> int:
        (block,) = kv.allocate_slots(make_request(request_id, [7]), 1)
        return block.block_id

    # Never-used block 3 and new's partial block 2 go before any cached block.
    assert {take_one("x"), take_one("y")} == {2, 3}
    assert num_hit_tokens(kv, tokens(0, 5)) == 4 and num_hit_tokens(kv, tokens(100, 5)) == 4
    assert take_one("z") == 0  # old's block was freed longest ago
    assert num_hit_tokens(kv, tokens(0, 5)) == 0 and num_hit_tokens(kv, tokens(100, 5)) == 4
    assert take_one("w") == 1
    assert num_hit_tokens(kv, tokens(100, 5)) == 0
    assert kv.check_integrity()


def test_a_request_last_blocks_are_evicted_before_its_first_ones():
    bs = 4
    kv = KVCacheManager(num_blocks=3, block_size=bs, enable_prefix_caching=True)
    a = make_request("a", tokens(0, 12))
    compute_prompt(kv, a)
    kv.free(a)
    assert num_hit_tokens(kv, tokens(0, 13)) == 12
    kv.allocate_slots(make_request("x", [7]), 1)
    assert num_hit_tokens(kv, tokens(0, 13)) == 8  # lost the tail, kept the shared head
    kv.allocate_slots(make_request("y", [7]), 1)
    assert num_hit_tokens(kv, tokens(0, 13)) == 4


def test_a_hit_refreshes_a_block_so_it_outlives_older_ones():
    bs = 4
    kv = KVCacheManager(num_blocks=3, block_size=bs, enable_prefix_caching=True)
    first, second = make_request("first", tokens(0, 4)), make_request("second", tokens(50, 4))
    compute_prompt(kv, first)
    compute_prompt(kv, second)
    kv.free(first)
    kv.free(second)
    reuse = make_request("reuse", tokens(0, 4) + [1])  # hits first's block, frees it last
    compute_prompt(kv, reuse)
    kv.free(reuse)
    kv.allocate_slots(make_request("x", tokens(900, 8)), 8)  # evicts two blocks
    assert num_hit_tokens(kv, tokens(0, 5)) == 4
    assert num_hit_tokens(kv, tokens(50, 5)) == 0


def test_reset_prefix_cache_only_when_idle_then_forgets_everything():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    a, b = make_request("a", tokens(0, 40)), make_request("b", tokens(100, 40))
    compute_prompt(kv, a)
    compute_prompt(kv, b)
    kv.free(a)
    assert kv.reset_prefix_cache() is False  # b still holds blocks
    assert num_hit_tokens(kv, tokens(0, 40)) == 32
    kv.free(b)
    assert kv.reset_prefix_cache() is True
    assert num_hit_tokens(kv, tokens(0, 40)) == 0 and num_hit_tokens(kv, tokens(100, 40)) == 0
    assert kv.num_free_blocks == 10 and kv.check_integrity()
    compute_prompt(kv, make_request("c", tokens(0, 40)))  # caching still works afterwards
    assert num_hit_tokens(kv, tokens(0, 40)) == 32


def test_prefix_cache_stats_count_prompt_tokens_and_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    compute_prompt(kv, make_request("a", tokens(0, 40)))
    compute_prompt(kv, make_request("b", tokens(0, 40)))
    assert (kv.stats.queries, kv.stats.hits) == (80, 32)


# ---------------------------------------------------------------- check_integrity


def _busy_manager() -> tuple[KVCacheManager, Request]:
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", tokens(0, 40))
    compute_prompt(kv, a)
    compute_prompt(kv, make_request("b", tokens(0, 40)))
    kv.free(a)
    assert kv.check_integrity()
    return kv, a


def test_check_integrity_catches_a_wrong_ref_cnt():
    kv, _ = _busy_manager()
    block = kv.pool.blocks[kv.block_ids("b")[0]]
    block.ref_cnt += 1
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_check_integrity_catches_a_used_block_in_the_free_queue():
    kv, _ = _busy_manager()
    block = kv.pool.blocks[kv.block_ids("b")[0]]
    kv.pool.free_queue[block.block_id] = block
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_check_integrity_catches_a_stale_hash_map():
    kv, _ = _busy_manager()
    hashed = [b for b in kv.pool.blocks if b.block_hash is not None]
    hashed[0].block_hash, hashed[1].block_hash = hashed[1].block_hash, hashed[0].block_hash
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_check_integrity_catches_a_block_table_entry_without_a_reference():
    kv, _ = _busy_manager()
    kv.req_block_ids["ghost"] = [kv.block_ids("b")[0]]
    with pytest.raises(AssertionError):
        kv.check_integrity()

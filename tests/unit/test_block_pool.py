from __future__ import annotations

from infer.kv_cache.block_pool import BlockPool
from infer.kv_cache.manager import PagedKVManager

from ._factories import make_request


def test_allocate_and_free_return_every_block():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert blocks is not None and pool.num_free_blocks == 3
    assert pool.allocate(4) is None  # all-or-nothing
    pool.free(blocks)
    assert pool.num_free_blocks == 8 and all(b.ref_count == 0 for b in pool.blocks)


def test_chained_hash_same_tokens_under_other_prefix_never_hit():
    pool = BlockPool(8, enable_caching=True)
    a, b = pool.allocate(2)
    ha = pool.cache_block(a, None, [1, 2], ())
    pool.cache_block(b, ha, [3, 4], ())
    assert pool.lookup(ha, [3, 4], ()) is b
    other = pool.cache_block(pool.allocate(1)[0], None, [9, 9], ())
    assert pool.lookup(other, [3, 4], ()) is None  # same tokens, different parent
    assert pool.lookup(None, [3, 4], ()) is None


def test_hash_collision_is_guarded_by_token_comparison():
    pool = BlockPool(4, enable_caching=True, hash_fn=lambda parent, toks, extra: 42)
    (a,) = pool.allocate(1)
    pool.cache_block(a, None, [1, 2], ())
    assert pool.lookup(None, [1, 2], ()) is a
    assert pool.lookup(None, [5, 6], ()) is None  # same hash, other tokens: no wrong KV


def test_freed_cached_blocks_stay_revivable_and_evict_lru_first():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.allocate(3)
    hashes = [pool.cache_block(b, None, [i], ()) for i, b in enumerate(blocks)]
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    assert pool.num_cached_blocks == 3 and pool.num_free_blocks == 3
    revived = pool.lookup(None, [0], ())
    assert revived is blocks[0]
    pool.touch([revived])
    assert revived.ref_count == 1 and pool.num_free_blocks == 2
    (new,) = pool.allocate(1)  # evicts the least recently freed: block 1
    assert new is blocks[1] and pool.lookup(None, [1], ()) is None
    assert pool.stats.evictions == 1
    assert pool.lookup(None, [2], ()) is blocks[2]
    assert hashes[2] == blocks[2].block_hash


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.cache_block(a, None, [1], ())
    assert pool.reset_prefix_cache() is False
    pool.free([a])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(None, [1], ()) is None and pool.num_cached_blocks == 0


def _admit(kv: PagedKVManager, req) -> int:
    hit = kv.lookup_prefix(req)
    assert kv.allocate(req, req.num_tokens - hit.num_blocks * kv.block_size, hit)
    req.num_computed_tokens = req.num_tokens
    kv.commit_full_blocks(req)
    return hit.num_blocks


def test_a_collision_never_lets_a_later_block_pass_for_the_other_prefixs():
    """Two requests whose first blocks differ but hash alike (a weak hash stands in for a
    crafted 64-bit collision): the second one's later blocks are not cached under the first
    one's chain, so a prompt of the first one's block 1 and the second one's block 2 tokens
    hits only block 1 (block 2's KV was computed after other tokens). The chain goes on
    through a swap; every block comes back."""
    kv = PagedKVManager(16, 4, enable_prefix_caching=True, num_swap_blocks=8)
    kv.pool.hash_fn = lambda parent, toks, extra: hash((parent, sum(toks), extra))
    a = make_request("a", prompt=[1, 2, 3, 4, 5, 5, 5, 5, 7])
    b = make_request("b", prompt=[4, 3, 2, 1, 9, 9, 9, 9, 7, 8, 8, 8, 8, 7])
    for r in (a, b):  # in one step: both compute their blocks
        assert kv.allocate(r, r.num_prompt_tokens)
    for r in (a, b):
        r.num_computed_tokens = 9
        kv.commit_full_blocks(r)
    assert kv.swap_out(b) is not None and kv.swap_in(b, 5) is not None
    b.num_computed_tokens = 14
    kv.commit_full_blocks(b)  # block 3, after the swap: still not cached
    assert len(kv._hashes["b"]) == 3
    for r in (a, b):
        kv.free(r)
    c = make_request("c", prompt=[1, 2, 3, 4, 9, 9, 9, 9, 7])
    assert kv.lookup_prefix(c).num_blocks == 1
    again = make_request("a2", prompt=[1, 2, 3, 4, 5, 5, 5, 5, 7])
    assert kv.lookup_prefix(again).num_blocks == 2  # the first chain is cached as it was
    kv.end_step()
    assert kv.num_free_blocks == 16 and kv.num_free_swap_blocks == 8


def test_manager_prefix_hit_never_covers_last_token_and_salt_isolates():
    kv = PagedKVManager(32, 4, enable_prefix_caching=True)
    prompt = list(range(1, 13))  # 12 tokens = 3 full blocks
    first = make_request("a", prompt=prompt)
    assert _admit(kv, first) == 0
    second = make_request("b", prompt=prompt)
    assert _admit(kv, second) == 2  # not 3: the last token must be recomputed
    salted = make_request("c", prompt=prompt, salt="tenant-2")
    assert _admit(kv, salted) == 0
    for r in (first, second, salted):
        kv.free(r)
    assert kv.num_free_blocks == 32


def test_manager_eviction_under_pressure_then_everything_returned():
    kv = PagedKVManager(4, 4, enable_prefix_caching=True)
    a = make_request("a", prompt=list(range(1, 17)))  # 4 blocks: the whole pool
    _admit(kv, a)
    kv.free(a)
    assert kv.pool.num_cached_blocks == 4
    b = make_request("b", prompt=list(range(100, 116)))
    assert _admit(kv, b) == 0  # all four cached blocks evicted lazily to make room
    assert kv.prefix_stats.evictions == 4
    kv.free(b)
    assert kv.num_free_blocks == 4


def test_block_states_marks_used_cached_and_empty():
    pool = BlockPool(4, enable_caching=True)
    a, b, _ = pool.allocate(3)
    pool.cache_block(a, None, [1, 2], ())
    pool.free([a])
    assert pool.block_states() == "cuu."
    pool.free([b])
    assert pool.block_states() == "c.u."


def test_an_images_blocks_are_keyed_by_its_digest():
    """The same placeholder tokens with another image share only the blocks before the image's
    first placeholder; the same image shares every block; a block that holds the end of an
    image and text after it is the image's too."""
    from infer.core.multimodal import ImageInput, block_image_keys

    IMG = 999  # prompt: 5 text tokens, an image of 6 placeholders (5..10), 5 text tokens
    prompt = [1, 2, 3, 4, 5] + [IMG] * 6 + [6, 7, 8, 9, 10]

    def with_image(rid: str, digest: str):
        r = make_request(rid, prompt=prompt)
        r.images = (ImageInput(5, 6, digest, None),)
        return r

    kv = PagedKVManager(32, 4, enable_prefix_caching=True)
    first = with_image("a", "cat")
    assert _admit(kv, first) == 0
    assert _admit(kv, with_image("b", "dog")) == 1  # block 0 (tokens 0..3) only
    assert _admit(kv, with_image("c", "cat")) == 3  # all but the block of the last token
    assert _admit(kv, make_request("d", prompt=prompt)) == 1  # (placeholders with no image)
    for rid in "abcd":
        kv.free(make_request(rid))
    assert kv.num_free_blocks == 32
    assert block_image_keys(first.images, 8, 12) == (("image", "cat"),)
    assert block_image_keys(first.images, 12, 16) == ()
    assert block_image_keys(first.images, 0, 4) == ()

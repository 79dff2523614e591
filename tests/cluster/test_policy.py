"""The routing policies and the block hashing they route by (pure Python: no ray, no engine)."""

from __future__ import annotations

import pytest

from infer.cluster.policy import (
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    make_policy,
    prompt_block_hashes,
)
from infer.kv_cache.manager import PagedKVManager


def test_block_hashes_are_the_prefix_caches_own():
    """The router's hashes of a prompt equal the ones the prefix cache stores for it."""
    from infer.core.request import Request
    from infer.core.sampling_params import SamplingParams

    tokens = list(range(100, 150))  # 50 tokens: 3 full blocks of 16, the 4th partial
    manager = PagedKVManager(16, block_size=16, enable_prefix_caching=True)
    for salt in (None, "tenant-a"):
        request = Request(f"r-{salt}", tokens, SamplingParams(max_tokens=1), cache_salt=salt)
        assert manager.allocate(request, len(tokens))
        request.num_computed_tokens = len(tokens)
        manager.commit_full_blocks(request)
        assert prompt_block_hashes(tokens, 16, salt) == manager._hashes[request.request_id]
        # and the cache finds the blocks the router hashed, under those very hashes
        again = Request(f"again-{salt}", tokens, SamplingParams(max_tokens=1), cache_salt=salt)
        assert manager.lookup_prefix(again).hashes == prompt_block_hashes(tokens, 16, salt)


def test_block_hashes_chain_salt_and_last_token():
    a = prompt_block_hashes(list(range(33)), 16)
    assert len(a) == 2
    # same second block under another first block: another hash (chained)
    b = prompt_block_hashes([7] * 16 + list(range(16, 33)), 16)
    assert a[1] != b[1]
    assert prompt_block_hashes(list(range(33)), 16, "salt") != a
    # a prompt that fills its blocks exactly: the last one holds the final token, never a hit
    assert len(prompt_block_hashes(list(range(32)), 16)) == 1
    assert prompt_block_hashes([], 16) == []
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes([1, 2], 0)


def test_round_robin_cycles():
    p = RoundRobin(3)
    assert [p.choose().replica for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_counts_in_flight_and_alternates_on_ties():
    p = LeastLoaded(2)
    picks = []
    for _ in range(4):  # one at a time: each finishes before the next
        r = p.choose().replica
        p.start(r)
        p.finish(r)
        picks.append(r)
    assert picks == [0, 1, 0, 1]
    p.start(0)
    p.start(0)
    p.start(1)
    assert p.choose().replica == 1
    p.finish(0)
    p.finish(0)
    assert p.choose().replica == 0
    with pytest.raises(ValueError, match="no request in flight"):
        p.finish(0)


def test_prefix_aware_follows_the_longest_match():
    p = PrefixAware(2, max_load_gap=100)
    a = prompt_block_hashes(list(range(64)) + [1], 16)
    b = prompt_block_hashes(list(range(1000, 1064)) + [1], 16)
    first = p.choose(a)
    assert first.reason == "least-loaded" and first.replica == 0
    p.start(0, a)
    second = p.choose(b)
    assert second.replica == 1  # a new prefix goes to the less loaded replica
    p.start(1, b)
    for _ in range(3):
        d = p.choose(a)
        assert (d.replica, d.reason, d.matched_blocks) == (0, "prefix-hit", 4)
        p.start(d.replica, a)
    # a prompt sharing only a's first two blocks still goes where they are
    partial = a[:2] + prompt_block_hashes(list(range(32)) + [9] * 33, 16)[2:]
    d = p.choose(partial)
    assert (d.replica, d.matched_blocks) == (0, 2)
    assert p.choose([]).reason == "no-prefix"


def test_prefix_aware_overflows_to_the_least_loaded():
    p = PrefixAware(2, max_load_gap=2)
    a = prompt_block_hashes(list(range(40)), 16)
    picks = []
    for _ in range(6):  # nothing finishes: the holder's load grows
        d = p.choose(a)
        p.start(d.replica, a)
        picks.append((d.replica, d.reason))
    assert picks[:4] == [(0, "least-loaded"), (0, "prefix-hit"), (0, "prefix-hit"),
                         (1, "overloaded")]  # fmt: skip
    # replica 1 now holds the prefix too: the hit goes to the less loaded holder
    assert picks[4] == (1, "prefix-hit")
    assert p.held[1].keys() == p.held[0].keys()


def test_prefix_aware_forgets_least_recently_sent_blocks():
    p = PrefixAware(1, capacity_blocks=3)
    a = prompt_block_hashes(list(range(33)), 16)  # 2 blocks
    b = prompt_block_hashes(list(range(500, 533)), 16)  # 2 blocks
    p.start(0, a)
    p.start(0, b)
    assert list(p.held[0]) == [a[1], b[0], b[1]]
    assert p.matched(0, a) == 0 and p.matched(0, b) == 2


def test_make_policy_and_bad_arguments():
    assert isinstance(make_policy("prefix", 2, capacity_blocks=8), PrefixAware)
    assert isinstance(make_policy("round-robin", 2), RoundRobin)
    assert isinstance(make_policy("least-loaded", 2), LeastLoaded)
    with pytest.raises(ValueError, match="unknown router policy 'random'"):
        make_policy("random", 2)
    with pytest.raises(ValueError, match="at least one replica"):
        RoundRobin(0)
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixAware(2, capacity_blocks=0)
    with pytest.raises(ValueError, match="max_load_gap"):
        PrefixAware(2, max_load_gap=-1)


def test_new_prefixes_spread_over_the_caches_whatever_came_before():
    p = PrefixAware(2)
    for _ in range(5):  # earlier traffic without a prefix, all on replica 0
        p.start(0)
        p.finish(0)
    picks = []
    for k in range(8):  # one at a time: loads are equal, the caches decide
        hashes = prompt_block_hashes([k + 10] * 40, 16)
        d = p.choose(hashes)
        p.start(d.replica, hashes)
        p.finish(d.replica)
        picks.append(d.replica)
    assert sorted(picks) == [0] * 4 + [1] * 4

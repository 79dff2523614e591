"""Prefix caching skips work without changing a single token."""

from __future__ import annotations

import pytest

from infer import SamplingParams

from .conftest import PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant that answers questions about the Python language reference. "
    "Quote the documentation where you can and keep answers short. "
)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=4),
        dict(block_size=4, prefill_chunk_size=5, max_num_seqs=3),
        dict(block_size=8, max_num_seqs=1),
        dict(block_size=2, prefill_chunk_size=64),
    ],
)
def test_shared_prefix_outputs_identical_and_prefill_skipped(options, make_llm):
    prompts = [SYSTEM + p for p in PROMPTS]
    plain = _ids(make_llm("llama", **options).generate(prompts, GREEDY))
    llm = make_llm("llama", enable_prefix_caching=True, **options)
    first = llm.generate(prompts[:1], GREEDY)  # warm the shared prefix
    rest = llm.generate(prompts[1:], GREEDY)
    assert _ids(first + rest) == plain
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits_total > 0
    bs = options["block_size"]
    shared_blocks = len(llm.tokenizer.encode(SYSTEM, add_special_tokens=False)) // bs
    assert all(r.num_cached_tokens >= (shared_blocks - 1) * bs for r in rest)


def test_blocks_of_a_request_that_ends_in_its_prefill_step_are_cached(make_llm):
    llm = make_llm("llama", enable_prefix_caching=True, block_size=4)
    prompt = list(range(10, 110))
    one = SamplingParams(max_tokens=1, temperature=0)
    assert llm.generate([prompt], one)[0].num_cached_tokens == 0
    # All but the block holding the last prompt token (never served from the cache).
    assert llm.generate([prompt], one)[0].num_cached_tokens == 96


def test_multi_turn_reuses_previous_turn_including_decoded_blocks(make_llm):
    llm = make_llm("llama", enable_prefix_caching=True, block_size=4)
    ref = make_llm("llama", block_size=4)
    tok = llm.tokenizer
    history = tok.encode(SYSTEM + "What is a list?", add_special_tokens=False)
    prev_len = 0
    for turn in range(3):
        out = llm.generate([history], GREEDY)[0]
        assert out.outputs[0].token_ids == ref.generate([history], GREEDY)[0].outputs[0].token_ids
        if turn > 0:
            # Everything up to the previous turn's answer (minus its unfed last token) was cached.
            assert out.num_cached_tokens >= (prev_len // 4) * 4 - 4
        prev_len = len(history) + len(out.outputs[0].token_ids) - 1
        history = (
            history + out.outputs[0].token_ids + tok.encode(" And then?", add_special_tokens=False)
        )


def test_eviction_heavy_workload_stays_correct(make_llm):
    prompts = [SYSTEM + p for p in PROMPTS] * 2
    plain = _ids(make_llm("llama", block_size=4, max_num_seqs=4).generate(prompts, GREEDY))
    llm = make_llm(
        "llama", enable_prefix_caching=True, block_size=4, max_num_seqs=4, num_kv_blocks=48
    )
    got = _ids(llm.generate(prompts, GREEDY))
    assert got == plain
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_evictions_total > 0 and stats.prefix_cache_hits_total > 0


def test_cache_salt_isolates_tenants(make_llm):
    llm = make_llm("llama", enable_prefix_caching=True, block_size=4)
    prompt = SYSTEM + PROMPTS[0]
    llm.generate([prompt], GREEDY, cache_salt="tenant-a")
    other = llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    same = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert other.num_cached_tokens == 0 and same.num_cached_tokens > 0


def test_reset_prefix_cache(make_llm):
    llm = make_llm("llama", enable_prefix_caching=True, block_size=4)
    prompt = SYSTEM + PROMPTS[1]
    llm.generate([prompt], GREEDY)
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens > 0

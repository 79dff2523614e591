"""Greedy outputs are token-identical to transformers whatever the batching, KV layout,
chunking or arrival order, and for every architecture."""

from __future__ import annotations

import pytest

from infer import SamplingParams

from .conftest import GEN_TOKENS, PROMPTS

GREEDY = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3", "gpt2"]


@pytest.mark.parametrize("kind", ARCHS)
def test_greedy_matches_transformers_for_every_architecture(kind, make_llm, hf_greedy):
    llm = make_llm(kind, block_size=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(kind)


MODES = {
    "batch1": dict(max_num_seqs=1),
    "batch3": dict(max_num_seqs=3),
    "batch8": dict(max_num_seqs=8),
    "batch32": dict(max_num_seqs=32),
    "chunk1": dict(prefill_chunk_size=1),
    "chunk7": dict(prefill_chunk_size=7, block_size=4),
    "chunk64": dict(prefill_chunk_size=64),
    "chunk_none_tight_budget": dict(max_num_batched_tokens=16),
    "contiguous": dict(kv_cache_backend="contiguous"),
    "static": dict(batching_mode="static", max_num_seqs=5),
    "static_contiguous": dict(
        batching_mode="static", kv_cache_backend="contiguous", max_num_seqs=4
    ),
    "no_kv_cache": dict(use_kv_cache=False),
    "block1": dict(block_size=1),
    "prefix_cache": dict(enable_prefix_caching=True, block_size=4),
    "tiny_pool_preempts": dict(num_kv_blocks=24, block_size=4, max_num_seqs=12),
    "priority_policy": dict(scheduling_policy="priority"),
    "tiny_pool_swaps": dict(
        num_kv_blocks=24, block_size=4, max_num_seqs=12, preemption_mode="swap"
    ),
    "swap_space_full_falls_back": dict(
        num_kv_blocks=24, block_size=4, max_num_seqs=12, preemption_mode="swap", swap_space=4096
    ),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_identical_across_modes(mode, make_llm, hf_greedy):
    llm = make_llm("llama", **MODES[mode])
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy("llama")
    counters = llm.engine.scheduler.counters
    if mode == "tiny_pool_preempts":
        assert counters.preemptions_recompute > 0
    if mode == "tiny_pool_swaps":
        assert counters.preemptions_swap > 0 and counters.swapped_in_blocks > 0
    if mode == "swap_space_full_falls_back":
        assert counters.preemptions_recompute > 0


def test_arrival_order_does_not_change_outputs(make_llm, hf_greedy):
    llm = make_llm("llama", max_num_seqs=4, prefill_chunk_size=5)
    order = list(reversed(range(len(PROMPTS))))
    outs = llm.generate([PROMPTS[i] for i in order], GREEDY)
    ref = hf_greedy("llama")
    assert [o.outputs[0].token_ids for o in outs] == [ref[i] for i in order]


def test_requests_arriving_mid_flight_join_the_batch(make_llm, hf_greedy):
    """Continuous batching: requests added while others decode finish with the same tokens."""
    llm = make_llm("llama", max_num_seqs=8, prefill_chunk_size=4)
    engine, tok = llm.engine, llm.tokenizer
    ref = hf_greedy("llama")
    got: dict[str, list[int]] = {}
    pending = list(range(len(PROMPTS)))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:
            i = pending.pop(0)
            engine.add_request(str(i), tok.encode(PROMPTS[i], add_special_tokens=False), GREEDY)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    assert [got[str(i)] for i in range(len(PROMPTS))] == ref


def test_sharded_checkpoint_serves_same_tokens(make_llm, hf_greedy):
    outs = make_llm("llama_sharded").generate(PROMPTS[:4], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy("llama")[:4]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_identical_under_preemption(mode, make_llm):
    params = SamplingParams(
        max_tokens=GEN_TOKENS, temperature=0.9, top_k=50, seed=11, ignore_eos=True
    )
    roomy = make_llm("llama").generate(PROMPTS, params)
    tight = make_llm("llama", num_kv_blocks=24, block_size=4, max_num_seqs=12, preemption_mode=mode)
    squeezed = tight.generate(PROMPTS, params)
    assert tight.engine.scheduler.counters.preemptions > 0
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in roomy]

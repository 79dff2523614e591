"""Speculative decoding end to end: greedy outputs are token-identical to plain decoding (and to
transformers) for every architecture and scheduling mode, proposals from the target itself are
all accepted, and every KV block comes back (the ``make_llm`` fixture checks)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer import SamplingParams

from .conftest import GEN_TOKENS, PROMPTS

GREEDY = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3", "gpt2"]


def _self_draft(tiny_checkpoints, kind: str, k: int = 3) -> dict:
    return {"model": str(tiny_checkpoints[kind]), "num_speculative_tokens": k}


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", ARCHS)
def test_greedy_identical_with_ngram_and_draft_for_every_architecture(
    kind, make_llm, hf_greedy, tiny_checkpoints
):
    ref = hf_greedy(kind)
    ngram = make_llm(kind, block_size=4, speculative_config=NGRAM)
    assert _tokens(ngram.generate(PROMPTS, GREEDY)) == ref
    assert ngram.engine.get_stats().spec_decode_num_drafts_total > 0
    draft = make_llm(kind, block_size=4, speculative_config=_self_draft(tiny_checkpoints, kind))
    assert _tokens(draft.generate(PROMPTS, GREEDY)) == ref
    s = draft.engine.get_stats()
    # The target as its own draft: every proposal is accepted (verification indexing is right).
    assert s.spec_decode_num_draft_tokens_total > 0
    assert s.spec_decode_num_accepted_tokens_total == s.spec_decode_num_draft_tokens_total
    assert draft.engine.proposer.num_free_blocks == draft.engine.proposer.kv.num_total_blocks


MODES = {
    "batch1": dict(max_num_seqs=1),
    "batch32": dict(max_num_seqs=32),
    "chunk1": dict(prefill_chunk_size=1),
    "chunk7": dict(prefill_chunk_size=7, block_size=4),
    "tight_budget": dict(max_num_batched_tokens=6, prefill_chunk_size=3),
    "block1": dict(block_size=1),
    "contiguous": dict(kv_cache_backend="contiguous"),
    "static": dict(batching_mode="static", max_num_seqs=5),
    "prefix_cache": dict(enable_prefix_caching=True, block_size=4),
    "tiny_pool_preempts": dict(num_kv_blocks=24, block_size=4, max_num_seqs=12),
    "tiny_pool_swaps": dict(
        num_kv_blocks=24, block_size=4, max_num_seqs=12, preemption_mode="swap"
    ),
    "priority_policy": dict(scheduling_policy="priority"),
}


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_identical_across_modes(mode, method, make_llm, hf_greedy, tiny_checkpoints):
    spec = NGRAM if method == "ngram" else _self_draft(tiny_checkpoints, "llama", k=4)
    llm = make_llm("llama", speculative_config=spec, **MODES[mode])
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == hf_greedy("llama")
    c = llm.engine.scheduler.counters
    assert c.spec_drafts > 0
    if mode == "tiny_pool_preempts":
        assert c.preemptions_recompute > 0
    if mode == "tiny_pool_swaps":
        assert c.preemptions_swap > 0
    if method == "draft":
        assert c.spec_accepted_tokens == c.spec_draft_tokens


@pytest.mark.parametrize("draft_kind", ["gpt2", "qwen3", "gemma3"])
@pytest.mark.parametrize("options", [{}, MODES["tiny_pool_preempts"], MODES["chunk7"]])
def test_a_different_draft_model_changes_nothing_but_speed(
    draft_kind, options, make_llm, hf_greedy, tiny_checkpoints
):
    """Another architecture with other weights as the draft: most proposals are rejected
    (its KV rolled back in both caches), and the outputs are still the target's own."""
    spec = _self_draft(tiny_checkpoints, draft_kind, k=3)
    llm = make_llm("llama", speculative_config=spec, **options)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == hf_greedy("llama")
    c = llm.engine.scheduler.counters
    assert c.spec_draft_tokens > 0 and c.spec_accepted_tokens < c.spec_draft_tokens
    proposer = llm.engine.proposer
    assert proposer.num_free_blocks == proposer.kv.num_total_blocks


def test_prefix_cache_reuses_blocks_written_with_speculation(make_llm, hf_greedy):
    """Blocks committed to the prefix cache hold only verified tokens: a second pass over the
    same prompts hits the cache and still gives the same tokens."""
    llm = make_llm("llama", enable_prefix_caching=True, block_size=4, speculative_config=NGRAM)
    first = _tokens(llm.generate(PROMPTS, GREEDY))
    prompts = [p + "".join(llm.tokenizer.decode(t)) for p, t in zip(PROMPTS, first, strict=True)]
    llm.generate(prompts, GREEDY)
    assert llm.engine.get_stats().prefix_cache_hits_total > 0
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == hf_greedy("llama")


def test_stops_max_tokens_and_logprobs_match_plain_decoding(make_llm, tiny_checkpoints):
    plain = make_llm("llama")
    ref = plain.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    # A stop string and a stop id from the middle of each reference output.
    params = []
    for out in ref:
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        params.append(
            SamplingParams(
                max_tokens=30,
                temperature=0,
                ignore_eos=True,
                stop=[text[len(text) // 2 : len(text) // 2 + 3]] if len(text) > 8 else [],
                stop_token_ids=[ids[20]],
                logprobs=2,
            )
        )
    expected = plain.generate(PROMPTS, params)
    for spec in (NGRAM, _self_draft(tiny_checkpoints, "llama", k=5)):
        llm = make_llm("llama", speculative_config=spec, block_size=4)
        got = llm.generate(PROMPTS, params)
        for g, e in zip(got, expected, strict=True):
            g0, e0 = g.outputs[0], e.outputs[0]
            assert (g0.token_ids, g0.text, g0.finish_reason, g0.stop_reason) == (
                e0.token_ids,
                e0.text,
                e0.finish_reason,
                e0.stop_reason,
            )
            assert len(g0.logprobs) == len(g0.token_ids)
            for a, b in zip(g0.logprobs, e0.logprobs, strict=True):
                assert a.token_id == b.token_id and a.rank == b.rank
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        stats = llm.engine.get_stats()
        assert stats.spec_decode_num_draft_tokens_total > 0
        # The self-draft proposes what the model picks, so its runs of accepted tokens meet the
        # stops. Whether an n-gram lookup is accepted depends on the output repeating itself,
        # which a GPU's rounding changes (on CUDA these outputs accepted none).
        if spec is not NGRAM:
            assert stats.spec_decode_num_accepted_tokens_total > 0


def test_seeded_sampling_with_speculation_is_reproducible_across_batches(make_llm):
    """Proposals depend only on the request's own tokens and each seeded request draws from its
    own generator, so a seeded request gives the same tokens alone or in a batch."""
    llm = make_llm("llama", speculative_config=NGRAM)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    alone = _tokens(llm.generate([PROMPTS[2]], params))
    batched = _tokens(llm.generate(PROMPTS, params))
    assert batched[2] == alone[0]


def test_bad_draft_models_are_refused_at_start(make_llm, tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["llama"]
    other_vocab = tmp_path / "other_vocab"
    shutil.copytree(source, other_vocab)
    config = json.loads((other_vocab / "config.json").read_text())
    config["vocab_size"] += 8
    (other_vocab / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocabulary of .* tokens"):
        make_llm(
            "llama", speculative_config={"model": str(other_vocab), "num_speculative_tokens": 2}
        )
    # Same size, another tokenizer: two tokens trade ids.
    other_tok = tmp_path / "other_tokenizer"
    shutil.copytree(source, other_tok)
    tok = json.loads((other_tok / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="another tokenizer"):
        make_llm("llama", speculative_config={"model": str(other_tok), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="needs the KV cache"):
        make_llm("llama", use_kv_cache=False, speculative_config=NGRAM)


@pytest.mark.parametrize("stop_at", [1, 2, 3])
def test_a_stop_string_inside_an_accepted_run_ends_the_output_there(
    stop_at, make_llm, tiny_checkpoints
):
    """The stop string completes at an early token of a run whose last token also hits
    max_tokens: the output ends at the stop string (finish_reason stop), as without
    speculation."""
    plain = make_llm("llama")
    greedy = dict(max_tokens=5, temperature=0, ignore_eos=True)
    ref = plain.generate(PROMPTS[1], SamplingParams(**greedy))[0].outputs[0]
    tok = plain.tokenizer
    stop = tok.decode(ref.token_ids[: stop_at + 1])[-2:]
    params = SamplingParams(**greedy, stop=[stop])
    expected = plain.generate(PROMPTS[1], params)[0].outputs[0]
    llm = make_llm("llama", speculative_config=_self_draft(tiny_checkpoints, "llama", k=4))
    got = llm.generate(PROMPTS[1], params)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
        expected.token_ids, expected.text, expected.finish_reason, expected.stop_reason)  # fmt: skip
    counters = llm.engine.scheduler.counters
    assert counters.generation_tokens == len(got.token_ids)
    assert counters.finished == {expected.finish_reason: 1}


def test_a_draft_model_shares_the_kv_budget_without_shrinking_the_default(
    make_llm, tiny_checkpoints
):
    """The default CPU budget still holds every sequence slot at full length with a draft
    model beside the target; an explicit budget is shared between the two caches."""
    spec = _self_draft(tiny_checkpoints, "llama")
    llm = make_llm("llama", max_num_seqs=2, max_model_len=256, block_size=4,
                   speculative_config=spec)  # fmt: skip
    assert llm.engine.capacity.num_tokens >= 2 * 256
    plain = make_llm("llama", kv_cache_memory="8MiB", block_size=4)
    shared = make_llm("llama", kv_cache_memory="8MiB", block_size=4, speculative_config=spec)
    target, draft = shared.engine.capacity.num_blocks, shared.engine.proposer.kv.num_total_blocks
    assert draft == 2 * target and target + draft <= plain.engine.capacity.num_blocks


@pytest.mark.parametrize("quantization", ["int4", "w4a8"])
def test_speculation_over_4bit_weights_changes_nothing_but_speed(quantization, make_llm,
                                                                 engine_device):  # fmt: skip
    """bf16 with 4-bit weights: the kernels' rows do not depend on their batch, so verifying
    k + 1 proposed tokens in one pass gives plain decoding's greedy tokens."""
    from infer.runner.int4 import int4_kernel_available

    if quantization == "w4a8" and engine_device != "cpu":
        pytest.skip("w4a8 is the CPU's VNNI kernel: a GPU engine refuses it (use int4)")
    if not int4_kernel_available(torch.device("cpu"), int8_activations=quantization == "w4a8"):
        pytest.skip(f"no {quantization} CPU kernel here")
    options = dict(dtype="bfloat16", quantization=quantization, block_size=4)
    plain = _tokens(make_llm("llama", **options).generate(PROMPTS, GREEDY))
    spec = make_llm("llama", speculative_config=NGRAM, **options)
    assert _tokens(spec.generate(PROMPTS, GREEDY)) == plain
    assert spec.engine.get_stats().spec_decode_num_drafts_total > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_penalties_bad_words_and_min_tokens_give_plain_decodings_tokens(
    method, make_llm, tiny_checkpoints
):
    """Penalties, bad words and min_tokens apply to each verify row as if the proposals before
    it were accepted, so requests with them get proposals and still emit exactly plain
    decoding's tokens (a model's recommended repetition_penalty no longer turns speculation
    off). The self-draft proposes the unpenalized greedy run, whose repeats the penalties
    must refuse row by row."""
    plain = make_llm("llama")
    greedy = dict(max_tokens=30, temperature=0)
    free = plain.generate(PROMPTS[3], SamplingParams(**greedy, ignore_eos=True))[0].outputs[0]
    word = free.text.split()[2] if len(free.text.split()) > 2 else free.text[:4]
    cases = [
        SamplingParams(**greedy, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(**greedy, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.5),
        SamplingParams(**greedy, min_tokens=12, stop_token_ids=[free.token_ids[3]]),
        SamplingParams(**greedy, ignore_eos=True, bad_words=[word], repetition_penalty=0.9),
    ]
    want = [_tokens(plain.generate(PROMPTS, params)) for params in cases]
    assert word not in plain.generate(PROMPTS[3], cases[3])[0].outputs[0].text
    spec = NGRAM if method == "ngram" else _self_draft(tiny_checkpoints, "llama", k=4)
    llm = make_llm("llama", speculative_config=spec, block_size=4)
    for params, tokens in zip(cases, want, strict=True):
        assert _tokens(llm.generate(PROMPTS, params)) == tokens, params
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens_total > 0
    if method == "draft":  # (the model's own greedy picks: many survive the penalties)
        assert stats.spec_decode_num_accepted_tokens_total > 0

"""Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) in real engines: greedy tokens
identical to transformers however the work is batched, chunked, prefix-cached or preempted
(every block back: the ``make_llm`` fixture checks), int8 and packed bf16 experts, the bytes
counted, and bad checkpoints refused at start-up naming the tensor or field. The layer's
routing edge cases are in tests/unit/test_moe.py; model-level logit parity in
test_model_parity.py (these kinds are among its architectures)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.model import load_model, load_tokenizer
from infer.model.moe import GateLinear, SparseMoE
from infer.plan import safetensors_num_params
from infer.runner.attention import AttentionContext, KVCache, SequenceSlice
from infer.runner.cpu.prepack import onednn_bf16_available, tiled_linear_kernels

from .conftest import GEN_TOKENS, PROMPTS, skip_unless_cpu

KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]
GREEDY = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)

MODES = {
    "batch1": dict(max_num_seqs=1),
    "batch5_chunk7": dict(max_num_seqs=5, prefill_chunk_size=7, block_size=4),
    "tiny_pool_preempts": dict(num_kv_blocks=24, block_size=4, max_num_seqs=12),
    "tiny_pool_swaps": dict(
        num_kv_blocks=24, block_size=4, max_num_seqs=12, preemption_mode="swap"
    ),
}
# Swapping moves KV blocks, which no model looks into: one kind is enough (and keeps this file
# well under a minute on two cores).
CASES = [(k, m) for k in KINDS for m in MODES if m != "tiny_pool_swaps" or k == "mixtral"]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_greedy_matches_transformers(kind, mode, make_llm, hf_greedy):
    llm = make_llm(kind, **MODES[mode])
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == hf_greedy(kind)
    counters = llm.engine.scheduler.counters
    if mode == "tiny_pool_preempts":
        assert counters.preemptions_recompute > 0
    if mode == "tiny_pool_swaps":
        assert counters.preemptions_swap > 0


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_hits_give_the_same_tokens(kind, make_llm, hf_greedy):
    llm = make_llm(kind, block_size=4)  # every prompt in one batch
    first = _tokens(llm.generate(PROMPTS, GREEDY))
    again = _tokens(llm.generate(PROMPTS, GREEDY))
    assert first == again == hf_greedy(kind)
    assert llm.engine.get_stats().prefix_cache_hits_total > 0


def test_speculative_decoding_keeps_the_tokens(make_llm, hf_greedy):
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1}  # fmt: skip
    llm = make_llm("qwen3_moe", block_size=4, speculative_config=ngram)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == hf_greedy("qwen3_moe")
    assert llm.engine.get_stats().spec_decode_num_drafts_total > 0


@pytest.mark.parametrize("kind", KINDS)
def test_weights_bytes_count_every_expert(kind, make_llm, tiny_checkpoints):
    llm = make_llm(kind)
    engine = llm.engine
    assert engine.weights_bytes == 4 * safetensors_num_params(tiny_checkpoints[kind])


def _teacher_forced_logits(path, dtype, quantization=None, prepare=None):
    """The model and its logits at every position of the prompts' text (one prefill)."""
    from infer.runner.quant import quantize_linears

    model = load_model(path, dtype)
    if prepare is not None:
        with torch.no_grad():
            prepare(model)
    if quantization:
        quantize_linears(model, quantization)
    text = " ".join(PROMPTS)
    ids = load_tokenizer(path).encode(text, add_special_tokens=False)[:96]
    spec = model.spec
    blocks = (len(ids) + 15) // 16
    cache = KVCache(spec.num_layers, blocks, 16, spec.num_kv_heads, spec.head_dim, dtype, "cpu")
    ctx = AttentionContext(cache, [SequenceSlice(0, len(ids), list(range(blocks)))], "cpu")
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), ctx)
        return model, model.compute_logits(hidden)


@pytest.mark.parametrize("kind", KINDS)
def test_int8_experts_compute_with_the_weights_they_hold(kind, tiny_checkpoints):
    """Quantized, every expert (and nothing of the routing) changes: the int8 model gives the
    logits of the float model whose projections hold the int8 weights dequantized."""
    from infer.runner.quant import Int8Linear, dequantize, quantize_int8

    path = tiny_checkpoints[kind]
    model, got = _teacher_forced_logits(path, torch.float32, quantization="int8")
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert layers
    for layer in layers:
        assert all(isinstance(e.gate_up_proj, Int8Linear) for e in layer.experts)
        assert all(isinstance(e.down_proj, Int8Linear) for e in layer.experts)
        assert isinstance(layer.router, GateLinear) and layer.router.weight.dtype == torch.float32

    def fake_quantized(model):
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(dequantize(*quantize_int8(m.weight), torch.float32))
        vocab = model.vocab_projection_weight()
        vocab.copy_(dequantize(*quantize_int8(vocab), torch.float32))

    _, want = _teacher_forced_logits(path, torch.float32, prepare=fake_quantized)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_int8_experts_stay_close_to_the_model(kind, tiny_checkpoints):
    path = tiny_checkpoints[kind]
    _, want = _teacher_forced_logits(path, torch.float32)
    _, got = _teacher_forced_logits(path, torch.float32, quantization="int8")
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    err = (got - want).abs().amax(-1) / (want.amax(-1) - want.amin(-1)).mean()
    # Most positions move as much as in the dense kinds (median 0.012-0.025 of the logit range;
    # llama 0.022). A token whose experts nearly tie is routed elsewhere by the int8 error
    # (mixtral: 3% and 12.5% of tokens in its two layers), so the tail is heavier than a dense
    # model's: measured top-1 agreement 0.83-0.97, worst position 0.04-0.44.
    assert agree >= 0.8 and err.median().item() <= 0.05, (agree, err.median().item())


@pytest.mark.parametrize("quantization", [None, "int8", "w8a8", "int4", "w4a8"])
def test_bf16_experts_tokens_do_not_depend_on_the_batch(quantization, make_llm, engine_device):
    from infer.runner.quant import w8a8_available

    # (cuBLAS's bf16 sums depend on the batch's rows: batch invariance is the C++ kernels')
    skip_unless_cpu(engine_device, "batch-invariant bf16 experts")
    if quantization in ("w8a8", "w4a8") and not w8a8_available(torch.device("cpu")):
        pytest.skip(f"{quantization} needs a CPU with AVX-512 VNNI")
    options = dict(dtype="bfloat16", quantization=quantization)
    batched = make_llm("qwen2_moe", max_num_seqs=8, **options)
    alone = make_llm("qwen2_moe", max_num_seqs=1, **options)
    if quantization or tiled_linear_kernels() is not None or onednn_bf16_available():
        layer = next(m for m in batched.engine.model.modules() if isinstance(m, SparseMoE))
        assert not isinstance(layer.experts[0].gate_up_proj, torch.nn.Linear)
    if quantization is None and tiled_linear_kernels() is not None:
        # Packed experts: the fused decode loop takes the steps, the C++ expert layer inside.
        assert batched.engine.runner.fast_decoder is not None
    assert _tokens(batched.generate(PROMPTS, GREEDY)) == _tokens(alone.generate(PROMPTS, GREEDY))


LOGPROBS = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
FAST_CASES = [(k, None) for k in KINDS] + [("qwen3_moe", q) for q in ("int8", "w8a8")]


def _tokens_and_logprobs(llm):
    outs = llm.generate(PROMPTS, LOGPROBS)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize(("kind", "quantization"), FAST_CASES)
@pytest.mark.parametrize("max_num_seqs", [1, 5])
def test_fast_decode_path_gives_the_module_paths_bits(kind, quantization, max_num_seqs,
                                                      make_llm, monkeypatch,
                                                      engine_device):  # fmt: skip
    """A mixture of experts' all-decode steps run in the fused C++ layer loop (Qwen 3's q/k
    norms, the C++ expert layer for each sparse layer): the same tokens and logprobs, bit for
    bit, as the module path, at batch 1 and a few rows."""
    skip_unless_cpu(engine_device, "the fused C++ decode loop")
    kernels = tiled_linear_kernels()
    if kernels is None:
        pytest.skip("the fast decode path needs tiled linear layers")
    if quantization == "int8" and not kernels.linear_int8:
        pytest.skip("tiled int8 weights need AMX or AVX-512 BF16 with VBMI")
    if quantization == "w8a8" and not kernels.has_w8a8:
        pytest.skip("w8a8 needs AVX-512 VNNI")
    options = dict(dtype="bfloat16", quantization=quantization, max_num_seqs=max_num_seqs)
    fast_llm = make_llm(kind, **options)
    assert fast_llm.engine.runner.fast_decoder is not None
    fast = _tokens_and_logprobs(fast_llm)
    monkeypatch.setenv("INFER_FAST_DECODE", "0")
    slow_llm = make_llm(kind, **options)
    assert slow_llm.engine.runner.fast_decoder is None
    assert _tokens_and_logprobs(slow_llm) == fast


def _copy(src, dst):
    dst = dst / "model"
    shutil.copytree(src, dst)
    return dst


def test_missing_expert_tensor_is_named(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(tiny_checkpoints["mixtral"], tmp_path)
    tensors = load_file(path / "model.safetensors")
    missing = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    del tensors[missing]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=missing.replace(".", r"\.")):
        LLM(str(path))


@pytest.mark.parametrize(("kind", "field"), [("mixtral", "num_local_experts"),
                                             ("qwen2_moe", "num_experts")])  # fmt: skip
def test_more_experts_per_token_than_experts_is_named(kind, field, tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints[kind], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_experts_per_tok"] = 9
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=f"num_experts_per_tok=9 is larger than {field}=8"):
        LLM(str(path))


@pytest.mark.slow  # the Triton interpreter on a CPU: ~10 s an engine
def test_triton_step_runs_experts_without_graphs(make_llm, hf_greedy, monkeypatch):
    """The GPU step (under Triton's interpreter without a GPU): no decode graphs for a model
    whose experts are chosen per step, padded decode buckets routed like any rows, mixed steps
    not padded even with INFER_MIXED_GRAPHS=1 (no graph could replay them), and transformers'
    tokens."""
    pytest.importorskip("triton")
    monkeypatch.setenv("INFER_MIXED_GRAPHS", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = make_llm("qwen2_moe", device=device, attention_backend="triton", block_size=4,
                   max_num_seqs=4)  # fmt: skip
    step = llm.engine.runner.cuda_step
    assert step is not None and step.graphs is None and step.mixed_graphs is None
    assert step.mixed_sizes == []
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = _tokens(llm.generate(PROMPTS[:5], params))
    assert got == [t[:8] for t in hf_greedy("qwen2_moe")[:5]]

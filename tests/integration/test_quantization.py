"""Quantized weights and KV caches in real engines, on the tiny checkpoints: how far the logits
move (bounded here, printed with ``-s``), and that a quantized cache still gives the same greedy
tokens however the work is batched, chunked or preempted, with every block returned."""

from __future__ import annotations

import pytest
import torch

from infer import SamplingParams
from infer.model import load_model, load_tokenizer
from infer.runner.attention import AttentionContext, KVCache, SequenceSlice
from infer.runner.int4 import Int4Linear
from infer.runner.quant import (
    Fp8Linear,
    Int8Linear,
    W8A8Linear,
    fp8_matmul_available,
    quantize_linears,
    w8a8_available,
)

from .conftest import PROMPTS

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3", "gpt2"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TEXT = " ".join(PROMPTS)


def _teacher_forced_logits(path, dtype, device, quantization=None, kv_dtype="auto"):
    """Logits at every position of TEXT (one prefill that reads its keys and values back from
    the cache, as a decode would)."""
    model = load_model(path, dtype, device=device)
    if quantization:
        quantize_linears(model, quantization)
    spec = model.spec
    ids = load_tokenizer(path).encode(TEXT, add_special_tokens=False)[:96]
    blocks = (len(ids) + 15) // 16
    cache = KVCache(spec.num_layers, blocks, 16, spec.num_kv_heads, spec.head_dim, dtype, device,
                    kv_dtype=kv_dtype)  # fmt: skip
    ctx = AttentionContext(cache, [SequenceSlice(0, len(ids), list(range(blocks)))], device)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), ctx)
        return model.compute_logits(hidden)


# (quantization, kv cache dtype) -> (least top-1 agreement, largest logit error / logit range).
# Measured on these random-weight checkpoints (whose next-token distributions are flat, so
# top-1 flips easily): int8 weights 0.92-0.98 / 0.017-0.055, int8 KV 0.92-1.00 / 0.011-0.029,
# fp8 KV (3 mantissa bits) 0.77-0.93 / 0.045-0.134, both int8 0.91-0.98 / 0.020-0.072, w8a8
# (int8 activations too) 0.865-0.969 / 0.026-0.093. A wrong
# scale or layout lands near chance. The trained `small` model's held-out perplexity is the
# quality measure (`infer bench quant`).
BOUNDS = {
    ("int8", "auto"): (0.88, 0.10),  # llama3 built by torch 2.11 / transformers 5.17: 0.082
    (None, "int8"): (0.88, 0.05),
    (None, "fp8"): (0.70, 0.20),
    ("int8", "int8"): (0.88, 0.10),
    ("w8a8", "auto"): (0.80, 0.15),
    # 4 bits in groups of 32 on these random weights (float32: both dequantized per product):
    # 0.35-0.62 / 0.27-0.52; a wrong nibble order or zero lands near chance (1 / 1024)
    ("int4", "auto"): (0.30, 0.65),
    ("w4a8", "auto"): (0.30, 0.65),
}


@pytest.mark.parametrize("kind", ARCHS)
@pytest.mark.parametrize("quant", list(BOUNDS))
def test_quantized_logits_stay_close_to_the_model(kind, quant, tiny_checkpoints, engine_device):
    if quant[0] in ("w8a8", "w4a8") and not w8a8_available(torch.device(engine_device)):
        pytest.skip(f"{quant[0]} needs a CPU with AVX-512 VNNI")
    path = tiny_checkpoints[kind]
    want = _teacher_forced_logits(path, torch.float32, engine_device)
    got = _teacher_forced_logits(
        path, torch.float32, engine_device, quantization=quant[0], kv_dtype=quant[1]
    )
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    spread = (want.amax(-1) - want.amin(-1)).mean().item()
    err = (got - want).abs().max().item() / spread
    print(f"{kind} weights={quant[0]} kv={quant[1]}: top-1 {agree:.3f}, max error {err:.4f}")
    least_agree, most_err = BOUNDS[quant]
    assert agree >= least_agree and err <= most_err, (agree, err)


KV_MODES = {
    "batch1": dict(max_num_seqs=1),
    "batch32": dict(max_num_seqs=32),
    "chunk7": dict(prefill_chunk_size=7, block_size=4),
    "chunk1": dict(prefill_chunk_size=1),
    "prefix_cache": dict(enable_prefix_caching=True, block_size=4),
    "contiguous": dict(kv_cache_backend="contiguous"),
    "tiny_pool_preempts": dict(num_kv_blocks=24, block_size=4, max_num_seqs=12),
    "tiny_pool_swaps": dict(
        num_kv_blocks=24, block_size=4, max_num_seqs=12, preemption_mode="swap"
    ),
}


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("mode", list(KV_MODES))
def test_quantized_kv_greedy_tokens_do_not_depend_on_batching(
    kv_dtype, mode, make_llm, engine_device
):
    reference = make_llm("llama", kv_cache_dtype=kv_dtype, max_num_seqs=4).generate(PROMPTS, GREEDY)
    llm = make_llm("llama", kv_cache_dtype=kv_dtype, **KV_MODES[mode])
    outs = llm.generate(PROMPTS, GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    want = [o.outputs[0].token_ids for o in reference]
    if engine_device == "cpu":
        assert got == want
    else:
        # On CUDA a matmul's last bits depend on the batch's shape (cuBLAS picks kernels by
        # it), and a one-byte cache can round such a key differently: measured on an H200,
        # one of 12 sequences took another path after 9 tokens at batch 1. A wrong slot or
        # scale would change them all.
        assert sum(g == w for g, w in zip(got, want, strict=True)) >= len(want) - 1
        assert all(g[:4] == w[:4] for g, w in zip(got, want, strict=True))
    counters = llm.engine.scheduler.counters
    if mode == "tiny_pool_preempts":
        assert counters.preemptions_recompute > 0
    if mode == "tiny_pool_swaps":
        assert counters.preemptions_swap > 0


@pytest.mark.parametrize("weights", ["int8", "w8a8", "int4", "w4a8"])
@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3"])
def test_bf16_with_int8_weights_and_kv_serves_every_prompt(kind, weights, make_llm, engine_device):
    if weights in ("w8a8", "w4a8") and not w8a8_available(torch.device(engine_device)):
        pytest.skip(f"{weights} needs a CPU with AVX-512 VNNI")
    llm = make_llm(kind, dtype="bfloat16", quantization=weights, kv_cache_dtype="int8")
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    alone = make_llm(kind, dtype="bfloat16", quantization=weights, kv_cache_dtype="int8",
                     max_num_seqs=1).generate(PROMPTS, GREEDY)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


def test_one_byte_cache_holds_about_twice_the_tokens_in_the_same_memory(
    tiny_checkpoints, tmp_path, engine_device
):
    """Read from the engine: the same --kv-cache-memory holds 2 x 64 / (64 + 2) = 1.94x the
    tokens at head_dim 64 (the bf16 scale per token and head is the overhead)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from infer import LLM

    src = tiny_checkpoints["llama"]
    cfg = LlamaConfig.from_pretrained(src)
    cfg.update(dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                    intermediate_size=256, num_hidden_layers=1))  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, tmp_path / name)
    tokens = {}
    for kv_dtype in ("auto", "int8", "fp8"):
        llm = LLM(str(tmp_path), dtype="bfloat16", kv_cache_memory="4MiB", kv_cache_dtype=kv_dtype,
                  device=engine_device)  # fmt: skip
        tokens[kv_dtype] = llm.engine.capacity.num_tokens
        out = llm.generate(["def main():"], GREEDY)[0]
        assert len(out.outputs[0].token_ids) == 16
        assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_total_blocks
    assert tokens["int8"] == tokens["fp8"] >= 1.9 * tokens["auto"]


@pytest.mark.parametrize("weights", ["int8", "w8a8", "fp8", "int4"])
def test_no_quantize_lm_head_keeps_the_vocabulary_projection(weights, make_llm, engine_device):
    """--no-quantize-lm-head: every layer quantized, the vocabulary projection giving the
    unquantized model's scores bit for bit (and the quantized one not)."""
    if weights == "w8a8" and not w8a8_available(torch.device(engine_device)):
        pytest.skip("w8a8 needs a CPU with AVX-512 VNNI")
    if weights == "fp8" and not fp8_matmul_available(torch.device(engine_device)):
        pytest.skip("fp8 needs a CUDA GPU with fp8 matmuls")
    plain, kept, whole = (
        make_llm("llama", dtype="bfloat16", **options)
        for options in ({}, dict(quantization=weights, quantize_lm_head=False),
                        dict(quantization=weights))
    )  # fmt: skip
    models = [llm.engine.runner.model for llm in (plain, kept, whole)]
    hidden = torch.randn(5, models[0].vocab_projection_weight().shape[1], dtype=torch.bfloat16,
                         device=engine_device)  # fmt: skip
    with torch.inference_mode():
        scores = [m.project_to_vocab(hidden) for m in models]
    assert torch.equal(scores[1], scores[0])
    assert not torch.equal(scores[2], scores[0])
    # Packed as the unquantized model's is (the bf16 CPU kernel), not left to F.linear.
    assert type(getattr(models[1], "packed_logits", None)) is type(
        getattr(models[0], "packed_logits", None)
    )

    def quantized(model):
        kinds = (Int8Linear, W8A8Linear, Fp8Linear, Int4Linear)
        return sum(isinstance(m, kinds) for m in model.modules())

    assert quantized(models[1]) == quantized(models[2]) - 1 > 0
    outs = kept.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)

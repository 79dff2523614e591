"""GGUF files (llama.cpp's format) load as llama.cpp and transformers read them.

The files are written from the tiny checkpoints with llama.cpp's metadata keys, tensor names
and Llama q / k row order (``infer.testing.gguf_files``). Oracles: the folder a file was
written from (F32 files: the same float32 weights), transformers reading the file itself
(``from_pretrained(gguf_file=...)``, which dequantizes with the gguf package), and the gguf
package's dequantization of each block type (llama.cpp's reference code).
"""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from infer import LLM, SamplingParams
from infer.model.folders import ModelLoadError
from infer.model.gguf_checkpoint import unpack_4bit, unpack_wide
from infer.model.quantized_checkpoint import layer_weight
from infer.runner.int4 import Int4Linear, int4_kernel_available
from infer.runner.quant import gguf_int8_default
from infer.testing.gguf_files import (
    build_gemma3_for_gguf,
    build_sparse_qwen2_moe,
    build_wide_llama,
    write_gguf,
)

from .conftest import PROMPTS

gguf = pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """The folders made from GGUF metadata go to this test's own cache."""
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def wide_llama(tiny_checkpoints, tmp_path_factory) -> Path:
    return build_wide_llama(tmp_path_factory.mktemp("wide") / "llama", tiny_checkpoints["llama"])


def _run(model, dtype="float32", prompts=PROMPTS[:4], max_tokens=8, **options):
    """(prompt logprobs of each prompt's tokens, greedy tokens, the engine's 4-bit layers but
    the vocabulary projection)."""
    with LLM(str(model), dtype=dtype, block_size=4, **options) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                    ignore_eos=True, prompt_logprobs=1))  # fmt: skip
        lps = torch.tensor([lp.logprob for o in outs for lp in o.prompt_logprobs[1:]])
        model = llm.engine.runner.model
        head = getattr(model, "packed_logits", None)
        int4 = [m for m in model.modules() if isinstance(m, Int4Linear) and m is not head]
        return lps, [o.outputs[0].token_ids for o in outs], int4


# --------------------------------------------------------------------------- blocks


def _random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random raw blocks of ``kind`` whose float16 fields are small finite numbers, with one
    group that is a constant (scale 0, a nonzero min)."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    halves = 1 if kind == "Q4_0" else 2  # d (and dmin / m) lead each block
    for h in range(halves):
        values = rng.uniform(-0.01 if kind == "Q4_1" and h else 0.001, 0.01, raw.shape[:2])
        raw[..., 2 * h : 2 * h + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    if kind == "Q4_1":
        raw[0, 0, 0:2] = np.float16(0).reshape(1).view(np.uint8)  # d 0: every weight is m
    if kind == "Q4_K":
        raw[0, 0, 4] &= 0b11000000  # group 0: sc 0 (its m, scales[4] & 63, stays)
        raw[0, 0, 8] |= 1
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_blocks_unpack_to_llama_cpps_dequantized_values(kind):
    """scale * (q - zero) per group of 32 is llama.cpp's value: exactly for Q4_0 (integer
    zero 8), to the float16 rounding of scale and zero for Q4_1 / Q4_K."""
    rows, cols = 48, 512
    raw = _random_blocks(kind, rows, cols, seed=len(kind))
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]))
    layer = unpack_4bit(raw, kind, (rows, cols))
    assert layer.q.shape == (rows, cols) and int(layer.q.max()) <= 15
    assert layer.scales.shape == layer.zeros.shape == (rows, cols // 32)
    got = layer_weight(layer)
    if kind == "Q4_0":
        assert layer.zeros.dtype == torch.uint8 and torch.equal(got, want)
    else:
        assert layer.zeros.dtype == torch.float16
        # within 2^-9 of each group's largest value (a 32nd of a 4-bit step)
        scale = want.view(rows, -1, 32).abs().amax(dim=2, keepdim=True).clamp(min=1e-6)
        assert ((got - want).view(rows, -1, 32).abs() / scale).max() < 2**-9
    assert (want[0, :32] != 0).all() if kind != "Q4_0" else True  # the constant group


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K"])
def test_5bit_blocks_unpack_to_llama_cpps_dequantized_values(kind):
    """Random Q5 blocks: the integers recovered from llama.cpp's values and the parsed scales
    give them back, exactly for Q5_0 (integer zero 16, scale d), to the float16 rounding of
    scale and zero for the others."""
    rows, cols = 32, 512
    rng = np.random.default_rng(len(kind))
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    halves = {"Q5_0": [0], "Q5_1": [0, 2], "Q5_K": [0, 2]}[kind]
    for at in halves:
        values = rng.uniform(-0.01 if kind == "Q5_1" and at else 0.001, 0.01, raw.shape[:2])
        raw[..., at : at + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    raw = raw.reshape(rows, -1)
    want = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    layer = unpack_wide(raw, kind, want)
    group = 32
    assert layer.bits == 5 and layer.q.shape == (rows, cols)
    assert int(layer.q.max()) == 31  # (random blocks reach the top value)
    assert layer.scales.shape == (rows, cols // group)
    got, want = layer_weight(layer), torch.from_numpy(want)
    if kind == "Q5_0":
        assert layer.zeros.dtype == torch.uint8 and torch.equal(got, want)
        return
    assert layer.zeros.dtype == torch.float16
    scale = want.view(rows, -1, group).abs().amax(dim=2, keepdim=True).clamp(min=1e-6)
    assert ((got - want).view(rows, -1, group).abs() / scale).max() < 2**-9


def test_a_zero_float16_cannot_hold_leaves_the_layer_dequantized():
    """A Q4_1 group with a tiny scale beside a large min: its zero (-m / d) overflows
    float16, so the layer is not kept 4-bit (it is held dequantized, exactly)."""
    raw = _random_blocks("Q4_1", 16, 64, seed=3)
    blocks = raw.reshape(16, 2, 20)
    blocks[5, 1, 0:2] = np.float16(6e-8).reshape(1).view(np.uint8)  # d: a float16 subnormal
    blocks[5, 1, 2:4] = np.float16(0.01).reshape(1).view(np.uint8)  # m
    assert unpack_4bit(raw, "Q4_1", (16, 64)) is None
    assert unpack_4bit(_random_blocks("Q4_1", 16, 64, seed=3), "Q4_1", (16, 64)) is not None


# --------------------------------------------------------------------------- whole files


@pytest.mark.parametrize(
    "kind", ["llama", "llama3", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]
)
def test_an_f32_gguf_serves_the_checkpoint_it_was_written_from(kind, tiny_checkpoints, tmp_path):
    """The file's config, tokenizer, chat template and (un-permuted) weights are the folder's:
    the same logits (the file's rms_norm_eps is the float32 of the folder's), the same tokens.
    ``llama3``: q/k/v and MLP biases (q and k permuted like their weights) and a Llama 3 rope
    scaling, which a GGUF holds as each frequency's divisor (``rope_freqs``), over prompts
    past its original 64 positions. Mixtures of experts: each layer's experts stacked in one
    tensor (a "llama" file with experts is a Mixtral; Qwen2-MoE's shared expert and its gate)."""
    folder = tiny_checkpoints[kind]
    if kind == "qwen2_moe":  # (llama.cpp's qwen2moe has no dense layers between)
        folder = build_sparse_qwen2_moe(tmp_path / "qwen2_moe", folder)
    file = write_gguf(folder, tmp_path / f"{kind}.gguf", "F32")
    prompts = PROMPTS[:4] + [" ".join(PROMPTS)]  # the last: ~130 tokens
    want_lps, want_tokens, _ = _run(folder, prompts=prompts)
    got_lps, got_tokens, int4 = _run(file, prompts=prompts)
    torch.testing.assert_close(got_lps, want_lps, rtol=0, atol=1e-5)
    assert got_tokens == want_tokens and int4 == []
    with LLM(str(file), dtype="float32") as a, LLM(str(folder), dtype="float32") as b:
        for prompt in PROMPTS:
            assert a.tokenizer.encode(prompt) == b.tokenizer.encode(prompt)
        chat = [{"role": "user", "content": "Hi"}]
        assert a.engine.tokenizer.apply_chat_template(chat, tokenize=False) == (
            b.engine.tokenizer.apply_chat_template(chat, tokenize=False)
        )
        # llama.cpp ends generation on the file's eos and on end-of-turn tokens by name
        im_end = b.engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert set(a.engine.eos_token_ids) == {*b.engine.eos_token_ids, im_end}


@pytest.mark.parametrize("rope_type", ["yarn", "linear"])
def test_a_gguf_files_rope_scaling_is_read(rope_type, tiny_checkpoints, tmp_path):
    """``rope.scaling.type`` / ``factor`` / ``original_context_length`` (Qwen's long-context
    files: YaRN) give the folder's logits past the original context."""
    folder = tmp_path / "qwen3"
    shutil.copytree(tiny_checkpoints["qwen3"], folder)
    config = json.loads((folder / "config.json").read_text())
    rope = {"rope_type": rope_type, "factor": 4.0,
            "rope_theta": config["rope_parameters"]["rope_theta"]}  # fmt: skip
    if rope_type == "yarn":
        rope["original_max_position_embeddings"] = 32
    config["rope_parameters"] = rope
    (folder / "config.json").write_text(json.dumps(config))
    file = write_gguf(folder, tmp_path / "qwen3.gguf", "F32")
    prompts = PROMPTS[:2] + [" ".join(PROMPTS)]  # the last: ~130 tokens
    want_lps, want_tokens, _ = _run(folder, prompts=prompts)
    got_lps, got_tokens, _ = _run(file, prompts=prompts)
    torch.testing.assert_close(got_lps, want_lps, rtol=0, atol=1e-5)
    assert got_tokens == want_tokens
    plain_lps, _, _ = _run(tiny_checkpoints["qwen3"], prompts=prompts)
    assert (plain_lps - want_lps).abs().max() > 0.01  # the scaling changes the logits


def test_a_gemma3_gguf_runs_as_llama_cpp_runs_one(tiny_checkpoints, tmp_path):
    """Gemma 3 (llama.cpp's "gemma3"): norms stored plus one, every 6th layer global with the
    file's rope base and linear scaling, the others sliding with a 10k base, queries scaled by
    1 / sqrt(head_dim); prompts past the 16-token window give the folder's logits. (Token ids:
    a Gemma file's tokenizer is SentencePiece, which transformers converts by architecture.)"""
    folder = build_gemma3_for_gguf(tmp_path / "gemma3", tiny_checkpoints["llama"])
    file = write_gguf(folder, tmp_path / "gemma3.gguf", "F32")
    prompts = [list(range(5, 130)), [7, 8, 9], list(range(300, 340))]
    want_lps, want_tokens, _ = _run(folder, prompts=prompts)
    got_lps, got_tokens, _ = _run(file, prompts=prompts)
    torch.testing.assert_close(got_lps, want_lps, rtol=0, atol=1e-5)
    assert got_tokens == want_tokens
    from infer.model.folders import find_model_folder

    config = json.loads((find_model_folder(file) / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["query_pre_attn_scalar"] == 16 and config["sliding_window"] == 16
    assert config["rope_parameters"]["full_attention"]["factor"] == 4.0


@pytest.mark.parametrize("weight_type", ["Q4_K", "Q4_0", "Q4_1", "Q8_0", "F16"])
def test_a_quantized_gguf_gives_transformers_greedy_tokens(weight_type, wide_llama, tmp_path):
    """float32: every weight dequantized exactly as llama.cpp does it, so infer computes what
    transformers computes reading the same file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = write_gguf(wide_llama, tmp_path / f"m-{weight_type}.gguf", weight_type)
    lps, tokens, int4 = _run(file)
    assert int4 == []
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name,
                                                 dtype=torch.float32).eval()  # fmt: skip
    model.generation_config.eos_token_id = None
    want_lps = []
    for prompt, got in zip(PROMPTS[:4], tokens, strict=True):
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            g = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        want_lps += [logits[i, t].item() for i, t in enumerate(ids[1:])]
        assert g[0, len(ids) :].tolist() == got
    torch.testing.assert_close(lps, torch.tensor(want_lps), rtol=0, atol=1e-4)


@pytest.mark.skipif(not int4_kernel_available(torch.device("cpu")), reason="no int4 CPU kernel")
@pytest.mark.parametrize("weight_type", ["Q4_K", "Q4_1", "Q4_0"])
def test_bf16_keeps_4bit_layers_as_close_as_the_plain_bf16_model(weight_type, wide_llama, tmp_path):
    """bf16: the 4-bit layers stay 4-bit in the C++ kernels (float16 zeros for Q4_1 / Q4_K).
    With bf16 activations (--no-gguf-int8-activations) their logits sit as close to the
    float32 file's as the same weights held in bf16 do; with int8 activations (the default,
    the w4a8 kernel: each row's groups of 32 in int8, as llama.cpp) within 3x that. A wrong
    nibble, scale, zero or row order lands far off. ``--gguf-dequantize`` holds every layer
    dequantized, as the plain bf16 folder does."""
    from transformers import AutoModelForCausalLM

    file = write_gguf(wide_llama, tmp_path / f"m-{weight_type}.gguf", weight_type)
    plain = tmp_path / "plain"  # the file's weights, dequantized by transformers, as a folder
    shutil.copytree(wide_llama, plain)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, plain / "model.safetensors")  # tied: the embedding is the head
    exact, _, _ = _run(file)
    plain_lps, _, _ = _run(plain, "bfloat16")
    got, _, int4 = _run(file, "bfloat16", gguf_int8_activations=False)
    assert len(int4) == 8 and {m.mode for m in int4} == {"kernel"}  # qkv, o, gate_up, down x 2
    assert not any(m.int8_activations for m in int4)
    zeros = {m.zeros.dtype for m in int4}
    assert zeros == {torch.uint8 if weight_type == "Q4_0" else torch.float16}
    plain_err, got_err = (plain_lps - exact).abs().mean(), (got - exact).abs().mean()
    print(f"{weight_type}: mean |logprob error| plain bf16 {plain_err:.4f}, 4-bit {got_err:.4f}")
    assert got_err <= 1.5 * plain_err
    # --gguf-dequantize: every layer dequantized at load, as the plain bf16 folder holds them
    dequantized, _, int4 = _run(file, "bfloat16", gguf_dequantize=True)
    assert int4 == []
    torch.testing.assert_close(dequantized, plain_lps, rtol=0, atol=1e-4)
    if not int4_kernel_available(torch.device("cpu"), int8_activations=True):
        return
    w4a8, _, int4 = _run(file, "bfloat16")
    assert len(int4) == 8 and {(m.mode, m.int8_activations) for m in int4} == {("kernel", True)}
    # Q4_K: the file's own scales (uint8 sc, m; float16 d, dmin per 256) in the w4a8 kernel
    assert {m.kquant for m in int4} == {weight_type == "Q4_K"}
    w4a8_err = (w4a8 - exact).abs().mean()
    print(f"{weight_type}: 4-bit x int8 activations {w4a8_err:.4f}")
    assert w4a8_err <= 3 * plain_err


@pytest.mark.skipif(not int4_kernel_available(torch.device("cpu"), int8_activations=True),
                    reason="no w4a8 CPU kernel")  # fmt: skip
@pytest.mark.parametrize(
    "weight_type,types,kept",
    [
        ("Q5_K", None, {(5, 8)}),
        ("Q5_0", None, {(5, 8)}),
        ("Q5_1", None, {(5, 8)}),
        # a Q4_K_M-like mix: q / k Q4_K beside a Q5_K v (one fused q/k/v at 5 bits, float16
        # zeros), a Q6_K down projection (6 bits, its own scales)
        ("Q4_K", {"attn_v": "Q5_K", "ffn_down": "Q6_K"}, {(5, 2), (4, 4), (6, 2)}),
        ("Q6_K", None, {(6, 8)}),
    ],
)
def test_5bit_and_6bit_layers_stay_in_their_bits_with_int8_activations(
    weight_type, types, kept, wide_llama, tmp_path
):
    """bf16 with int8 activations (the default): Q5 and Q6_K layers are held at their own
    width (nibbles + one or two bit planes) in the w4a8 kernel, not int8 per channel, as close
    to the float32 file's logits as the 4-bit layers are (within 3x the same weights held in
    bf16), and so is the vocabulary projection (the tied embedding, in the file's type); with
    --no-gguf-int8-activations they are held in int8 per channel as before."""
    from transformers import AutoModelForCausalLM

    file = write_gguf(wide_llama, tmp_path / f"m-{weight_type}.gguf", weight_type, types=types)
    plain = tmp_path / "plain"
    shutil.copytree(wide_llama, plain)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, plain / "model.safetensors")
    exact, _, _ = _run(file)
    plain_lps, _, _ = _run(plain, "bfloat16")
    got, _, layers = _run(file, "bfloat16")
    # (bits, layers): of each layer's qkv, o, gate_up, down
    assert set(collections.Counter(m.bits for m in layers).items()) == kept
    assert all(m.mode == "kernel" and m.int8_activations for m in layers)
    # K-quants (a fused Q4_K / Q5_K q/k/v too) and Q6_K read with their own scales
    assert all(m.kquant == (weight_type in ("Q4_K", "Q5_K") and m.bits < 6) for m in layers)
    assert all(m.q6k == (m.bits == 6) for m in layers)
    plain_err, got_err = (plain_lps - exact).abs().mean(), (got - exact).abs().mean()
    print(f"{weight_type} {types}: mean |logprob error| plain bf16 {plain_err:.4f}, "
          f"w4a8 {got_err:.4f}")  # fmt: skip
    assert got_err <= 3 * plain_err
    with LLM(str(file), dtype="bfloat16") as llm:
        head = llm.engine.runner.model.packed_logits
        assert isinstance(head, Int4Linear) and head.mode == "kernel" and head.int8_activations
        assert head.bits == {"Q4_K": 4, "Q6_K": 6}.get(weight_type, 5)
    with LLM(str(file), dtype="bfloat16", gguf_int8_activations=False, gguf_int8=True) as llm:
        backend = llm.engine.backend
        assert {m.bits for m in backend.kept_int4} <= {4}
        # every layer not kept 4-bit is int8 per channel; the vocabulary projection too unless
        # the file holds it in 4 bits (then an Int4Linear with bf16 activations)
        head_kept = isinstance(llm.engine.runner.model.packed_logits, Int4Linear)
        assert head_kept == (weight_type == "Q4_K")
        layers_kept = len(backend.kept_int4) - head_kept
        assert len(backend.checkpoint_int8) == 8 - layers_kept + (not head_kept)


@pytest.mark.skipif(not int4_kernel_available(torch.device("cpu"), int8_activations=True),
                    reason="no w4a8 CPU kernel")  # fmt: skip
@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_1", "Q5_1"])
def test_a_quantized_mixture_of_experts_keeps_its_experts_in_their_bits(
    weight_type, tiny_checkpoints, tmp_path
):
    """4-bit experts (sliced out of their layer's stacked tensor; Q4_1's with float16 zeros)
    stay 4-bit in the experts' kernel, as close to the float32 file's logits as the same
    weights held in bf16 (within 3x with int8 activations, the default); 5-bit ones (Q5_1)
    stay 5-bit with int8 activations (int8 per channel without)."""
    bits = 5 if weight_type == "Q5_1" else 4
    source = tiny_checkpoints["qwen3_moe"]
    file = write_gguf(source, tmp_path / "moe.gguf", weight_type)
    plain = tmp_path / "plain"  # the same weights, rounded through the type by llama.cpp's code
    shutil.copytree(source, plain)
    kind = gguf.GGMLQuantizationType[weight_type]
    state = load_file(str(source / "model.safetensors"))
    for name, w in state.items():
        if w.dim() == 2 and w.shape[1] % 32 == 0:
            rounded = gguf.quants.dequantize(gguf.quants.quantize(w.float().numpy(), kind), kind)
            state[name] = torch.from_numpy(rounded).to(w.dtype)
    save_file(state, plain / "model.safetensors")
    exact, _, _ = _run(file)
    plain_lps, _, _ = _run(plain, "bfloat16")
    got, _, int4 = _run(file, "bfloat16", gguf_int8_activations=False)
    # per layer: qkv, o, and each expert's gate_up, down
    assert len(int4) == (2 * (2 + 2 * 8) if bits == 4 else 0)
    w4a8, _, int4 = _run(file, "bfloat16")  # int8 activations (the default)
    assert len(int4) == 2 * (2 + 2 * 8) and all(m.int8_activations for m in int4)
    assert {m.bits for m in int4} == {bits}
    plain_err, got_err = (plain_lps - exact).abs().mean(), (got - exact).abs().mean()
    w4a8_err = (w4a8 - exact).abs().mean()
    print(f"moe {weight_type}: mean |logprob error| plain bf16 {plain_err:.4f}, "
          f"bf16 activations {got_err:.4f}, int8 activations {w4a8_err:.4f}")  # fmt: skip
    assert got_err <= (1.5 if bits == 4 else 3) * plain_err  # (Q5_1: int8 per channel)
    assert w4a8_err <= 3 * plain_err


def test_checkpoint_quantization_flag_and_errors(tiny_checkpoints, wide_llama, tmp_path):
    file = write_gguf(wide_llama, tmp_path / "m.gguf", "Q4_K")
    with LLM(str(file), dtype="bfloat16", quantization="gguf") as llm:
        assert llm.engine.checkpoint_quantization.method == "gguf"
    with pytest.raises(ValueError, match=r"--quantization gptq: .* is a gguf checkpoint"):
        LLM(str(file), quantization="gptq")
    with pytest.raises(ValueError, match="is not a quantized checkpoint"):
        LLM(str(wide_llama), quantization="gguf")
    # a file that is not GGUF, and an architecture infer does not read
    (tmp_path / "model.bin").write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="is a file but not a GGUF file"):
        LLM(str(tmp_path / "model.bin"))
    other = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    other.add_block_count(1)
    other.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.write_tensors_to_file()
    other.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'phi3' is not supported"):
        LLM(str(tmp_path / "phi.gguf"))
    damaged = write_gguf(wide_llama, tmp_path / "damaged.gguf", "Q8_0",
                         drop=("model.layers.1.mlp.up_proj.weight",))  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' \(for "
                       r"layers.1.mlp.gate_up_proj.weight\) is missing from GGUF file"):  # fmt: skip
        LLM(str(damaged))
    (tmp_path / "short.gguf").write_bytes(file.read_bytes()[:5000])  # cut off mid-header
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        LLM(str(tmp_path / "short.gguf"))


def test_the_folder_is_made_once_and_a_changed_file_gets_a_new_one(wide_llama, tmp_path):
    from infer.model.folders import find_model_folder
    from infer.model.gguf_folder import gguf_source

    file = write_gguf(wide_llama, tmp_path / "m.gguf", "Q8_0")
    folder = find_model_folder(file)
    assert find_model_folder(str(file)) == folder and gguf_source(folder) == file.resolve()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    write_gguf(wide_llama, file, "Q4_0")  # rewritten in place
    with pytest.raises(ModelLoadError, match="changed after"):
        gguf_source(folder)
    assert find_model_folder(file) != folder


def test_plan_counts_a_gguf_file_as_the_engine_holds_it(wide_llama, tmp_path):
    """`infer plan --model FILE.gguf` reads the header only: float32 holds every weight
    dequantized; bf16 holds a 4-bit layer as half a byte a weight plus its scales: a float16
    scale and a uint8 zero per group of 32 for Q4_0; Q4_K's own uint8 scale and min per group
    and float16 d and dmin per 256 (int8 activations, the default), a layer of another quantized type
    (Q8_0 here) in int8 per channel where the CPU has the int8 kernel (with --no-gguf-int8, or
    without it, in bf16), the embedding in bf16 (and
    the vocabulary projection held once more: as stored when its type is kept, int8 when it
    was stored in another quantized type, bf16 as for any bf16 folder otherwise)."""
    from infer.model.folders import find_model_folder
    from infer.plan import safetensors_num_params, safetensors_weight_bytes

    plain_params = safetensors_num_params(wide_llama)
    with LLM(str(wide_llama), dtype="bfloat16") as llm:
        packed_copy = llm.engine.weights_bytes - safetensors_weight_bytes(wide_llama, 2)
    linear = 2 * (256 * 256 + 2 * 128 * 256 + 256 * 256 + 3 * 256 * 512)  # q k v o gate up down
    outputs = 2 * (256 + 128 + 128 + 256 + 512 + 512 + 256)
    vocab_int8 = 1024 * 256 + 4 * 1024
    w4a8 = int4_kernel_available(torch.device("cpu"), int8_activations=True)
    # (where the CPU has no 4-bit kernel the engine holds a GGUF file's weights dequantized)
    kernels = int4_kernel_available(torch.device("cpu"))
    int8 = gguf_int8_default(False, torch.device("cpu"))  # (Q8_0 layers: int8 or bf16)
    vocab = 1024 * 256
    for weight_type, scale_bytes in (
        # int8 activations: Q4_K's own scales; else a float16 scale and zero per 32
        ("Q4_K", (lambda n: 2 * n // 32 + 4 * n // 256) if w4a8 else (lambda n: 4 * n // 32)),
        ("Q4_0", lambda n: 3 * n // 32),
        ("Q8_0", None),
    ):
        file = write_gguf(wide_llama, tmp_path / f"m-{weight_type}.gguf", weight_type)
        folder = find_model_folder(file)
        assert safetensors_num_params(folder) == plain_params
        with LLM(str(file), dtype="float32") as llm:
            assert (
                safetensors_weight_bytes(folder, 4)
                == llm.engine.weights_bytes
                == (plain_params * 4)
            )
        with LLM(str(file), dtype="bfloat16") as llm:
            held = llm.engine.weights_bytes
            if not kernels or (scale_bytes is None and not int8):
                # every weight dequantized, as a bf16 folder's: plus its packed copy
                assert safetensors_weight_bytes(folder, 2) == held - packed_copy
                assert held == plain_params * 2 + packed_copy
                continue
            assert safetensors_weight_bytes(folder, 2) == held
        with LLM(str(file), dtype="bfloat16", gguf_int8=False) as llm:
            plain16 = llm.engine.weights_bytes
            # (a vocabulary projection kept as stored is counted; a bf16 packed copy is not)
            copy = 0 if scale_bytes is not None else packed_copy
            assert safetensors_weight_bytes(folder, 2, gguf_int8=False) == plain16 - copy
        rest = (plain_params - linear) * 2
        if scale_bytes is not None:
            kept_vocab = vocab // 2 + scale_bytes(vocab)
            assert held == rest + linear // 2 + scale_bytes(linear) + kept_vocab
        else:
            assert held == rest + linear + 4 * outputs + vocab_int8
            assert plain16 - packed_copy == plain_params * 2


@pytest.mark.skipif(not int4_kernel_available(torch.device("cpu"), int8_activations=True),
                    reason="no w4a8 CPU kernel")  # fmt: skip
def test_plan_counts_5bit_and_kquant_layers_as_the_engine_holds_them(wide_llama, tmp_path):
    """With int8 activations a Q5 layer counts at 5 bits plus its scales (a float16 scale and
    zero per group of 32; Q5_K its own uint8 scale and min per 32 and float16 d, dmin per 256),
    a Q4_K q / k fused with a Q5_K v at 5 bits with their own scales, a Q6_K layer at 6 bits
    with its int8 scale per 16 and float16 d per 256 (a q/k/v fusing Q6_K with Q4_K in int8
    per channel); without, the Q5 and Q6_K layers count in int8 per channel (``--gguf-int8``,
    asked: off by default where the CPU has no int8 kernel) and Q4_K with float16 scales and
    zeros."""
    from infer.model.folders import find_model_folder
    from infer.plan import safetensors_weight_bytes

    for weight_type, types in (("Q4_K", {"attn_v": "Q5_K", "ffn_down": "Q6_K"}),
                               ("Q4_K", {"attn_v": "Q6_K"}), ("Q6_K", None),
                               ("Q5_0", None), ("Q5_K", None)):  # fmt: skip
        file = write_gguf(wide_llama, tmp_path / f"m-{weight_type}.gguf", weight_type, types=types)
        folder = find_model_folder(file)
        for act in (True, False):
            with LLM(str(file), dtype="bfloat16", gguf_int8_activations=act, gguf_int8=True) as llm:
                held = llm.engine.weights_bytes
            assert safetensors_weight_bytes(folder, 2, True, gguf_int8_activations=act) == held


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q8_0"])
def test_plan_counts_a_gguf_mixture_of_experts_as_the_engine_holds_it(weight_type,
                                                                     tiny_checkpoints, tmp_path):  # fmt: skip
    """Stacked experts count per expert: 4-bit where each expert's gate and up both are, else
    int8 (bf16); the router stays in the model's dtype."""
    from infer.model.folders import find_model_folder
    from infer.plan import safetensors_weight_bytes

    source = tiny_checkpoints["qwen3_moe"]
    file = write_gguf(source, tmp_path / "moe.gguf", weight_type)
    folder = find_model_folder(file)
    # held dequantized, as a bf16 folder, plus its packed copy: without the 4-bit kernel, and
    # Q8_0 without the int8 one
    copy = 0
    cpu = torch.device("cpu")
    dequantized = weight_type == "Q8_0" and not gguf_int8_default(False, cpu)
    if not int4_kernel_available(cpu) or dequantized:
        with LLM(str(source), dtype="bfloat16") as llm:
            copy = llm.engine.weights_bytes - safetensors_weight_bytes(source, 2)
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        with LLM(str(file), dtype=dtype) as llm:
            held = llm.engine.weights_bytes - (copy if size == 2 else 0)
            assert safetensors_weight_bytes(folder, size) == held


def test_a_hub_repository_of_gguf_files_resolves_by_tag(wide_llama, tmp_path, monkeypatch):
    """llama.cpp's ``-hf org/name:Q4_K_M``: a repository in the local Hugging Face cache
    holding several GGUF files (and a vision projector) serves the one its tag names; a folder
    holding one GGUF file serves it; no tag among several, or a tag naming none, is an error
    listing the files."""
    from infer.model.folders import find_model_folder
    from infer.model.gguf_folder import gguf_source

    from ..unit.test_loader import fake_hub_cache

    files = tmp_path / "files"
    files.mkdir()
    for kind in ("Q4_0", "Q8_0"):
        write_gguf(wide_llama, files / f"wide-{kind}.gguf", kind)
    shutil.copy(files / "wide-Q8_0.gguf", files / "mmproj-wide-f16.gguf")
    cache = tmp_path / "hub"
    snapshot = fake_hub_cache(cache, "acme/wide-GGUF", files)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = find_model_folder("acme/wide-GGUF:q8_0")
    assert gguf_source(folder) == snapshot / "wide-Q8_0.gguf"
    with LLM("acme/wide-GGUF:Q4_0", dtype="float32") as llm:
        assert llm.engine.checkpoint_quantization.method == "gguf"
    with pytest.raises(ModelLoadError, match=r"several GGUF files \(wide-Q4_0.gguf, wide-Q8_0"):
        find_model_folder("acme/wide-GGUF")
    with pytest.raises(ModelLoadError, match="no GGUF file named like 'Q5_K_M'"):
        find_model_folder("acme/wide-GGUF:Q5_K_M")
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(files / "wide-Q4_0.gguf", single / "model.gguf")
    assert gguf_source(find_model_folder(single)) == single / "model.gguf"


def test_an_embedding_gguf_pools_as_its_file_says(tiny_checkpoints, tmp_path):
    """``pooling_type`` LAST: the folder's embeddings (last token, normalized, as llama-server's
    are); MEAN: the mean of every prompt token's state, as the folder pools by the mean; CLS (a
    decoder's first token): served, but embedding requests are refused naming the pooling."""
    from infer.core.pooling_params import PoolingParams
    from infer.core.sampling_params import InvalidRequestError

    folder = tiny_checkpoints["qwen3"]
    prompts = PROMPTS[:3]
    with LLM(str(folder), dtype="float32") as llm:
        want = torch.tensor([r.outputs.embedding for r in llm.embed(prompts)])
    last = write_gguf(folder, tmp_path / "last.gguf", "F32", pooling="LAST")
    with LLM(str(last), dtype="float32") as llm:
        got = torch.tensor([r.outputs.embedding for r in llm.embed(prompts)])
        raw = llm.embed(prompts[:1], PoolingParams(normalize=False))[0].outputs.embedding
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert abs(torch.tensor(raw).norm().item() - 1.0) > 1e-3  # (normalizing did something)
    with LLM(str(folder), dtype="float32", pooler_config={"pooling_type": "MEAN"}) as llm:
        want = torch.tensor([r.outputs.embedding for r in llm.embed(prompts)])
    mean = write_gguf(folder, tmp_path / "mean.gguf", "F32", pooling="MEAN")
    with LLM(str(mean), dtype="float32") as llm:
        got = torch.tensor([r.outputs.embedding for r in llm.embed(prompts)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    cls = write_gguf(folder, tmp_path / "cls.gguf", "F32", pooling="CLS")
    with LLM(str(cls), dtype="float32") as llm:
        with pytest.raises(InvalidRequestError, match="CLS"):
            llm.embed(prompts[:1])
        assert llm.generate(prompts[:1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids

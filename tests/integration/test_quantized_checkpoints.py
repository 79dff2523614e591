"""GPTQ and AWQ checkpoints load as their formats define them.

The tests write the tiny Llama's linear layers in each layout from known integers (4-bit values,
zeros, float16 scales), packing them here from the formats' definitions, beside a plain
checkpoint holding the matrices those integers stand for. infer serves the quantized folder
with exactly the plain folder's logits (the dequantized products are exact in float32) and
transformers' greedy tokens; act-order (``desc_act``: groups in any order, ``g_idx``) is
honoured; a checkpoint it cannot read fails at start-up naming the field or tensor.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from infer import LLM, SamplingParams
from infer.runner.int4 import Int4Linear, int4_kernel_available

from .conftest import PROMPTS

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 16
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM layout: nibble k holds column 8c + ORDER[k]


def _int32(x: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns (< 2^32) as the int32s a checkpoint stores."""
    return torch.from_numpy(x.numpy().astype(np.uint32).view(np.int32))


def pack_rows(q: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """GPTQ's qweight: ``[in, out]`` values -> ``[in / n, out]`` (n = 32 / bits), value k of
    row r = q[n r + k], lowest bits first."""
    n = 32 // bits
    out = torch.zeros(q.shape[0] // n, q.shape[1], dtype=torch.int64)
    for k in range(n):
        out |= q[k::n].long() << (bits * k)
    return _int32(out)


def pack_cols(q: torch.Tensor, order=None, bits: int = 4) -> torch.Tensor:
    """``[R, C]`` values -> ``[R, C / n]``, value k of column c = q[:, n c + order[k]]."""
    n = 32 // bits
    order = order or tuple(range(n))
    out = torch.zeros(q.shape[0], q.shape[1] // n, dtype=torch.int64)
    for k in range(n):
        out |= q[:, order[k] :: n].long() << (bits * k)
    return _int32(out)


def _layers(state: dict, lm_head: bool = False) -> list[str]:
    names = (*LINEARS, "lm_head") if lm_head else LINEARS
    return [
        n[: -len(".weight")] for n in state if n.endswith(".weight") and n.split(".")[-2] in names
    ]


def write_quantized(
    src, dst_ref, dst_q, method: str, desc_act: bool = False, seed: int = 0, bits: int = 4,
    lm_head: bool = False,
):  # fmt: skip
    """The tiny checkpoint at ``src`` with its linears replaced by integer-made matrices: plain
    at ``dst_ref``, in ``method``'s layout at ``dst_q`` (``lm_head``: the vocabulary
    projection too, as GPTQ's ``"lm_head": true`` writes it)."""
    gen = torch.Generator().manual_seed(seed)
    state = load_file(str(src / "model.safetensors"))
    plain, packed = (
        dict(state),
        {k: v for k, v in state.items() if k[: -len(".weight")] not in _layers(state, lm_head)},
    )
    orders: dict[int, torch.Tensor] = {}  # act-order: one per input width, as GPTQ's (its
    # order sorts the inputs' Hessian diagonal, the same for layers that share their input)
    for layer in _layers(state, lm_head):
        out_f, in_f = state[layer + ".weight"].shape
        groups = in_f // GROUP
        # GPTQ's "gptq" format stores zero - 1 in a nibble: its zeros are 1..16 (AWQ's 0..15)
        top = (1 << bits) - 1
        low = 1 if method == "gptq" else 0
        q = torch.randint(0, top + 1, (in_f, out_f), generator=gen)
        z = torch.randint(low, low + top + 1, (groups, out_f), generator=gen)
        z[0, :8] = low  # extreme groups too
        z[-1, -8:] = low + top
        scales = (0.02 + 0.08 * torch.rand(groups, out_f, generator=gen)).half()
        g_idx = torch.arange(in_f) // GROUP
        if desc_act:  # act-order: input rows belong to groups in a shuffled order
            if in_f not in orders:
                orders[in_f] = torch.randperm(in_f, generator=gen)
            g_idx = g_idx[orders[in_f]]
        w = (scales.float()[g_idx] * (q - z[g_idx]).float()).t().contiguous()
        plain[layer + ".weight"] = w
        if method == "gptq":
            packed[layer + ".qweight"] = pack_rows(q, bits)
            packed[layer + ".qzeros"] = pack_cols(z - 1, bits=bits)  # "gptq" stores zero - 1
            packed[layer + ".g_idx"] = g_idx.int()
        else:
            packed[layer + ".qweight"] = pack_cols(q, AWQ_ORDER)
            packed[layer + ".qzeros"] = pack_cols(z, AWQ_ORDER)
        packed[layer + ".scales"] = scales
    for dst, tensors in ((dst_ref, plain), (dst_q, packed)):
        shutil.copytree(src, dst)
        save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst_q / "config.json").read_text())
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": GROUP,
                                         "desc_act": desc_act, "sym": False,
                                         "checkpoint_format": "gptq", "lm_head": lm_head}  # fmt: skip
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                         "version": "gemm", "zero_point": True}  # fmt: skip
    (dst_q / "config.json").write_text(json.dumps(config))


def _logits_and_tokens(path, dtype="float32", int4_layers=None):
    with LLM(str(path), dtype=dtype, block_size=4) as llm:
        outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                         prompt_logprobs=1))  # fmt: skip
        lps = torch.tensor([lp.logprob for o in outs for lp in o.prompt_logprobs[1:]])
        if int4_layers is not None:
            int4 = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int4Linear)]
            assert len(int4) == int4_layers
            assert all(m.mode == ("kernel" if dtype == "bfloat16" else "dequant") for m in int4)
        return lps, [o.outputs[0].token_ids for o in outs]


# The tiny Llama's fused layers (qkv, o, gate_up, down) x 3 decoder layers
FUSED_LAYERS = 12


@pytest.mark.parametrize(
    ("method", "desc_act", "bits", "lm_head"),
    [("gptq", False, 4, False), ("gptq", True, 4, False), ("gptq", False, 8, False),
     ("awq", False, 4, False), ("gptq", False, 4, True)],
)  # fmt: skip
def test_quantized_checkpoint_serves_the_dequantized_model(
    method, desc_act, bits, lm_head, tiny_checkpoints, tmp_path
):
    """float32: the 4-bit layers stay 4-bit (dequantized per product: float32 activations are
    not rounded to a kernel's bf16) and give the plain model's logits; 8-bit ones are
    dequantized at load, and so is a quantized vocabulary projection (GPTQ's ``lm_head``: it
    crashed the start-up)."""
    ref, quant = tmp_path / "ref", tmp_path / method
    write_quantized(tiny_checkpoints["llama"], ref, quant, method, desc_act, bits=bits,
                    lm_head=lm_head)  # fmt: skip
    want_lps, want_tokens = _logits_and_tokens(ref)
    got_lps, got_tokens = _logits_and_tokens(quant, int4_layers=FUSED_LAYERS if bits == 4 else 0)
    if desc_act:  # inputs gathered into group order: the same products, summed in another order
        torch.testing.assert_close(got_lps, want_lps, rtol=0, atol=1e-4)
    else:
        assert torch.equal(got_lps, want_lps)  # the same float32 weights, to the bit
    assert got_tokens == want_tokens
    # and the plain folder is what transformers computes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref)
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    for prompt, tokens in zip(PROMPTS[:4], want_tokens, strict=True):
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        assert g[0, len(ids) :].tolist() == tokens


@pytest.mark.skipif(not int4_kernel_available(torch.device("cpu")), reason="no int4 CPU kernel")
@pytest.mark.parametrize(("method", "desc_act"), [("gptq", False), ("gptq", True), ("awq", False)])
def test_bf16_4bit_kernel_is_as_close_to_float32_as_the_plain_bf16_model(
    method, desc_act, tiny_checkpoints, tmp_path
):
    """bf16: the C++ kernel multiplies the 4-bit integers exactly (the plain bf16 model holds
    the same weights rounded to bf16), so its logits sit as close to the float32 model's as the
    plain bf16 model's do. A wrong nibble, zero, scale or permutation lands far off."""
    ref, quant = tmp_path / "ref", tmp_path / method
    write_quantized(tiny_checkpoints["llama"], ref, quant, method, desc_act)
    exact, _ = _logits_and_tokens(ref)
    plain, _ = _logits_and_tokens(ref, "bfloat16")
    got, _ = _logits_and_tokens(quant, "bfloat16", int4_layers=FUSED_LAYERS)
    plain_err, got_err = (plain - exact).abs().mean(), (got - exact).abs().mean()
    print(f"{method} desc_act={desc_act}: mean |logprob error| plain bf16 {plain_err:.4f}, "
          f"4-bit kernel {got_err:.4f}")  # fmt: skip
    assert got_err <= 1.5 * plain_err


def test_quantization_flag_names_the_checkpoints_format(tiny_checkpoints, tmp_path):
    ref, quant = tmp_path / "ref", tmp_path / "gptq"
    write_quantized(tiny_checkpoints["llama"], ref, quant, "gptq")
    with LLM(str(quant), dtype="float32", quantization="gptq") as llm:
        assert llm.engine.checkpoint_quantization.method == "gptq"
    with pytest.raises(ValueError, match=r"--quantization awq: .* is a gptq checkpoint"):
        LLM(str(quant), dtype="float32", quantization="awq")
    with pytest.raises(ValueError, match="is not a quantized checkpoint"):
        LLM(str(ref), dtype="float32", quantization="gptq")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["quantization_config"].update(bits=3), "quantization_config.bits is 3"),
        (lambda c: c["quantization_config"].update(quant_method="bitsandbytes"),
         "quant_method 'bitsandbytes' is not supported"),
        (lambda c: c["quantization_config"].update(group_size=0), "group_size 0"),
        (lambda c: c["quantization_config"].update(dynamic={"+:.*down_proj": {"bits": 8}}),
         "quantization_config.dynamic"),
    ],
)  # fmt: skip
def test_unreadable_quantization_configs_name_the_field(edit, message, tiny_checkpoints, tmp_path):
    ref, quant = tmp_path / "ref", tmp_path / "gptq"
    write_quantized(tiny_checkpoints["llama"], ref, quant, "gptq")
    config = json.loads((quant / "config.json").read_text())
    edit(config)
    (quant / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=message):
        LLM(str(quant), dtype="float32")


def test_an_autogptq_quantize_config_json_is_read(tiny_checkpoints, tmp_path):
    """Older GPTQ folders keep their settings in ``quantize_config.json``, not in config.json
    (it was read as a plain checkpoint: "q_proj.weight is missing")."""
    ref, quant = tmp_path / "ref", tmp_path / "gptq"
    write_quantized(tiny_checkpoints["llama"], ref, quant, "gptq")
    config = json.loads((quant / "config.json").read_text())
    qc = config.pop("quantization_config")
    del qc["quant_method"]  # (AutoGPTQ's file does not say)
    (quant / "config.json").write_text(json.dumps(config))
    (quant / "quantize_config.json").write_text(json.dumps(qc))
    assert _logits_and_tokens(quant)[1] == _logits_and_tokens(ref)[1]


def test_a_missing_qzeros_tensor_is_named(tiny_checkpoints, tmp_path):
    ref, quant = tmp_path / "ref", tmp_path / "awq"
    write_quantized(tiny_checkpoints["llama"], ref, quant, "awq")
    state = load_file(str(quant / "model.safetensors"))
    del state["model.layers.0.self_attn.k_proj.qzeros"]
    save_file(state, str(quant / "model.safetensors"))
    with pytest.raises(Exception, match=r"'model.layers.0.self_attn.k_proj.qzeros' is missing"):
        LLM(str(quant), dtype="float32")


def test_plan_counts_a_quantized_folder_as_the_engine_holds_it(tiny_checkpoints, tmp_path):
    """`infer plan --model` reads headers only: a packed qweight counts as the weights it holds;
    in bytes, a 4-bit layer as the engine keeps it (half a byte a weight, 3 bytes a group and
    output), an 8-bit one as the dequantized weights; the start-up's count agrees."""
    from infer.plan import safetensors_num_params, safetensors_weight_bytes

    for method, bits in (("gptq", 4), ("gptq", 8), ("awq", 4)):
        ref, quant = tmp_path / f"ref-{method}{bits}", tmp_path / f"{method}{bits}"
        write_quantized(tiny_checkpoints["llama"], ref, quant, method, bits=bits)
        assert safetensors_num_params(quant) == safetensors_num_params(ref)
        state = load_file(str(quant / "model.safetensors"))
        linear = sum(v.numel() * (32 // bits) for k, v in state.items() if k.endswith(".qweight"))
        groups = sum(v.numel() for k, v in state.items() if k.endswith(".scales"))
        plain = safetensors_num_params(ref) * 4
        want = plain if bits == 8 else plain - linear * 4 + linear // 2 + groups * 3
        assert safetensors_weight_bytes(quant, 4) == want
        if bits == 4:
            with LLM(str(quant), dtype="float32") as llm:
                assert llm.engine.weights_bytes == want


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_plan_with_quantization_counts_what_the_engine_holds(method, tiny_checkpoints):
    """`infer plan --model DIR --quantization M` from the headers: within 1% of the bytes the
    engine reports once it has quantized the model (float32: no packed bf16 copies)."""
    from infer.plan import quantized_weight_bytes

    path = tiny_checkpoints["llama"]
    planned = quantized_weight_bytes(path, 4, method)
    with LLM(str(path), dtype="float32", quantization=method) as llm:
        held = llm.engine.weights_bytes
    assert abs(planned - held) <= 0.01 * held, (planned, held)

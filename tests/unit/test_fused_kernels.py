"""The fused bf16 CPU kernels (norm, rope + KV store, act * up, argmax) against torch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.model.layers import GatedMLP, RMSNorm
from infer.model.rope import apply_rope
from infer.runner.attention import KVCache
from infer.runner.cpu.kernels import cpu_kernels

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ compiler for the CPU kernels")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 steps between two bf16 tensors of the same sign pattern."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ai - bi).abs().max()) if a.numel() else 0


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("rows,dim", [(1, 768), (5, 64), (64, 768), (3, 40)])
def test_add_rms_norm_matches_torch(rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, dim, generator=gen) * 3).bfloat16()
    h = torch.randn(rows, dim, generator=gen).bfloat16()
    weight = torch.randn(dim, generator=gen).bfloat16()
    residual, normed = kernels.add_rms_norm(x, h, weight, 1e-6)
    assert torch.equal(residual, x + h)  # the add rounds exactly as torch's bf16 add
    assert _ulps(normed, _torch_rms_norm(x + h, weight, 1e-6)) <= 1
    same, plain = kernels.add_rms_norm(x, None, weight, 1e-6)
    assert same is x and _ulps(plain, _torch_rms_norm(x, weight, 1e-6)) <= 1


def test_rms_norm_module_uses_the_kernel_only_for_cpu_bf16():
    norm = RMSNorm(64, 1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(7, 64)
    want = _torch_rms_norm(x, norm.weight, 1e-5)
    with torch.inference_mode():
        assert torch.equal(norm(x), want)  # float32: torch's ops
        norm.bfloat16()
        xb = x.bfloat16()
        got = norm(xb)
        assert _ulps(got, _torch_rms_norm(xb, norm.weight, 1e-5)) <= 1
        s, n = norm.add_forward(xb, xb)
        assert torch.equal(s, xb + xb) and torch.equal(n, norm(xb + xb))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 12, 64), (4, 2, 64), (2, 1, 24)])
def test_rope_write_kv_matches_apply_rope_and_index_copy(heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads)
    t, num_slots = 5, 32
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16()
    angle = torch.rand(t, head_dim // 2, generator=gen) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).bfloat16()
    sin = torch.cat((-angle.sin(), angle.sin()), -1).bfloat16()
    slots = torch.tensor([3, 17, 0, 31, 8])
    cache = KVCache(1, num_slots // 4, 4, kv_heads, head_dim, torch.bfloat16, "cpu")
    k_cache, v_cache = cache.layer(0)

    qk = qkv[:, : (heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
    want_qk = apply_rope(qk, cos[:, None], sin[:, None])
    want_v = qkv[:, (heads + kv_heads) * head_dim :].view(t, kv_heads, head_dim).clone()

    kernels.rope_write_kv(qkv, cos, sin, cache, 0, slots, heads, kv_heads, head_dim)
    got_qk = qkv[:, : (heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
    assert _ulps(got_qk, want_qk) <= 1
    assert torch.equal(k_cache[slots], got_qk[:, heads:])
    assert torch.equal(v_cache[slots], want_v)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("act,fn", [("silu", F.silu), ("gelu_pytorch_tanh", None)])
@pytest.mark.parametrize("rows,inter", [(1, 2048), (9, 40), (64, 512)])
def test_gated_mlp_act_mul_matches_torch(act, fn, rows, inter):
    fn = fn or (lambda x: F.gelu(x, approximate="tanh"))
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturation and zeros
    got = kernels.act_mul(gate_up, "silu" if act == "silu" else "gelu_tanh")
    gate, up = gate_up.split(inter, dim=-1)
    assert got.shape == (rows, inter)
    # Against float64 math: torch's own bf16 GELU rounds 1 + tanh(y) to 0 for x < ~-5, where
    # the kernel keeps the (tiny) true value.
    want = fn(gate.double()) * up.double()
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-6)
    if act == "silu":
        assert _ulps(got, fn(gate) * up) <= 1
    mlp = GatedMLP(16, inter, act, bias=False).bfloat16()
    assert mlp.fused_act is not None


def test_argmax_rows_matches_torch_with_ties_and_nan():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen)
    logits[1, 10] = logits[1, 900] = 50.0  # a tie: the first index wins
    logits[2, 999] = 60.0  # the maximum in the tail past the last full vector
    logits[3, 500] = float("nan")  # NaN counts as the maximum
    logits[4, 995] = float("nan")  # ... also in the tail
    logits[5] = float("-inf")
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(-1))
    short = torch.randn(3, 7, generator=gen)
    assert torch.equal(kernels.argmax_rows(short), short.argmax(-1))


def test_act_mul_rounds_denormal_results_like_torch():
    # Products below bf16's smallest normal (~1.2e-38) are rounded, not flushed to zero: the
    # BF16 conversion instruction would flush them, so such vectors take the integer rounding.
    gate_up = torch.zeros(3, 64, dtype=torch.bfloat16)
    gate_up[:, :32] = torch.linspace(0.5, 1.0, 32)
    gate_up[0, 32:] = torch.linspace(1e-39, 9e-39, 32)  # bf16 denormals
    gate_up[1, 32:] = -torch.linspace(1e-39, 9e-39, 32)  # negative ones
    gate_up[2, 32:] = torch.linspace(1.0, 2.0, 32)  # plain values...
    gate_up[2, 32:64:5] = 3e-39  # ...with a denormal in some lanes of each vector
    got = kernels.act_mul(gate_up, "silu")
    gate, up = gate_up.split(32, dim=-1)
    want = F.silu(gate) * up
    denormal = (want != 0) & (want.abs() < 1.1754944e-38)
    assert denormal[:2].all() and denormal[2].sum() == 7
    assert _ulps(got, want) <= 1
    assert (got[denormal] != 0).all()

"""The GPU step's fused element-wise kernels (Triton) against the torch ops they replace.

On a CPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, set by the test conftest
without CUDA) in float32 and float16 (the interpreter reads bfloat16 as NaN); on a GPU in
bfloat16 too. The kernels round where torch's ops round, so float16 results agree to within an
ulp of the activation dtype and float32 ones to float32 summation order.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from infer.model.layers import _gelu_tanh  # noqa: E402
from infer.model.rope import apply_rope  # noqa: E402
from infer.runner.gpu import triton_fused  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _tol(dtype: torch.dtype) -> dict:
    return {
        torch.float32: dict(atol=1e-5, rtol=1e-5),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
        torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    }[dtype]


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 80, 2048])
def test_add_rms_norm_matches_torch(dtype, dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(5, dim, generator=g).to(DEVICE, dtype)
    h = torch.randn(5, dim, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    res, out = triton_fused.add_rms_norm(x, h, w, 1e-6)
    want_res = x + h
    assert torch.equal(res, want_res)  # the add rounds once, as torch's
    torch.testing.assert_close(out, _torch_rms_norm(want_res, w, 1e-6), **_tol(dtype))
    same, normed = triton_fused.add_rms_norm(x, None, w, 1e-6)
    assert same.data_ptr() == x.data_ptr()
    torch.testing.assert_close(normed, _torch_rms_norm(x, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_and_mul_matches_torch(dtype, act):
    inter = 1100  # not a multiple of the block: the tail is masked
    x = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    gate, up = x.split(inter, dim=-1)
    fn = torch.nn.functional.silu if act == "silu" else _gelu_tanh
    torch.testing.assert_close(triton_fused.act_and_mul(x, act), fn(gate) * up, **_tol(dtype))
    with pytest.raises(ValueError, match="relu"):
        triton_fused.act_and_mul(x, "relu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 2, 16), (32, 8, 64), (6, 6, 128), (14, 2, 64), (24, 8, 128)],
)
def test_rope_and_store_rotates_in_place_and_stores_kv(dtype, heads, kv_heads, head_dim):
    """q and k rotated as apply_rope does; k and v land at their slots; slot -1 stores nothing
    and every other cache row is untouched."""
    g = torch.Generator().manual_seed(heads)
    t = 4
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(t, width, generator=g).to(DEVICE, dtype)
    angles = torch.randn(t, head_dim // 2, generator=g)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(DEVICE, dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(DEVICE, dtype)
    k_cache = torch.randn(10, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(10, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([7, -1, 0, 3], dtype=torch.int32, device=DEVICE)

    qk = qkv[:, : (heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
    want_qk = apply_rope(qk.clone(), cos[:, None], sin[:, None])
    want_v = qkv[:, (heads + kv_heads) * head_dim :].view(t, kv_heads, head_dim).clone()
    triton_fused.rope_and_store(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, head_dim)

    torch.testing.assert_close(qk, want_qk, **_tol(dtype))
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot], qk[row, heads:])
            assert torch.equal(v_cache[slot], want_v[row])
    untouched = [s for s in range(10) if s not in (7, 0, 3)]
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="a race between warps shows only on a GPU")
def test_rope_and_store_caches_the_rotated_keys_at_scale():
    """28 q heads on 4 kv heads (a head tile of 16 does not divide 28): every cached key is the
    rotated k of its token, over 4,096 tokens, three times (each k head is stored from the
    registers that rotated it; reading it back from qkv raced between warps)."""
    heads, kv_heads, head_dim, t = 28, 4, 128, 4096
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for _ in range(3):
        width = (heads + 2 * kv_heads) * head_dim
        qkv = torch.randn(t, width, generator=g, device=DEVICE).to(torch.bfloat16)
        angles = torch.randn(t, head_dim // 2, generator=g, device=DEVICE)
        cos = torch.cat((angles.cos(), angles.cos()), -1).to(torch.bfloat16)
        sin = torch.cat((-angles.sin(), angles.sin()), -1).to(torch.bfloat16)
        k_cache = torch.zeros(t, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.arange(t, dtype=torch.int32, device=DEVICE)
        triton_fused.rope_and_store(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads,
                                    head_dim)  # fmt: skip
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
        assert torch.equal(k_cache, k)

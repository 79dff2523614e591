"""One-byte KV cache values: the quantize / dequantize round trip, the C++ store and decode
kernels against the torch reference, and what a quantized cache holds."""

from __future__ import annotations

import pytest
import torch

from infer.kv_cache.sizing import kv_bytes_per_token, kv_value_bytes
from infer.runner import kv_quant
from infer.runner.attention import KVCache
from infer.runner.cpu.kernels import cpu_kernels

KINDS = ["int8", "fp8"]
kernels = cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C++ compiler for the CPU kernels")


def _rows(seed: int = 0, n: int = 64, d: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen) * torch.logspace(-3, 3, n)[:, None]
    x[0] = 0.0  # an all-zero row
    x[1, 5] = 1e4  # one outlier
    x[2] = 1e-30  # tiny
    x[3, :] = -7.0  # constant
    x[4, :2] = torch.tensor([1e-3, -1e-3])  # tiny but not zero: a nonzero scale
    return x


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_error_is_bounded_and_finite(kind):
    x = _rows()
    values, scales = kv_quant.quantize(x, kind)
    assert values.dtype == kv_quant.STORAGE_DTYPES[kind] and scales.dtype == torch.bfloat16
    back = kv_quant.dequantize(values, scales, kind, torch.float32)
    assert torch.isfinite(back).all() and torch.isfinite(scales.float()).all()
    s = scales.float()[:, None]
    # The scale is rounded up, so nothing clips: |x| / scale <= qmax.
    assert (x.abs() <= s * kv_quant.QMAX[kind] * (1 + 1e-6)).all()
    err = (back - x).abs()
    if kind == "int8":
        assert (err <= s / 2 * (1 + 1e-5)).all()  # half a step of the row's own scale
    else:  # e4m3: 3 mantissa bits (half a step: 1/16 relative), subnormal steps of 2^-9 scale
        assert (err <= torch.maximum(x.abs() / 16, s * 2**-10) * (1 + 1e-5)).all()
    assert not back[0].any() and scales[0] == 0  # zero stays exactly zero


def test_int8_and_fp8_scales_are_rounded_up_to_bf16():
    x = torch.tensor([[1.0, -3.0, 0.5]])
    for kind in KINDS:
        _, scale = kv_quant.quantize(x, kind)
        assert scale.float().item() >= 3.0 / kv_quant.QMAX[kind]
        assert scale.float().item() < 3.0 / kv_quant.QMAX[kind] * (1 + 2**-7)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kernel_writes_what_the_reference_computes(kind, dtype):
    x = _rows(1, n=10, d=64).view(5, 2, 64).to(dtype)
    cache = KVCache(1, 4, 4, 2, 64, dtype, "cpu", kv_dtype=kind)
    slots = torch.tensor([7, 0, 12, 3, 15])
    kernels.store_kv(x, -x, cache, 0, slots)
    k_cache, v_cache = cache.layer(0)
    k_scales, v_scales = cache.layer_scales(0)
    for got, got_scales, src in ((k_cache, k_scales, x), (v_cache, v_scales, -x)):
        want, want_scales = kv_quant.quantize(src, kind)
        assert torch.equal(got[slots], want) and torch.equal(got_scales[slots], want_scales)
    torch_cache = KVCache(1, 4, 4, 2, 64, dtype, "cpu", kv_dtype=kind)
    torch_cache.store(0, slots, x, -x)
    assert torch.equal(torch_cache.tensor, cache.tensor)
    assert torch.equal(torch_cache.scales, cache.scales)
    k, v = cache.gather(0, slots)
    assert k.dtype == dtype
    assert torch.equal(k, kv_quant.dequantize(*kv_quant.quantize(x, kind), kind, dtype))


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", [
    (torch.bfloat16, 12, 12, 64), (torch.bfloat16, 8, 2, 32), (torch.bfloat16, 8, 2, 128),
    (torch.float32, 4, 2, 16),
])  # fmt: skip
def test_decode_kernel_on_a_quantized_cache_matches_dequantized_attention(
    kind, dtype, heads, kv_heads, head_dim
):
    gen = torch.Generator().manual_seed(3)
    block_size, num_blocks = 4, 24
    cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype, "cpu", kv_dtype=kind)
    slots = torch.randperm(num_blocks * block_size, generator=gen)
    kv = torch.randn(2, len(slots), kv_heads, head_dim, generator=gen).to(dtype)
    cache.store(0, slots, kv[0], kv[1])
    lens = [1, 7, 33]
    tables = torch.zeros(3, 9, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen)[:18].view(3, 6).int()
    tables[:, :6] = perm
    q = torch.randn(3, heads, head_dim, generator=gen).to(dtype)
    out = kernels.decode_attention(
        q, cache, 0, tables, torch.tensor(lens, dtype=torch.int32), head_dim**-0.5, None
    )
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        s = tables[b, pos // block_size].long() * block_size + pos % block_size
        k, v = cache.gather(0, s)  # dequantized
        k = k.float().repeat_interleave(heads // kv_heads, 1)
        v = v.float().repeat_interleave(heads // kv_heads, 1)
        p = (torch.einsum("hd,lhd->hl", q[b].float(), k) * head_dim**-0.5).softmax(-1)
        want = torch.einsum("hl,lhd->hd", p, v)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[b].float(), want, atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 12, 64), (8, 2, 64), (4, 2, 128)])
def test_decode_reads_every_byte_as_the_bf16_value_it_holds(kind, heads, kv_heads, head_dim):
    """Every e4m3 value and every int8 the cache stores (-127 .. 127) is a bf16 value: with unit
    scales, a cache of such bytes (every code, subnormals and both zeros included) must give the
    bits of a bf16 cache that holds their values."""
    gen = torch.Generator().manual_seed(5)
    block_size, num_blocks = 4, 32
    num_slots = block_size * num_blocks
    quantized = KVCache(1, num_blocks, block_size, kv_heads, head_dim, torch.bfloat16, "cpu",
                        kv_dtype=kind)  # fmt: skip
    plain = KVCache(1, num_blocks, block_size, kv_heads, head_dim, torch.bfloat16, "cpu")
    if kind == "fp8":
        codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
        small = codes[(codes & 0x7F) < 0x38]  # |value| < 1
        decode = lambda raw: raw.view(torch.float8_e4m3fn).to(torch.bfloat16)  # noqa: E731
    else:
        codes = torch.arange(-127, 128, dtype=torch.int8)
        small = codes[codes.abs() <= 2]
        decode = lambda raw: raw.to(torch.bfloat16)  # noqa: E731
    # Small magnitudes in most places (softmax keeps every score in play), every code somewhere.
    raw = small[torch.randint(len(small), (2, num_slots, kv_heads, head_dim), generator=gen)]
    raw.view(2, -1)[:, : len(codes)] = codes
    quantized.tensor.copy_(raw[:, None])
    assert quantized.scales is not None
    quantized.scales.fill_(1.0)
    plain.tensor.copy_(decode(raw)[:, None])
    lens = torch.tensor([1, 7, 33, 70, 128], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen)[:30].view(5, 6).int()
    tables = tables.repeat(1, 6)[:, :32]  # long contexts come back to the same blocks
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(torch.bfloat16)
    got = kernels.decode_attention(q, quantized, 0, tables, lens, head_dim**-0.5, None)
    want = kernels.decode_attention(q, plain, 0, tables, lens, head_dim**-0.5, None)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, want)


def test_a_one_byte_cache_holds_about_twice_the_tokens():
    for head_dim in (64, 128):
        bf16 = kv_bytes_per_token(12, 12, head_dim, *kv_value_bytes("auto", 2))
        for kind in KINDS:
            one_byte = kv_bytes_per_token(12, 12, head_dim, *kv_value_bytes(kind, 2))
            assert one_byte == 2 * 12 * 12 * (head_dim + 2)
            assert bf16 / one_byte >= 1.9


def test_unknown_kv_cache_dtype_names_the_option_and_choices():
    with pytest.raises(ValueError, match=r"--kv-cache-dtype 'int4'.*auto, int8, fp8"):
        KVCache(1, 1, 4, 1, 8, torch.float32, "cpu", kv_dtype="int4")

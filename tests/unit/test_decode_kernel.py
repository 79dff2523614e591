"""The C++ decode-attention kernel against a direct computation over the same paged cache."""

from __future__ import annotations

import pytest
import torch

from infer.runner.attention import AttentionContext, KVCache, SequenceSlice
from infer.runner.attention.torch_ref import TORCH_ATTENTION
from infer.runner.cpu.kernels import cpu_kernels

from ._kernel_helpers import count_calls, shuffled_block_tables

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ compiler for the CPU kernels")


def _reference(q, k_cache, v_cache, tables, lens, block_size, scale, window):
    out = []
    for b, (table, n) in enumerate(zip(tables, lens, strict=True)):
        slots = torch.tensor(
            [table[j // block_size] * block_size + j % block_size for j in range(n)]
        )
        k, v = k_cache[slots].double(), v_cache[slots].double()  # [L, Hkv, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale
        if window is not None:
            scores[:, : max(0, n - window)] = float("-inf")
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window",
    [(12, 12, 64, None), (8, 2, 128, 5), (16, 4, 64, None), (4, 1, 32, None)],
)
def test_kernel_matches_direct_attention(dtype, tol, heads, kv_heads, head_dim, window):
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks = 4, 40
    lens = [1, 5, 17, 33, 7]
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables, padded = shuffled_block_tables(gen, lens, block_size, num_blocks)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5

    cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype, "cpu")
    cache.tensor[0, 0] = k_cache
    cache.tensor[1, 0] = v_cache
    out = kernels.decode_attention(
        q, cache, 0, padded, torch.tensor(lens, dtype=torch.int32), scale, window
    )
    expected = _reference(q, k_cache, v_cache, tables, lens, block_size, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_attention_context_uses_kernel_and_agrees_with_torch_path(monkeypatch):
    """A decode step through AttentionContext gives the same output with and without the kernel."""
    gen = torch.Generator().manual_seed(1)
    cache = KVCache(1, 16, 4, 2, 16, torch.float32, "cpu")
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen))
    seqs = [
        SequenceSlice(6, 1, [3, 9]),
        SequenceSlice(0, 1, [5]),
        SequenceSlice(12, 1, [1, 2, 7, 0]),
    ]
    q = torch.randn(3, 4, 16, generator=gen)
    k = torch.randn(3, 2, 16, generator=gen)
    v = torch.randn(3, 2, 16, generator=gen)

    calls = count_calls(monkeypatch, type(kernels), "decode_attention")
    with_kernel = AttentionContext(cache, seqs, "cpu").attend(0, q, k, v, scale=0.25)
    ctx = AttentionContext(cache, seqs, "cpu", TORCH_ATTENTION)
    with_torch = ctx.attend(0, q, k, v, scale=0.25)
    assert calls == [1]
    torch.testing.assert_close(with_kernel, with_torch, atol=1e-5, rtol=1e-5)


def test_the_null_backend_attends_nothing_and_writes_nothing():
    from infer.runner.attention.null import NULL_ATTENTION

    cache = KVCache(1, 4, 4, 2, 16, torch.float32, "cpu")
    seqs = [SequenceSlice(0, 3, [1]), SequenceSlice(5, 1, [2, 3])]
    q = torch.randn(4, 4, 16)
    k = torch.randn(4, 2, 16)
    ctx = AttentionContext(cache, seqs, "cpu", NULL_ATTENTION)
    assert ctx.attend(0, q, k, k, scale=0.25) is q
    assert not ctx.can_store_rotated(torch.zeros(4, 128, dtype=torch.bfloat16))
    assert cache.tensor.count_nonzero() == 0

"""The C++ prefill-attention kernel against SDPA over the same paged cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.runner.attention import AttentionContext, KVCache, SequenceSlice
from infer.runner.cpu.kernels import PrefillChunks, cpu_kernels

from ._kernel_helpers import count_calls, shuffled_block_tables

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(
    kernels is None or not kernels.has_prefill_attention,
    reason="the prefill kernel needs a C++ compiler and AVX-512 BF16 or AVX2",
)


def _paged_cache(gen, kv_heads, head_dim, block_size, num_blocks):
    cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, torch.bfloat16, "cpu")
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen))
    return cache


def _reference(q, cache, table, past, n, scale, window):
    """float64 SDPA of n queries at positions past.. over keys 0 .. past + n - 1."""
    bs = cache.block_size
    slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(past + n)])
    k_cache, v_cache = cache.layer(0)
    k, v = k_cache[slots].double().transpose(0, 1), v_cache[slots].double().transpose(0, 1)
    q_pos = torch.arange(past, past + n)[:, None]
    k_pos = torch.arange(past + n)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[0],
    )  # fmt: skip
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,window",
    [(12, 12, 64, 16, None), (8, 2, 128, 4, None), (14, 2, 64, 16, 40), (4, 1, 32, 8, 9),
     (4, 4, 256, 32, None)],
)  # fmt: skip
def test_kernel_matches_sdpa(heads, kv_heads, head_dim, block_size, window):
    """Chunks of every shape in one call: a fresh prompt, a later chunk over a long past, a
    one-token chunk, a chunk longer than a query tile; GQA, sliding windows, odd lengths."""
    gen = torch.Generator().manual_seed(0)
    chunks = [(100, 0), (33, 70), (1, 5), (64, 300), (7, 0)]  # (n, past)
    num_blocks = sum(-(-(n + past) // block_size) for n, past in chunks) + 3
    cache = _paged_cache(gen, kv_heads, head_dim, block_size, num_blocks)
    tables, padded = shuffled_block_tables(
        gen, [n + past for n, past in chunks], block_size, num_blocks
    )
    total = sum(n for n, _ in chunks)
    # The query as a strided view of a fused projection, as the model hands it over.
    qkv = torch.randn(total, heads + 2 * kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    q = qkv[:, :heads]
    starts = torch.tensor([0, *torch.tensor([n for n, _ in chunks]).cumsum(0)[:-1].tolist()])
    spec = PrefillChunks(
        q_starts=starts,
        q_lens=torch.tensor([n for n, _ in chunks]),
        pasts=torch.tensor([past for _, past in chunks]),
        block_tables=padded,
    )
    out = torch.full((total, heads, head_dim), float("nan"), dtype=torch.bfloat16)
    scale = head_dim**-0.5
    assert kernels.can_prefill(q, cache)
    kernels.prefill_attention(q, out, cache, 0, spec, scale, window)
    for i, (n, past) in enumerate(chunks):
        s = int(starts[i])
        expected = _reference(q[s : s + n], cache, tables[i], past, n, scale, window)
        # bf16 probabilities and output, float32 sums: bf16 rounding error, no more.
        torch.testing.assert_close(out[s : s + n].double(), expected, atol=2e-2, rtol=2e-2)


def test_attention_context_uses_kernel_and_agrees_with_sdpa_path(monkeypatch):
    """A mixed step (decodes and prompt chunks) through AttentionContext gives the same output
    with the prefill kernel as with the SDPA path, and calls the kernel once per layer."""
    gen = torch.Generator().manual_seed(1)
    cache = _paged_cache(gen, 2, 64, 4, 32)
    seqs = [
        SequenceSlice(6, 1, [3, 9]),  # decode
        SequenceSlice(0, 9, [5, 10, 11]),  # fresh prompt
        SequenceSlice(8, 5, [1, 2, 7, 0]),  # a later chunk
    ]
    q = torch.randn(15, 4, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(15, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(15, 2, 64, generator=gen).to(torch.bfloat16)

    calls = count_calls(monkeypatch, type(kernels), "prefill_attention")
    with_kernel = AttentionContext(cache, seqs, "cpu").attend(0, q, k, v, scale=0.125)
    ctx = AttentionContext(cache, seqs, "cpu")
    ctx.prefill_chunks = None
    with_sdpa = ctx.attend(0, q, k, v, scale=0.125)
    assert calls == [1]
    torch.testing.assert_close(with_kernel.float(), with_sdpa.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_cache_matches_the_dequantizing_sdpa_path(kv_dtype):
    """An int8 / fp8 cache is read as value * scale rounded to bf16, as KVCache.gather gives
    the SDPA path: the kernel and that path agree on a mixed step."""
    gen = torch.Generator().manual_seed(2)
    cache = KVCache(1, 40, 4, 2, 64, torch.bfloat16, "cpu", kv_dtype=kv_dtype)
    seqs = [
        SequenceSlice(0, 23, [5, 10, 11, 3, 7, 20]),  # fresh prompt
        SequenceSlice(9, 6, [1, 2, 8, 0]),  # a later chunk over stored keys
        SequenceSlice(6, 1, [30, 31]),  # decode
    ]
    t = sum(s.num_new_tokens for s in seqs)
    q = torch.randn(t, 4, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(t, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(t, 2, 64, generator=gen).to(torch.bfloat16)
    # Past tokens of the later chunk and the decode: store some keys first.
    past = torch.randn(40 * 4, 2, 64, generator=gen).to(torch.bfloat16)
    cache.store(0, torch.arange(40 * 4), past, -past)
    assert kernels.can_prefill(q, cache)
    ctx = AttentionContext(cache, seqs, "cpu")
    assert ctx.prefill_chunks is not None
    with_kernel = ctx.attend(0, q, k, v, scale=0.125)
    ctx = AttentionContext(cache, seqs, "cpu")
    ctx.prefill_chunks = None
    with_sdpa = ctx.attend(0, q, k, v, scale=0.125)
    torch.testing.assert_close(with_kernel.float(), with_sdpa.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window,biased,keyed",
    [(12, 12, 64, None, False, False), (8, 2, 128, None, False, False),
     (4, 1, 32, None, False, False), (4, 4, 256, None, False, False),
     (4, 4, 64, 5, False, False), (6, 2, 32, 64, False, False), (12, 12, 64, None, True, False),
     (8, 2, 128, None, True, False), (4, 4, 64, 5, True, False), (8, 2, 64, None, False, True),
     (4, 4, 64, 8, True, True)],
)  # fmt: skip
def test_encoder_kernel_matches_sdpa(heads, kv_heads, head_dim, window, biased, keyed):
    """An encoder's step (``infer_encoder_attention``): each sequence's rows attend to all of
    its own rows (a window: those at most that far away, ModernBERT's local layers), none to
    another's; q, k and v strided views of one fused projection; lengths of one row, a key
    block and one past it, several query tiles; ``biased``: a bias by distance (MPNet's, per
    head and per signed distance) added to the scores; ``keyed``: only each sequence's first
    rows are keys (a ColBERT query's expansion tokens are queries only), within a window of
    them."""
    gen = torch.Generator().manual_seed(3)
    lens = [100, 1, 16, 17, 200, 7, 1000]
    key_lens = [90, 1, 9, 17, 193, 3, 996] if keyed else lens
    total = sum(lens)
    qkv = torch.randn(total, heads + 2 * kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    k = k.contiguous()  # (rows of k and v a different stride apart: a rotated k is a copy)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()])
    scale = head_dim**-0.5
    reach = 1100  # (past the longest input: its distances are a middle part of each row)
    bias = 2 * torch.randn(heads, 2 * reach + 1, generator=gen) if biased else None
    assert kernels.can_attend_encoder(q, k, v)
    out = kernels.encoder_attention(q, k, v, starts, torch.tensor(lens), scale, window, bias,
                                    torch.tensor(key_lens) if keyed else None)  # fmt: skip
    for s, n, keys in zip(starts.tolist(), lens, key_lens, strict=True):
        rows = [t[s : s + n].double().transpose(0, 1)[None] for t in (q, k, v)]
        pos = torch.arange(n)
        apart = pos[None, :] - pos[:, None]
        mask = None if window is None else apart.abs() <= window
        if keys < n:
            seen = (pos < keys)[None, :].expand(n, n).clone()
            mask = seen if mask is None else mask & seen
            blind = ~mask.any(1)  # (past the window from every key: it sees the last key)
            mask[blind, keys - 1] = True
        if bias is not None:
            by_distance = bias.double()[:, apart + reach]
            mask = by_distance if mask is None else by_distance.masked_fill(~mask, -torch.inf)
        expected = F.scaled_dot_product_attention(*rows, attn_mask=mask, scale=scale,
                                                  enable_gqa=heads != kv_heads)  # fmt: skip
        torch.testing.assert_close(out[s : s + n].double(), expected[0].transpose(0, 1),
                                   atol=2e-2, rtol=2e-2)  # fmt: skip


def test_key_counts_outside_an_input_are_refused():
    q = torch.zeros(20, 4, 64, dtype=torch.bfloat16)
    starts, lens = torch.tensor([0, 12]), torch.tensor([12, 8])
    for keys in ([12, 9], [0, 8]):
        with pytest.raises(ValueError, match="key_lens"):
            kernels.encoder_attention(q, q, q, starts, lens, 0.125, None, None,
                                      torch.tensor(keys))  # fmt: skip


def test_a_distance_bias_that_does_not_fit_is_refused():
    """A bias of the wrong head count, of an even width, or too short for the longest input
    is a ValueError naming its shape, never a read past it."""
    q = torch.zeros(20, 4, 64, dtype=torch.bfloat16)
    starts, lens = torch.tensor([0, 12]), torch.tensor([12, 8])
    for bias in (torch.zeros(3, 31), torch.zeros(4, 30), torch.zeros(4, 21)):
        shape = r"\(%d, %d\)" % tuple(bias.shape)  # noqa: UP031
        with pytest.raises(ValueError, match=f"a distance bias {shape} does not fit"):
            kernels.encoder_attention(q, q, q, starts, lens, 0.125, None, bias)
    kernels.encoder_attention(q, q, q, starts, lens, 0.125, None, torch.zeros(4, 23))


def test_an_encoder_step_takes_the_kernel_and_agrees_with_the_sdpa_path(monkeypatch):
    """AttentionContext.attend_bidirectional on the CPU backend calls the encoder kernel once
    and gives what the torch reference (padded SDPA) gives; float32 stays on the reference."""
    from infer.runner.attention.torch_ref import TorchAttention

    gen = torch.Generator().manual_seed(4)
    seqs = [SequenceSlice(0, 9, [0]), SequenceSlice(0, 30, [1, 2]), SequenceSlice(0, 5, [3])]
    qkv = torch.randn(44, 3, 4, 64, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.unbind(1)
    cache = KVCache(0, 4, 16, 4, 64, torch.bfloat16, "cpu")  # (an encoder's: no layers)
    calls = count_calls(monkeypatch, type(kernels), "encoder_attention")
    with_kernel = AttentionContext(cache, seqs, "cpu").attend_bidirectional(q, k, v, scale=0.125)
    reference = AttentionContext(cache, seqs, "cpu", backend=TorchAttention())
    with_sdpa = reference.attend_bidirectional(q, k, v, scale=0.125)
    assert calls == [1]
    torch.testing.assert_close(with_kernel.float(), with_sdpa.float(), atol=2e-2, rtol=2e-2)
    # a bias by distance: the same on both, padded (these lengths) or one SDPA call a sequence
    bias = torch.randn(4, 2 * 40 + 1, generator=gen)
    alike = [SequenceSlice(0, n, [i]) for i, n in enumerate((12, 10, 9))]
    skewed = [SequenceSlice(0, 40, [0, 1, 2]), *(SequenceSlice(0, 1, [3 + i]) for i in range(4))]
    for group in (alike, skewed):
        ctx = AttentionContext(cache, group, "cpu", backend=TorchAttention())
        assert isinstance(ctx.padded_layout(), list) == (group is skewed)
        rows = sum(s.num_new_tokens for s in group)
        args = (q[:rows], k[:rows], v[:rows])
        with_sdpa = ctx.attend_bidirectional(*args, scale=0.125, distance_bias=bias)
        with_kernel = AttentionContext(cache, group, "cpu").attend_bidirectional(
            *args, scale=0.125, distance_bias=bias
        )
        torch.testing.assert_close(with_kernel.float(), with_sdpa.float(), atol=2e-2, rtol=2e-2)
        unbiased = ctx.attend_bidirectional(*args, scale=0.125)
        assert (unbiased - with_sdpa).abs().max() > 0.1
    AttentionContext(cache, seqs, "cpu").attend_bidirectional(
        q.float(), k.float(), v.float(), scale=0.125
    )
    assert calls == [1, 1, 1]  # (float32: the reference, not the kernel)

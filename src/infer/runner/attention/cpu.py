"""The CPU's attention backend: the C++ kernels (``runner/cpu/csrc/paged_attention.cpp``,
``prefill_attention.cpp``, the rope + KV store), which read K and V in place through the block
tables. Where a kernel does not take the tensors (a dtype it lacks, a cache layout) that part
runs the torch reference instead, call by call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from infer.runner.attention.torch_ref import TorchAttention
from infer.runner.cpu.kernels import CpuKernels, kernels_bound

if TYPE_CHECKING:
    from infer.runner.attention.context import AttentionContext


class CpuAttention(TorchAttention):
    name = "cpu"

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    @property
    def wants_prefill_chunks(self) -> bool:  # type: ignore[override]
        return self.kernels.has_prefill_attention

    def store(
        self, ctx: AttentionContext, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        kernels = self.kernels
        if kernels.can_store_kv(k, ctx.kv_cache):
            kernels.store_kv(k, v, ctx.kv_cache, layer_idx, ctx.slot_mapping)
        else:
            super().store(ctx, layer_idx, k, v)

    def decode(self, ctx, layer_idx, q, scale, window, gqa):
        dg = ctx.decode_group
        cache = ctx.kv_cache
        if q.dtype == cache.dtype and self.kernels.supports(q.dtype):
            assert dg is not None
            return self.kernels.decode_attention(
                q, cache, layer_idx, dg.block_tables, dg.context_lens, scale, window
            )
        return super().decode(ctx, layer_idx, q, scale, window, gqa)

    def prefill(self, ctx, layer_idx, q, k, v, out, scale, window, gqa):
        chunks = ctx.prefill_chunks
        if chunks is not None and self.kernels.can_prefill(q, ctx.kv_cache):
            self.kernels.prefill_attention(q, out, ctx.kv_cache, layer_idx, chunks, scale, window)
        else:
            super().prefill(ctx, layer_idx, q, k, v, out, scale, window, gqa)

    def bidirectional(self, ctx, q, k, v, scale, window=None, distance_bias=None):
        if self.kernels.can_attend_encoder(q, k, v):
            starts, lens = ctx.encoder_rows()
            return self.kernels.encoder_attention(q, k, v, starts, lens, scale, window,
                                                  distance_bias, ctx.encoder_keys())  # fmt: skip
        return super().bidirectional(ctx, q, k, v, scale, window, distance_bias)

    def can_store_rotated(self, ctx: AttentionContext, qkv: torch.Tensor) -> bool:
        return (
            qkv.dtype == torch.bfloat16
            and ctx.kv_cache.dtype == torch.bfloat16
            and qkv.dim() == 2
            and qkv.stride(1) == 1
        )

    def rotate_and_store(
        self, ctx, layer_idx, qkv, cos, sin, num_heads, num_kv_heads, head_dim
    ) -> None:
        self.kernels.rope_write_kv(
            qkv,
            cos.contiguous(),
            sin.contiguous(),
            ctx.kv_cache,
            layer_idx,
            ctx.slot_mapping,
            num_heads,
            num_kv_heads,
            head_dim,
        )


cpu_attention = kernels_bound(CpuAttention)
"""The C++ kernels' backend, or None where they are not built (no g++, ``INFER_CPU_KERNELS=0``)."""

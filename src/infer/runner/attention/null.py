"""No attention: every layer's attention returns its query. For measuring what attention costs
(``infer bench decode-curve``): the QKV and output projections, RoPE (and, where the wrapped
backend fuses it with the KV store, that store), the MLP, norms, LM head and sampling run
unchanged. The outputs are meaningless."""

from __future__ import annotations

import torch

from infer.runner.attention.backend import AttentionBackend


class NullAttention(AttentionBackend):
    """``inner``'s rope + KV store kernel where it has one (so the layer's other work is what
    it was), and no attention."""

    name = "null"

    def __init__(self, inner: AttentionBackend | None = None) -> None:
        self.inner = inner

    def attend(self, ctx, layer_idx, q, k, v, scale, sliding_window, kv_stored) -> torch.Tensor:
        return q

    def bidirectional(self, ctx, q, k, v, scale, window=None, distance_bias=None) -> torch.Tensor:
        return q

    def can_store_rotated(self, ctx, qkv: torch.Tensor) -> bool:
        return self.inner is not None and self.inner.can_store_rotated(ctx, qkv)

    def rotate_and_store(self, ctx, layer_idx, qkv, cos, sin, num_heads, num_kv_heads, head_dim):
        assert self.inner is not None
        self.inner.rotate_and_store(
            ctx, layer_idx, qkv, cos, sin, num_heads, num_kv_heads, head_dim
        )


NULL_ATTENTION = NullAttention()

"""No attention: every layer's attention returns its query, and nothing is written to the KV
cache. For measuring what attention costs (``infer bench decode-curve``): the QKV and output
projections, the MLP, norms, LM head and sampling run unchanged. The outputs are meaningless."""

from __future__ import annotations

import torch

from infer.runner.attention.backend import AttentionBackend


class NullAttention(AttentionBackend):
    name = "null"

    def attend(self, ctx, layer_idx, q, k, v, scale, sliding_window, kv_stored) -> torch.Tensor:
        return q


NULL_ATTENTION = NullAttention()

"""The reference attention backend: contexts gathered from the cache and attended with torch's
SDPA, on any device and dtype (CUDA's torch path, a CPU without the C++ kernels, other dtypes
than the kernels take)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from infer.runner.attention.backend import AttentionBackend

if TYPE_CHECKING:
    from infer.runner.attention.context import AttentionContext


class TorchAttention(AttentionBackend):
    """Gather + SDPA: decode rows in one padded, masked batch; prefill chunks one at a time."""

    name = "torch"

    def store(
        self, ctx: AttentionContext, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        ctx.kv_cache.store(layer_idx, ctx.slot_mapping, k, v)

    def decode(
        self,
        ctx: AttentionContext,
        layer_idx: int,
        q: torch.Tensor,
        scale: float,
        window: int | None,
        gqa: bool,
    ) -> torch.Tensor:
        dg = ctx.decode_group
        assert dg is not None
        cache = ctx.kv_cache
        # index_select on the flat slot list is ~2x faster on CPU than advanced indexing.
        bd, lmax = dg.gather.shape
        ks, vs = cache.gather(layer_idx, dg.gather.reshape(-1))
        ks = ks.view(bd, lmax, *ks.shape[1:]).transpose(1, 2)
        vs = vs.view(bd, lmax, *vs.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [Bd, H, 1, D]
            ks.to(q.dtype),
            vs.to(q.dtype),
            attn_mask=dg.mask(window),
            scale=scale,
            enable_gqa=gqa,
        )
        return o[:, :, 0, :]

    def prefill(
        self,
        ctx: AttentionContext,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None,
        gqa: bool,
    ) -> None:
        for pf in ctx.prefills:
            qs = q[pf.start : pf.end].transpose(0, 1)  # [H, n, D]
            slots = pf.slots(ctx.device)
            if slots is None:
                ks = k[pf.start : pf.end].transpose(0, 1)
                vs = v[pf.start : pf.end].transpose(0, 1)
            else:
                kg, vg = ctx.kv_cache.gather(layer_idx, slots)
                ks, vs = kg.transpose(0, 1), vg.transpose(0, 1)  # [Hkv, L, D]
            mask = pf.mask(window, ctx.device)
            # NOTE: 4-D inputs: with 3-D ones CPU SDPA falls back to its slow math kernel
            # (~8x slower for a 512-token bf16 prefill).
            o = F.scaled_dot_product_attention(
                qs[None],
                ks.to(qs.dtype)[None],
                vs.to(qs.dtype)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa,
            )[0]
            out[pf.start : pf.end] = o.transpose(0, 1)


TORCH_ATTENTION = TorchAttention()

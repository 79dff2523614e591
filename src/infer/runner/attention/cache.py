"""The paged KV cache: K and V of every layer in one tensor, one row per slot."""

from __future__ import annotations

import torch

from infer.kv_cache.sizing import check_kv_cache_dtype
from infer.runner import kv_quant
from infer.runner.cpu import hugepages


class KVCache:
    """K and V for every layer: ``[2, num_layers, num_blocks * block_size, kv_heads, head_dim]``.

    With ``kv_dtype`` ``"int8"`` or ``"fp8"`` the values are one byte each and ``scales``
    ``[2, num_layers, num_slots, kv_heads]`` (bf16) holds each row's scale
    (:mod:`infer.runner.kv_quant`); ``dtype`` is then the dtype values are read back in.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_dtype: str = "auto",
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.kind = check_kv_cache_dtype(kv_dtype)
        num_slots = num_blocks * block_size
        storage = dtype if self.kind is None else kv_quant.STORAGE_DTYPES[self.kind]
        self.tensor = hugepages.zeros(
            2, num_layers, num_slots, num_kv_heads, head_dim, dtype=storage, device=device
        )
        self.scales: torch.Tensor | None = None
        if self.kind is not None:
            self.scales = torch.zeros(
                2, num_layers, num_slots, num_kv_heads, dtype=kv_quant.SCALE_DTYPE, device=device
            )

    @property
    def quantized(self) -> bool:
        return self.kind is not None

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K and V of one layer (one-byte values when quantized)."""
        return self.tensor[0, layer_idx], self.tensor[1, layer_idx]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.scales is None:
            return None, None
        return self.scales[0, layer_idx], self.scales[1, layer_idx]

    def store(self, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v`` ``[T, kv_heads, head_dim]`` at ``slots`` (quantizing them if needed)."""
        k_cache, v_cache = self.layer(layer_idx)
        if self.kind is None:
            k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
            return
        k_scales, v_scales = self.layer_scales(layer_idx)
        assert k_scales is not None and v_scales is not None
        for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
            values, scale = kv_quant.quantize(x, self.kind)
            cache.index_copy_(0, slots, values)
            scales.index_copy_(0, slots, scale)

    def gather(self, layer_idx: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[len(slots), kv_heads, head_dim]`` at ``slots``, in ``dtype``."""
        k_cache, v_cache = self.layer(layer_idx)
        ks = k_cache.index_select(0, slots)
        vs = v_cache.index_select(0, slots)
        if self.kind is None:
            return ks.to(self.dtype), vs.to(self.dtype)
        k_scales, v_scales = self.layer_scales(layer_idx)
        assert k_scales is not None and v_scales is not None
        return (
            kv_quant.dequantize(ks, k_scales.index_select(0, slots), self.kind, self.dtype),
            kv_quant.dequantize(vs, v_scales.index_select(0, slots), self.kind, self.dtype),
        )

    def block_views(self) -> list[torch.Tensor]:
        """Every stored tensor as ``[2, num_layers, num_blocks, block_size, ...]`` views: what a
        block swap copies."""
        views = []
        for t in (self.tensor, self.scales):
            if t is not None:
                views.append(t.view(2, t.shape[1], self.num_blocks, self.block_size, *t.shape[3:]))
        return views

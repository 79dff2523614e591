"""What the model's layers call on a step's attention: the runner's contexts implement it (the
torch / C++ one in ``runner/attention.py``, the Triton step's in ``runner/gpu/step.py``), so
the model needs nothing of the runner."""

from __future__ import annotations

from typing import Protocol

import torch


class Attention(Protocol):
    """One step's attention over the paged KV cache, layer by layer."""

    def can_store_rotated(self, qkv: torch.Tensor) -> bool:
        """Whether :meth:`rotate_and_store` takes this fused ``[T, (H + 2 Hkv) D]`` projection."""
        ...

    def rotate_and_store(
        self,
        layer_idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rope on q and k in place, k and v written to the cache; returns ``q, k, v`` views
        (then :meth:`attend` with ``kv_stored=True``)."""
        ...

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """Write ``k, v`` to the cache (unless ``kv_stored``) and attend: ``q`` ``[T, H, D]``,
        ``k, v`` ``[T, Hkv, D]`` -> ``[T, H, D]``."""
        ...

    def attend_bidirectional(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        window: int | None = None,
        distance_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """An encoder's attention: each sequence's tokens (a whole input) attend to all of its
        tokens (``window``: those at most that many positions away on either side; with
        ``distance_bias`` ``[H, 2R + 1]``, head h's score of key j for query i gains
        ``distance_bias[h, j - i + R]``); nothing is cached. ``[T, H, D]`` each ->
        ``[T, H, D]``."""
        ...

"""The fused kernels a device backend lends the model's layers, behind one small interface.

The layers are plain torch modules: each fusable piece (the residual add + RMSNorm, the
``act(gate) * up`` of a gated MLP, the q/k norms of Qwen 3 written in place, a mixture of
experts' whole layer) asks :func:`fused_ops` for the activations it holds and runs its own
torch ops when the answer (or the op) is None. The kernels live with the devices
(``runner/cpu/kernels.py``: the C++ CPU kernels; ``runner/gpu/triton_fused.py``: Triton), which
register a provider here when they are imported; the model never imports them::

    layer ── fused_ops(x) ──► providers, in registration order ──► the first FusedOps for x
                                  CPU bf16 tensors: the C++ kernels
                                  CUDA tensors:     the Triton kernels

Each fused op rounds where the torch ops round, so a layer's output does not depend on which
path ran beyond float32 summation order (the kernels' tests hold them to that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class FusedOps:
    """What one device's kernels do for the layers; a method returning None means "not for
    these tensors": the layer runs its torch ops."""

    fuses_qk_norm = False  # qk_norm_into is there

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``rms_norm(x) * weight`` in ``x``'s shape."""
        raise NotImplementedError

    def add_rms_norm(
        self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(x + h, rms_norm(x + h) * weight)``, or None."""
        return None

    def act_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor | None:
        """``act(gate) * up`` of a fused ``[T, 2 I]`` gate/up projection, or None."""
        return None

    def qk_norm_into(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> None:
        """RMSNorm each q and k head of ``qkv`` ``[T, (H + 2 Hkv) D]`` in place (only where
        :attr:`fuses_qk_norm`)."""
        raise NotImplementedError

    def moe_kernel(self, layer: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A mixture of experts' whole layer as one kernel (routing, experts, shared expert)
        for ``layer``'s weights as they are now: a callable ``x [T, hidden] -> out``, or None
        where it cannot take them. The layer builds it once per set of weights."""
        return None


Provider = Callable[[torch.Tensor], FusedOps | None]
"""A device's kernels for a tensor (None: not this tensor's device or dtype)."""

_providers: list[Provider] = []


def register_fused_ops(provider: Provider) -> None:
    """Lend the layers a device's kernels (called once, when the kernels' module loads)."""
    if provider not in _providers:
        _providers.append(provider)


def fused_ops(x: torch.Tensor) -> FusedOps | None:
    """The fused kernels that take ``x`` (None: the torch ops)."""
    for provider in _providers:
        ops = provider(x)
        if ops is not None:
            return ops
    return None

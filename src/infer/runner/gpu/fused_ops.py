"""The Triton element-wise kernels lent to the model's layers (see :mod:`infer.model.ops`)."""

from __future__ import annotations

import torch

from infer.model import ops
from infer.runner.gpu import triton_fused


class TritonFusedOps(ops.FusedOps):
    """The GPU step's element-wise kernels (``INFER_TRITON_FUSED=0``: none)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return triton_fused.add_rms_norm(x, None, weight, eps)[1]

    def add_rms_norm(self, x, h, weight, eps):
        if h.dtype != x.dtype:
            return None
        return triton_fused.add_rms_norm(x, h, weight, eps)

    def act_mul(self, gate_up, act):
        return triton_fused.act_and_mul(gate_up, act)


_TRITON = TritonFusedOps()


def triton_fused_ops(x: torch.Tensor) -> ops.FusedOps | None:
    """The Triton kernels for CUDA activations (None: not CUDA, no triton, switched off)."""
    return _TRITON if triton_fused.fused_enabled(x) else None

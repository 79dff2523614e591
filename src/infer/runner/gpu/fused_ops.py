"""The Triton element-wise kernels lent to the model's layers (see :mod:`infer.model.ops`)."""

from __future__ import annotations

import functools

import torch

from infer.model import ops


class TritonFusedOps(ops.FusedOps):
    """The GPU step's element-wise kernels (``INFER_TRITON_FUSED=0``: none)."""

    def __init__(self) -> None:
        from infer.runner.gpu import triton_fused  # imports triton: the first CUDA tensor's

        self.fused = triton_fused

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.fused.add_rms_norm(x, None, weight, eps)[1]

    def add_rms_norm(self, x, h, weight, eps):
        if h.dtype != x.dtype:
            return None
        return self.fused.add_rms_norm(x, h, weight, eps)

    def act_mul(self, gate_up, act):
        return self.fused.act_and_mul(gate_up, act)


_triton_ops = functools.cache(TritonFusedOps)  # built for the first CUDA tensor


@functools.cache
def _compiled_ops() -> ops.FusedOps:
    from infer.runner.gpu.compiled_ops import CompiledFusedOps

    return CompiledFusedOps()


def triton_fused_ops(x: torch.Tensor) -> ops.FusedOps | None:
    """The Triton kernels for CUDA activations (None: not CUDA, no triton, switched off;
    ``INFER_TRITON_FUSED=compile``: torch.compile's instead, see ``compiled_ops``)."""
    if not x.is_cuda:
        return None  # before importing triton: a CPU process never does
    fused = _triton_ops()
    if not fused.fused.fused_enabled(x):
        return None
    return _compiled_ops() if fused.fused.compiled_glue() else fused

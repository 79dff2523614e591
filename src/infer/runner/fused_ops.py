"""The devices' fused kernels lent to the model's layers (see :mod:`infer.model.ops`): the C++
kernels for CPU bf16 activations (``cpu/fused_ops.py``), the Triton ones for CUDA activations
(``gpu/fused_ops.py``). Registered when the runner package is imported, before any model
runs."""

from __future__ import annotations

from infer.model import ops
from infer.runner.cpu.fused_ops import cpu_fused_ops
from infer.runner.gpu.fused_ops import triton_fused_ops


def register() -> None:
    """Lend the layers both devices' kernels (CPU first: a tensor is on one device)."""
    ops.register_fused_ops(cpu_fused_ops)
    ops.register_fused_ops(triton_fused_ops)

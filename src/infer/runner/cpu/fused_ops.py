"""The C++ kernels lent to the model's layers (see :mod:`infer.model.ops`)."""

from __future__ import annotations

import torch

from infer.model import ops
from infer.runner.cpu.kernels import CpuKernels, kernels_bound


class CpuFusedOps(ops.FusedOps):
    """The C++ kernels: bf16 rows, contiguous (``[T, dim]``; the norm takes any shape)."""

    fuses_qk_norm = True

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return self.kernels.add_rms_norm(flat, None, weight, eps)[1].view(x.shape)

    def add_rms_norm(self, x, h, weight, eps):
        if x.dim() != 2:
            return None
        return self.kernels.add_rms_norm(x.contiguous(), h.contiguous(), weight, eps)

    def act_mul(self, gate_up, act):
        if gate_up.dim() != 2:
            return None
        return self.kernels.act_mul(gate_up.contiguous(), act)

    def qk_norm_into(self, qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps):
        self.kernels.qk_norm_into(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads,
                                  num_kv_heads, head_dim, q_weight.data_ptr(),
                                  k_weight.data_ptr(), eps)  # fmt: skip

    def moe_kernel(self, layer):
        from infer.runner.cpu.moe_kernel import build_moe_kernel  # (imports the model package)

        return build_moe_kernel(layer)


def cpu_fused_ops(x: torch.Tensor) -> ops.FusedOps | None:
    """The C++ kernels for CPU bf16 activations (None: another device or dtype, or no kernels)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    return cpu_ops()


cpu_ops = kernels_bound(CpuFusedOps)
"""The C++ kernels' :class:`CpuFusedOps` (None without the kernels; rebuilt with them)."""

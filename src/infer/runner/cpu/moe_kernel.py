"""A mixture-of-experts layer through one C++ call (csrc/moe.cpp) on a CPU, bfloat16.

:class:`infer.model.moe.SparseMoE` calls it in place of its torch code when every expert
projection is one the C++ kernels take (packed bf16 tiles, int8, w8a8 or 4-bit) and the model
runs on one rank; the fused decode loop (runner/cpu/decode_fast.py) calls the same function for
each sparse layer from inside its C++ layer loop, so the two paths give the same bits.

The kernel computes what the torch code computes, with its own (fixed) order of float32 sums
for the router and the softmax: the router's bf16 logits, a float32 softmax, the top k in
``torch.topk``'s order (ties included: the same sequence of ``std::`` heap / selection calls on
the same comparisons), each model's renormalisation and weight dtype, the chosen experts only,
and the weighted sum in ascending expert order with every product and sum rounded to bf16, as
``index_add_`` rounds. A token's routing can differ from the torch code's only where two
experts' float32 probabilities differ by an ulp at the k-th place.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import torch

from infer.runner.cpu.kernels import ACT_MUL_CODES, CpuKernels, LinearArgs, MoEArgs, cpu_kernels

if TYPE_CHECKING:
    from infer.model.moe import SparseMoE


MOE_KERNEL_ENV = "INFER_MOE_KERNEL"
"""Set to 0 to run every expert layer through its torch code (and so the module path): for
measuring the C++ layer."""


class MoEKernel:
    """The C++ arguments of one :class:`SparseMoE` (kept alive with the arrays they point to)."""

    def __init__(self, moe: SparseMoE, kernels: CpuKernels, experts: list[tuple],
                 shared: tuple | None, act: int) -> None:  # fmt: skip
        self.kernels = kernels
        self.act = act
        self.hidden = moe.router.weight.shape[1]
        n = len(experts)
        self.gate_up = (LinearArgs * n)(*(LinearArgs(*g) for g, _ in experts))
        self.down = (LinearArgs * n)(*(LinearArgs(*d) for _, d in experts))
        self.shared = None if shared is None else (LinearArgs(*shared[0]), LinearArgs(*shared[1]))
        self.router = moe.router.weight.detach().contiguous()
        gate = moe.shared_expert_gate
        self.shared_gate = None if gate is None else gate.weight.detach().reshape(-1).contiguous()
        self.expert_rows = moe.expert_rows
        self.args = MoEArgs(
            self.router.data_ptr(),
            ctypes.addressof(self.gate_up),
            ctypes.addressof(self.down),
            moe.num_experts,
            moe.top_k,
            moe.experts[0].intermediate,
            int(moe.norm_topk_prob),
            int(moe.float32_weights),
            None if self.shared is None else ctypes.addressof(self.shared[0]),
            None if self.shared is None else ctypes.addressof(self.shared[1]),
            0 if moe.shared_expert is None else moe.shared_expert.intermediate,
            None if self.shared_gate is None else self.shared_gate.data_ptr(),
            self.expert_rows.data_ptr(),
        )

    @property
    def address(self) -> int:
        """The ``InferMoE*`` the fused decode loop passes on."""
        return ctypes.addressof(self.args)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        if x.shape[0]:
            self.kernels.moe_into(self.args, x.data_ptr(), out.data_ptr(), x.shape[0],
                                  self.hidden, self.act)  # fmt: skip
        return out


def build_moe_kernel(moe: SparseMoE) -> MoEKernel | None:
    """The C++ layer for ``moe``, or None where its torch code must run (no kernels, not CPU
    bf16, tensor parallelism, an activation without a fused kernel, or a projection the
    kernels do not take)."""
    from infer.runner.cpu.decode_fast import _linear_args  # (imports the model package)

    kernels = cpu_kernels()
    weight = moe.router.weight
    if kernels is None or moe.tp.size != 1 or os.environ.get(MOE_KERNEL_ENV, "1") == "0":
        return None
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    act = moe.experts[0].fused_act
    if act is None or moe.top_k > 256:
        return None
    experts = []
    for expert in moe.experts:
        pair = (_linear_args(expert.gate_up_proj), _linear_args(expert.down_proj))
        if pair[0] is None or pair[1] is None:
            return None
        experts.append(pair)
    shared = None
    if moe.shared_expert is not None:
        gate = moe.shared_expert_gate
        shared = (_linear_args(moe.shared_expert.gate_up_proj),
                  _linear_args(moe.shared_expert.down_proj))  # fmt: skip
        if shared[0] is None or shared[1] is None or gate is None:
            return None
        if gate.weight.dtype != torch.bfloat16:
            return None
    return MoEKernel(moe, kernels, experts, shared, ACT_MUL_CODES[act])

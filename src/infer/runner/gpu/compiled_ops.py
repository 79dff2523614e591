"""The layers' element-wise glue compiled by ``torch.compile`` instead of our Triton kernels:
``INFER_TRITON_FUSED=compile`` (``infer bench gpu``'s ``graphs-compile`` mode).

The same three pieces as :mod:`infer.runner.gpu.triton_fused` hand-fuses (residual add +
RMSNorm, RMSNorm, ``act(gate) * up``), written as the torch ops the layers run without fused
kernels and handed to TorchInductor, which fuses them into Triton kernels of its own. What it
measures: whether the compiler's kernels match or beat the hand-written ones inside the CUDA
graphs, and what compiling costs at start-up (the engine's warm-up compiles them; the rope and
the KV store stay the Triton kernel's). Inductor is told to round where torch's ops round
(``emulate_precision_casts``), so outputs stay within float32 summation order of the torch path.
"""

from __future__ import annotations

import functools

import torch

from infer.model import ops
from infer.model.layers import ACTIVATIONS, rms_norm

# the fused activations' names (layers.FUSED_ACTIVATIONS' values) -> the layers' functions
_ACTS = {"silu": ACTIVATIONS["silu"], "gelu_tanh": ACTIVATIONS["gelu_pytorch_tanh"]}


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.add_forward``'s torch ops: the sum rounded, then normalised."""
    x = x + h
    return x, rms_norm(x, weight, eps)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """``GatedMLP``'s ``act(gate) * up`` over the fused projection (``silu`` | ``gelu_tanh``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return _ACTS[act](gate) * up


@functools.cache
def _compiled() -> dict:
    import torch._inductor.config as inductor_config

    # round the intermediate bf16 / fp16 results as eager torch does (x + h before the norm)
    inductor_config.emulate_precision_casts = True

    def compile_(fn):
        # static shapes but for the rows, which the callers mark dynamic: one graph for one row
        # (always specialised) and one for the rest, the hidden size and eps fixed in both
        # (dynamic=True would make them symbolic too, and cost inductor its one-pass reduction)
        return torch.compile(fn, dynamic=False, fullgraph=True)

    return {fn.__name__: compile_(fn) for fn in (rms_norm, add_rms_norm, act_mul)}


def _rows_vary(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


class CompiledFusedOps(ops.FusedOps):
    """The glue as TorchInductor compiles it (see the module docstring)."""

    def __init__(self) -> None:
        self.fns = _compiled()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _rows_vary(x)
        return self.fns["rms_norm"](x, weight, eps)

    def add_rms_norm(self, x, h, weight, eps):
        if h.dtype != x.dtype:
            return None
        _rows_vary(x, h)
        return self.fns["add_rms_norm"](x, h, weight, eps)

    def act_mul(self, gate_up, act):
        if act not in _ACTS:
            return None
        _rows_vary(gate_up)
        return self.fns["act_mul"](gate_up, act)

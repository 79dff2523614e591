"""``INFER_TRITON_FUSED=compile``'s glue (``runner/gpu/compiled_ops.py``): the functions handed to
``torch.compile`` are the layers' own torch ops, and compiled they round as those do. On a GPU,
``tests/integration/test_cuda.py`` runs an engine on them inside CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.model.layers import RMSNorm
from infer.runner.gpu import compiled_ops


def _norm(dim: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, dim))
    return norm


def test_the_glue_is_the_layers_torch_ops():
    """float32 on the CPU: no fused kernel takes it, so the modules run their torch ops."""
    g = torch.Generator().manual_seed(0)
    x, h = torch.randn(5, 48, generator=g), torch.randn(5, 48, generator=g)
    norm = _norm(48)
    assert torch.equal(compiled_ops.rms_norm(x, norm.weight, norm.eps), norm(x))
    got, want = compiled_ops.add_rms_norm(x, h, norm.weight, norm.eps), norm.add_forward(x, h)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    gate_up = torch.randn(3, 2 * 40, generator=g)
    gate, up = gate_up.split(40, dim=-1)
    assert torch.equal(compiled_ops.act_mul(gate_up, "silu"), F.silu(gate) * up)
    assert torch.equal(compiled_ops.act_mul(gate_up, "gelu_tanh"),
                       F.gelu(gate, approximate="tanh") * up)  # fmt: skip
    ops = compiled_ops.CompiledFusedOps.__new__(compiled_ops.CompiledFusedOps)
    assert ops.act_mul(gate_up, "relu") is None  # no fused form: the layer's own ops
    assert ops.add_rms_norm(x, h.double(), norm.weight, norm.eps) is None


@pytest.mark.slow  # inductor compiles C++ on a CPU: ~30 s
def test_compiled_they_round_as_torch_does_and_compile_once_for_every_row_count():
    """bf16, one row and several counts above: the sums bit-equal, two graphs a function (one
    row, and the rest with the rows symbolic: the hidden size stays fixed)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    torch._dynamo.reset()
    compiled_ops._compiled.cache_clear()
    ops = compiled_ops.CompiledFusedOps()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows in (1, 5, 9, 16):
        x, h = (torch.randn(rows, 64, generator=g).to(torch.bfloat16) for _ in range(2))
        got = ops.add_rms_norm(x, h, w, 1e-6)
        want = compiled_ops.add_rms_norm(x, h, w, 1e-6)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        gate_up = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        assert torch.equal(ops.act_mul(gate_up, "silu"), compiled_ops.act_mul(gate_up, "silu"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 4

"""Packed linear weights (AMX tile layout or oneDNN): the numbers of ``F.linear``, applied only
to CPU bfloat16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infer.runner.cpu.kernels import cpu_kernels
from infer.runner.cpu.prepack import (
    PackedLinear,
    TiledLinear,
    onednn_bf16_available,
    prepack_linears,
)


class _Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32).to(dtype)
        self.proj = nn.Linear(32, 48, bias=True).to(dtype)  # AMX-shaped: N % 16, K % 32
        self.back = nn.Linear(48, 32, bias=False).to(dtype)  # K = 48: oneDNN only

    def vocab_projection_weight(self) -> torch.Tensor:
        return self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.back(torch.relu(self.proj(self.embed(ids))))
        packed = getattr(self, "packed_logits", None)
        return packed(h) if packed is not None else nn.functional.linear(h, self.embed.weight)


def _tiled() -> bool:
    """AMX, AVX-512 BF16 or AVX2 FMA: the CPUs the tiled kernel runs on."""
    kernels = cpu_kernels()
    return kernels is not None and kernels.linear_kind >= 1


@pytest.mark.skipif(
    not onednn_bf16_available(), reason="no oneDNN bfloat16 packing (torch build or CPU)"
)
def test_packed_model_gives_the_same_logits():
    torch.manual_seed(0)
    model = _Tiny(torch.bfloat16)
    ids = torch.tensor([1, 7, 9, 44])
    with torch.inference_mode():
        want = model(ids)
        assert prepack_linears(model) == 3  # proj, back and the tied vocabulary projection
        assert isinstance(model.proj, TiledLinear if _tiled() else PackedLinear)
        assert isinstance(model.back, PackedLinear)
        assert isinstance(model.packed_logits, PackedLinear)  # 50 words: not AMX-shaped
        got = model(ids)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.skipif(
    onednn_bf16_available() or not _tiled(), reason="oneDNN packs bf16 here, or no tiled kernel"
)
def test_without_onednn_only_the_tiled_shapes_are_packed():
    torch.manual_seed(0)
    model = _Tiny(torch.bfloat16)
    ids = torch.tensor([1, 7, 9, 44])
    with torch.inference_mode():
        want = model(ids)
        assert prepack_linears(model) == 1
        assert isinstance(model.proj, TiledLinear)
        assert type(model.back) is nn.Linear  # K = 48: F.linear, as before
        assert getattr(model, "packed_logits", None) is None
        got = model(ids)
    # The tiled kernel sums K in another order than torch's bf16 matmul: within bf16 rounding.
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_float32_and_switched_off_models_are_left_alone(monkeypatch):
    model = _Tiny(torch.float32)
    assert prepack_linears(model) == 0 and isinstance(model.proj, nn.Linear)
    monkeypatch.setenv("INFER_PREPACK_WEIGHTS", "0")
    model = _Tiny(torch.bfloat16)
    assert prepack_linears(model) == 0 and isinstance(model.proj, nn.Linear)


def test_tiled_linear_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("INFER_TILED_LINEAR", "0")
    model = _Tiny(torch.bfloat16)
    prepack_linears(model)
    assert not isinstance(model.proj, TiledLinear)


@pytest.mark.skipif(
    not _tiled(), reason="no AMX, AVX-512 BF16 or AVX2 on this CPU (or no C++ compiler)"
)
@pytest.mark.parametrize("rows", [7, 16, 31, 33, 64, 300])
def test_tiled_linear_bits_do_not_depend_on_the_thread_count(rows):
    """1, 2 and 3-4 threads (the decode rows' x copied per thread, or split and shared)."""
    torch.manual_seed(rows)
    weight = (torch.randn(96, 256) * 0.05).bfloat16()
    xs = [torch.randn(rows, 256).bfloat16() for _ in range(2)]
    layer = TiledLinear(weight, None, cpu_kernels())
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(2)
            want = [layer(x) for x in xs]
            for threads in (1, 3, 4):
                torch.set_num_threads(threads)
                # x alternates, so a part of the copy left out would show the other x's values
                for x, w in zip(xs, want, strict=True):
                    assert torch.equal(layer(x), w), threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(
    not _tiled(), reason="no AMX, AVX-512 BF16 or AVX2 on this CPU (or no C++ compiler)"
)
@pytest.mark.parametrize("rows", [1, 3, 7, 16, 17, 24, 31, 32, 33, 48, 64, 65, 130, 300])
def test_tiled_linear_matches_a_float32_reference_and_is_batch_invariant(rows):
    torch.manual_seed(rows)
    n, k = 96, 256
    weight = (torch.randn(n, k) * 0.05).bfloat16()
    bias = torch.randn(n).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    layer = TiledLinear(weight, bias, cpu_kernels())
    with torch.inference_mode():
        got = layer(x)
        # float32 sums of bf16 products, one rounding at the end: within an ulp of bf16
        want = (x.float() @ weight.float().T + bias.float()).bfloat16()
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        # the same row alone, or in another batch, gives the same bits
        for r in {0, rows // 2, rows - 1}:
            assert torch.equal(layer(x[r : r + 1])[0], got[r])
        assert torch.equal(layer(x.view(1, rows, k))[0], got)
        assert layer(x[:0]).shape == (0, n)
    with pytest.raises(ValueError, match="rejected"):  # column scales are for int8 weights
        cpu_kernels().tiled_linear(x, layer.packed_weight, None, n, scales=torch.ones(n))


@pytest.mark.skipif(
    not _tiled(), reason="no AMX, AVX-512 BF16 or AVX2 on this CPU (or no C++ compiler)"
)
def test_tiled_linear_without_bias_and_nan_passes_through():
    weight = torch.ones(16, 32).bfloat16()
    x = torch.ones(2, 32).bfloat16()
    x[1, 0] = float("nan")
    layer = TiledLinear(weight, None, cpu_kernels())
    with torch.inference_mode():
        y = layer(x)
    assert torch.equal(y[0], torch.full((16,), 32.0).bfloat16())
    assert torch.isnan(y[1]).all()

"""Weight quantization at load: int8 / fp8 round trips, the int8 kernels against the reference
matmul, and the start-up errors."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from infer.config import EngineConfig
from infer.engine.args import add_engine_args, engine_config_from_args
from infer.runner.cpu.kernels import cpu_kernels
from infer.runner.quant import (
    Fp8Linear,
    Int8Linear,
    W8A8Linear,
    check_quantization,
    dequantize,
    quantize_fp8,
    quantize_int8,
    w8a8_available,
)


def _weight(seed: int = 0, n: int = 48, k: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[0] = 0.0  # a zero row
    w[1, 3] = 40.0  # an outlier
    w[2] = 1e-30
    return w


def test_int8_round_trip_is_within_half_a_step_per_channel():
    w = _weight()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (48,)
    back = dequantize(q, scale, torch.float32)
    assert (back - w).abs().le(scale[:, None] / 2 * (1 + 1e-6)).all()
    assert not back[0].any() and torch.isfinite(back).all()
    assert q.abs().max() == 127 and q[1, 3] == 127


def test_fp8_round_trip_never_overflows():
    w = _weight() * 1e4  # far beyond e4m3's 448
    q, scale = quantize_fp8(w)
    back = dequantize(q, scale, torch.float32)
    assert torch.isfinite(back).all()
    assert (back - w).abs().le(torch.maximum(w.abs() / 16, scale[:, None] * 2**-9)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_int8_linear_matches_the_dequantized_weight(dtype, rows):
    w = _weight(1, n=64, k=96).to(dtype)
    bias = torch.randn(64).to(dtype)
    layer = Int8Linear(w, bias)
    x = torch.randn(rows, 96).to(dtype)
    want = F.linear(x.float(), dequantize(*quantize_int8(w), torch.float32), bias.float())
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 64)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max(), rtol=tol)
    if dtype == torch.bfloat16 and cpu_kernels() is not None and cpu_kernels().linear_int8:
        assert layer.mode == "tiled"
        with torch.inference_mode():  # a row alone gives the same bits as in its batch
            assert torch.equal(layer(x[-1:])[0], got[-1])
    assert layer.weight_bytes == 64 * 96 + 64 * 4
    with torch.inference_mode():
        assert layer(x[:0]).shape == (0, 64)


def _assert_batch_and_thread_invariant(layer: torch.nn.Module, x: torch.Tensor, got: torch.Tensor):
    """A row alone gives its bits in the batch; 1 and 3 threads give the batch's bits."""
    rows = x.shape[0]
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for r in {0, rows // 2, rows - 1}:
                assert torch.equal(layer(x[r : r + 1])[0], got[r])
            for threads in (1, 3):
                torch.set_num_threads(threads)
                assert torch.equal(layer(x), got), threads
    finally:
        torch.set_num_threads(before)


def _int8_tiled() -> bool:
    return cpu_kernels() is not None and cpu_kernels().linear_int8


@pytest.mark.skipif(not _int8_tiled(), reason="no int8 tiled kernel here (AMX or AVX-512 VBMI)")
@pytest.mark.parametrize("n", [16, 48, 96])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 17, 33, 64, 65, 130])
def test_int8_tiled_kernel_is_exact_in_float32_and_batch_invariant(rows, n):
    """Every path of the int8 kernel (a few rows, tall decode passes, prefill panels; 1-4 column
    blocks at a panel's end): float32 sums of bf16 x times the integers, scaled per column, one
    rounding to bf16; a row's bits do not depend on its batch or on the thread count."""
    torch.manual_seed(rows * 7 + n)
    k = 256
    w = (torch.randn(n, k) * 0.05).bfloat16()
    w[0, 5] = 0.9  # an outlier column scale
    bias = torch.randn(n).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    layer = Int8Linear(w, bias)
    assert layer.mode == "tiled"
    q, scale = quantize_int8(w)
    want = ((x.float() @ q.float().T) * scale + bias.float()).bfloat16()
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=2**-7)
    _assert_batch_and_thread_invariant(layer, x, got)
    # The float32 sums, before rounding to bf16: the same bits for a row alone (the few-rows
    # path) as in the batch (tall passes, prefill panels): one summation order on every path.
    sums = cpu_kernels().tiled_linear(x, layer.q, None, n, layer.scale, torch.float32)
    for r in {0, rows // 2, rows - 1}:
        alone = cpu_kernels().tiled_linear(x[r : r + 1], layer.q, None, n, layer.scale,
                                           torch.float32)  # fmt: skip
        assert torch.equal(alone[0], sums[r])
    torch.testing.assert_close(sums, (x.float() @ q.float().T) * scale, atol=1e-6, rtol=1e-5)


def _w8a8_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The w8a8 math, exactly: rows of x rounded to int8 at absmax / 127 (nearest even), an
    integer matmul, then float32 scales and bias."""
    xf = x.float()
    absmax = xf.abs().amax(dim=1, keepdim=True)
    # one float32 division, as the kernel does (torch's 127.0 / t multiplies by 1 / t)
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, torch.zeros_like(absmax))
    xq = torch.round(xf * inv).long()
    q, scale = quantize_int8(w)
    sums = (xq @ q.long().T).float()  # exact integers
    x_scale = torch.where(
        absmax > 0, absmax / torch.full_like(absmax, 127.0), torch.zeros_like(absmax)
    )
    return torch.addcmul(bias.float(), sums, x_scale * scale)


@pytest.mark.skipif(not w8a8_available(torch.device("cpu")), reason="no AVX-512 VNNI kernel")
@pytest.mark.parametrize("n", [16, 48])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 33, 70])
def test_w8a8_kernel_is_the_integer_math_and_batch_invariant(rows, n):
    torch.manual_seed(rows + n)
    k = 96
    w = (torch.randn(n, k) * 0.05).bfloat16()
    w[0, 1] = 0.9  # an outlier column
    bias = torch.randn(n).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    x[-1, 2] = 30.0  # an outlier row
    x[0] = 0.0  # a zero row: scale 0, the bias alone
    layer = W8A8Linear(w, bias)
    want = _w8a8_reference(x, w, bias)
    with torch.inference_mode():
        got = layer(x.float())  # float32 in: float32 out, no rounding to bf16
        got16 = layer(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(got[0], bias.float())
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, want.bfloat16())
    _assert_batch_and_thread_invariant(layer, x, got16)
    assert layer.weight_bytes == n * k + n * 8
    # against the float product, rows without an outlier: activation rounding costs ~1% of the
    # output's scale (the outlier row's step is 30 / 127: that is what w8a8 trades)
    if rows > 1:
        exact = x[:-1].float() @ w.float().T + bias.float()
        assert (want[:-1] - exact).abs().max() <= 0.03 * exact.abs().max()


@pytest.mark.skipif(not w8a8_available(torch.device("cpu")), reason="no AVX-512 VNNI kernel")
def test_w8a8_rows_with_nan_or_inf_come_out_nan_and_leave_the_others_alone():
    """A NaN from an earlier layer must not turn into plausible numbers (the maximum of a row
    with a NaN would skip it, and NaN converts to a byte like any other)."""
    w = (torch.randn(16, 64) * 0.05).bfloat16()
    x = torch.randn(4, 64).bfloat16()
    layer = W8A8Linear(w, None)
    with torch.inference_mode():
        clean = layer(x)
        x[1, 5], x[2, 7] = float("nan"), float("inf")
        x[3] = 1e-38  # 127 / absmax is not finite: a zero row
        got = layer(x)
    assert torch.isnan(got[1]).all() and torch.isnan(got[2]).all()
    assert torch.equal(got[0], clean[0]) and torch.equal(got[3], torch.zeros_like(got[3]))


@pytest.mark.skipif(not _int8_tiled(), reason="no int8 tiled kernel here (AMX or AVX-512 VBMI)")
def test_int8_tile_pack_takes_minus_128_or_refuses_it():
    """quantize_int8 never makes -128, but the packer must not read it back as another value."""
    q = torch.full((16, 32), -128, dtype=torch.int8)
    kernels = cpu_kernels()
    try:
        packed = kernels.tile_pack(q)
    except ValueError as e:  # the AVX-512 BF16 kernel's sign-and-magnitude bytes: refused
        assert "cannot pack" in str(e)
        return
    x = torch.ones(1, 32).bfloat16()  # AMX reads the bytes as they are
    y = kernels.tiled_linear(x, packed, None, 16, torch.ones(16), torch.float32)
    assert torch.equal(y, torch.full((1, 16), -4096.0))


def test_fp8_linear_reference_math():
    w = _weight(2, n=32, k=64)
    layer = Fp8Linear(w, None)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        got = layer(x)  # on CPU: the dequantized reference (fp8 is served on CUDA only)
    torch.testing.assert_close(got, F.linear(x, dequantize(*quantize_fp8(w), torch.float32)))


def test_quantization_start_up_errors_name_the_option_and_choices():
    with pytest.raises(ValueError, match=r"--quantization 'int3'.*int8, w8a8, fp8, int4, w4a8"):
        EngineConfig.from_kwargs(quantization="int3")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"--quantization w8a8 needs a CPU with AVX-512 VNNI"):
            check_quantization("w8a8", torch.device("cuda"))
    with pytest.raises(ValueError, match=r"--quantization fp8 needs a CUDA GPU.*int8"):
        check_quantization("fp8", torch.device("cpu"))
    check_quantization("int8", torch.device("cpu"))
    check_quantization(None, torch.device("cpu"))


def test_quantize_lm_head_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    default = engine_config_from_args(parser.parse_args(["--quantization", "w8a8"]))
    kept = engine_config_from_args(
        parser.parse_args(["--quantization", "w8a8", "--no-quantize-lm-head"])
    )
    assert default.model.quantize_lm_head and not kept.model.quantize_lm_head

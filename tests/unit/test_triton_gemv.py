"""The skinny decode matmuls (Triton) against ``F.linear``.

On a CPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, set by the test conftest
without CUDA) in float32 and float16 (the interpreter reads bfloat16 as NaN); on a GPU in
bfloat16 too, where ``install`` also times them against cuBLAS.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from infer.runner.gpu import triton_gemv as tg  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=6e-2, rtol=2e-2)}  # fmt: skip
if DEVICE == "cuda":
    # On a GPU a float32 tl.dot multiplies in TF32 (10-bit mantissas: ~2e-3 off over K = 512);
    # the engine installs these kernels for half-precision weights only.
    TOL[torch.float32] = dict(atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", tg.CANDIDATES, ids=str)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 96, 512), (3, 80, 512), (16, 64, 300)])
def test_every_candidate_is_f_linear(dtype, config, rows, n, k):
    """Rows up to 16, N not a multiple of the tile (masked columns), K not a multiple of the
    block (masked tail), with and without a bias, any leading shape."""
    if config.way == "row" and rows != 1:
        with pytest.raises(ValueError, match="1 row"):
            tg.gemv(torch.zeros(rows, k, device=DEVICE), torch.zeros(n, k, device=DEVICE),
                    None, config)  # fmt: skip
        return
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    want = F.linear(x.float(), w.float()).to(dtype)
    torch.testing.assert_close(tg.gemv(x, w, None, config), want, **TOL[dtype])
    with_bias = tg.gemv(x.reshape(1, rows, k), w, b, config)
    assert with_bias.shape == (1, rows, n)
    torch.testing.assert_close(with_bias[0], (F.linear(x.float(), w.float()) + b.float()).to(dtype),
                               **TOL[dtype])  # fmt: skip


def test_more_rows_than_the_tile_are_refused():
    config = tg.CANDIDATES[0]
    with pytest.raises(ValueError, match="16 rows"):
        tg.gemv(torch.zeros(17, 64, device=DEVICE), torch.zeros(32, 64, device=DEVICE), None,
                config)  # fmt: skip


def test_a_gemv_linear_runs_its_pick_for_its_rows_and_f_linear_otherwise(monkeypatch):
    layer = nn.Linear(256, 48, bias=True).to(DEVICE)
    want_big = layer(torch.ones(32, 256, device=DEVICE))
    layer.__class__ = tg.GemvLinear
    layer.gemv_configs = {1: tg.GemvConfig("row", 16, 128)}
    calls = []
    real = tg.gemv
    monkeypatch.setattr(tg, "gemv", lambda *a: calls.append(a[3]) or real(*a))
    x1 = torch.randn(1, 256, device=DEVICE)
    torch.testing.assert_close(
        layer(x1), F.linear(x1, layer.weight, layer.bias), **TOL[torch.float32]
    )
    assert calls == [layer.gemv_configs[1]]
    assert torch.equal(layer(torch.ones(32, 256, device=DEVICE)), want_big)  # not taken: cuBLAS
    assert len(calls) == 1


@pytest.mark.skipif(DEVICE != "cuda", reason="times kernels on a GPU")
def test_install_keeps_cublas_unless_beaten_and_outputs_stay_close():
    model = nn.Sequential(nn.Linear(2048, 3072, bias=False), nn.Linear(3072, 2048, bias=False))
    model = model.to("cuda", torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    want = model(x)
    lines = tg.install(model, [1, 2, 4])
    assert len(lines) == 6 and all(type(m) is tg.GemvLinear for m in model)
    torch.testing.assert_close(model(x), want, **TOL[torch.bfloat16])


def test_pick_takes_a_candidate_only_where_it_beats_cublas(monkeypatch):
    """The choice logic with made-up timings (each candidate still runs once): the fastest
    candidate when it beats cuBLAS, cuBLAS otherwise, failures named and skipped."""
    weights = [torch.randn(32, 64, device=DEVICE)]
    real = tg.gemv

    def flaky(x, w, b, config):
        if config == tg.CANDIDATES[1]:
            raise RuntimeError("out of shared memory")
        return real(x, w, b, config)

    monkeypatch.setattr(tg, "gemv", flaky)
    for cublas_us, beaten in ((10.0, True), (3.0, False)):
        # cuBLAS first, then the candidates in order: 5, 6, 7, ... us (the first is fastest).
        times = iter([cublas_us] + [5.0 + i for i in range(len(tg.CANDIDATES))])

        def fake_time(fn, ws, times=times):
            fn(ws[0])
            return next(times)

        monkeypatch.setattr(tg, "time_us", fake_time)
        chosen = tg.pick(weights, 1)
        assert len(chosen.failed) == 1 and "out of shared memory" in chosen.failed[0]
        assert chosen.best_triton == (tg.CANDIDATES[0], 5.0)
        if beaten:
            assert chosen.config == tg.CANDIDATES[0] and chosen.us == 5.0
        else:
            assert chosen.config is None and chosen.us == cublas_us
            assert str(chosen).startswith("at 1 rows: cuBLAS (cuBLAS 3.0 us; best Triton")

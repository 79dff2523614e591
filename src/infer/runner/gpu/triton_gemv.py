"""Skinny matmuls for small decode batches (Triton): ``y = x @ W.T (+ b)`` for a few rows.

At batch 1 a decode step is the weights' read, and cuBLAS reads the small projections slowly:
an H200 profile of the 1.24B Llama shape put qkv and o (2048 -> 3072 and 2048 -> 2048) at ~45%
of the memory's read rate, because the kernel it picks tiles N by 64 and so runs 32-48 thread
blocks on 132 multiprocessors. These kernels give each program ``BLOCK_N`` output columns and
walk all of K (or a slice of it: split K, below), so a 2048-wide output is 64-128 programs
streaming their rows of W::

    program p:  W[p*BN : (p+1)*BN, :]  (BN rows of K, read once, BLOCK_K at a time)
                x[:M, :]               (the batch's rows: M <= 16, from L2 after the first)
                y[:M, p*BN : (p+1)*BN] = x @ W_rows.T   (float32 sums, one rounding)

Two ways to sum: ``dot`` (tensor cores on a 16-row tile whose rows past M are zero) and, for
one row, ``row`` (an elementwise product summed along K). Either may split K (``split_k``) when
the output is too narrow to give every multiprocessor enough to read (o: 2048 outputs, 128
programs of 16 columns; down: the same over K = 8192): each of the ``split_k`` programs of a
column tile sums its own slice of K into a float32 workspace, and a second kernel adds the
slices in a fixed order (no atomics, so the sums and tokens are the same on every run)::

    W[n-tile, :] = | slice 0 | slice 1 | ... | slice S-1 |    (K_PER columns each, whole blocks)
    ws[s, :M, n-tile] = x[:, slice s] @ W[n-tile, slice s].T         (float32)
    y[:M, n-tile] = ws[0] + ws[1] + ... + ws[S-1] (+ b)               (one rounding)

Which way, which tile and which split is fastest depends on the shape and the GPU: :func:`pick`
times the candidates against cuBLAS on the model's own weights and keeps cuBLAS where it is not
beaten. ``INFER_TRITON_GEMV=1`` turns them
on (see :func:`install`): off by default until a GPU run says what they buy.
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from infer.runner.gpu.timing import time_ms

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None
    tl = None

logger = logging.getLogger(__name__)

GEMV_ENV = "INFER_TRITON_GEMV"
MAX_ROWS = 16
"""The most rows these kernels take (the ``dot`` tile's height)."""


@dataclass(frozen=True)
class GemvConfig:
    """One kernel variant: ``way`` ("dot" | "row"), its tile and launch settings."""

    way: str
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1

    def __str__(self) -> str:
        tile = f"{self.way} {self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"
        return tile + (f" k/{self.split_k}" if self.split_k > 1 else "")


CANDIDATES: tuple[GemvConfig, ...] = (
    GemvConfig("dot", 16, 256, 4, 4),
    GemvConfig("dot", 16, 512, 4, 3),
    GemvConfig("dot", 32, 256, 4, 4),
    GemvConfig("dot", 64, 128, 4, 4),
    GemvConfig("row", 8, 512, 4, 3),
    GemvConfig("row", 16, 256, 4, 4),
    GemvConfig("row", 32, 256, 8, 3),
    GemvConfig("dot", 16, 256, 4, 4, split_k=2),
    GemvConfig("dot", 16, 256, 4, 4, split_k=4),
    GemvConfig("dot", 32, 128, 4, 4, split_k=4),
    GemvConfig("row", 8, 512, 4, 3, split_k=4),
)


if triton is not None:

    @triton.jit
    def _gemv_dot_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_ym,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        k_start = tl.program_id(1) * K_PER  # 0 without a split (K_PER = K rounded up)
        k_end = tl.minimum(k_start + K_PER, K)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_in = offs_n < N
        m_in = offs_m < M
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + k[None, :], mask=n_in[:, None], other=0.0)
                x = tl.load(x_rows + k[None, :], mask=m_in[:, None], other=0.0)
            else:
                k_in = k < K
                w = tl.load(w_rows + k[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
                x = tl.load(x_rows + k[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w))
        out = m_in[:, None] & n_in[None, :]
        if SPLIT_K > 1:  # this slice's float32 sums; _gemv_reduce_kernel adds the slices
            ws = ws_ptr + tl.program_id(1) * M * N + offs_m[:, None] * N + offs_n[None, :]
            tl.store(ws, acc, mask=out)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
            y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out)

    @triton.jit
    def _gemv_row_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, N, K, K_PER, stride_wn,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        k_start = tl.program_id(1) * K_PER
        k_end = tl.minimum(k_start + K_PER, K)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_in = offs_n < N
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + k[None, :], mask=n_in[:, None], other=0.0)
                x = tl.load(x_ptr + k)
            else:
                k_in = k < K
                w = tl.load(w_rows + k[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
                x = tl.load(x_ptr + k, mask=k_in, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if SPLIT_K > 1:
            tl.store(ws_ptr + tl.program_id(1) * N + offs_n, y, mask=n_in)
        else:
            if HAS_BIAS:
                y += tl.load(b_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)
            tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_in)

    @triton.jit
    def _gemv_reduce_kernel(
        ws_ptr, b_ptr, y_ptr, MN, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # y = ws[0] + ... + ws[SPLIT_K - 1] (+ b) over the M * N outputs, always in that order.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(ws_ptr + s * MN + offs, mask=inside, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % N, mask=inside, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=inside)


REDUCE_BLOCK = 256


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of at most :data:`MAX_ROWS` rows (any leading
    shape), by the ``config`` kernel. ``weight`` ``[N, K]`` contiguous in its rows."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, n = rows.shape[0], weight.shape[0]
    if m > MAX_ROWS or (config.way == "row" and m != 1):
        raise ValueError(f"{config} takes {'1 row' if config.way == 'row' else '<= 16 rows'}")
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    # Slices of whole blocks; a split that would leave a slice empty is narrowed.
    k_blocks = triton.cdiv(k, config.block_k)
    splits = min(config.split_k, k_blocks)
    k_per = triton.cdiv(k_blocks, splits) * config.block_k
    splits = triton.cdiv(k, k_per)
    # float32 sums of each slice (split only); taken from the graph's pool inside a capture.
    ws = torch.empty(splits, m, n, device=x.device, dtype=torch.float32) if splits > 1 else y
    grid = (triton.cdiv(n, config.block_n), splits)
    has_bias = bias is not None
    b = bias if has_bias else weight  # not read without HAS_BIAS
    even_k = k % config.block_k == 0
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if config.way == "dot":
        _gemv_dot_kernel[grid](
            rows, weight, b, y, ws, m, n, k, k_per, rows.stride(0), weight.stride(0),
            y.stride(0), HAS_BIAS=has_bias, EVEN_K=even_k, SPLIT_K=splits, BLOCK_M=MAX_ROWS,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, **launch,
        )  # fmt: skip
    else:
        _gemv_row_kernel[grid](
            rows, weight, b, y, ws, n, k, k_per, weight.stride(0), HAS_BIAS=has_bias,
            EVEN_K=even_k, SPLIT_K=splits, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            **launch,
        )  # fmt: skip
    if splits > 1:
        _gemv_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            ws, b, y, m * n, n, HAS_BIAS=has_bias, SPLIT_K=splits, BLOCK=REDUCE_BLOCK,
        )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)


def candidates_for(rows: int) -> list[GemvConfig]:
    return [c for c in CANDIDATES if c.way == "dot" or rows == 1]


def time_us(fn, weights: Sequence[torch.Tensor], reps: int = 24) -> float:
    """Microseconds of one ``fn(weight)``: the median over a few replays of a CUDA graph of
    ``reps`` calls cycling through ``weights`` (more bytes than the L2 cache holds, so each
    call reads its weight from memory), by :func:`infer.runner.gpu.timing.time_ms`. Timed in
    a graph, the kernels run back to back as they do in a decode step's graph; timed launch by
    launch, a Triton kernel's Python launch (tens of microseconds) was timed too, and cuBLAS
    won every pick of the first GPU run. A call that cannot be captured raises."""
    cycle = itertools.cycle(weights)
    how: dict = {}
    samples = time_ms(lambda: fn(next(cycle)), weights[0].device, reps=5, inner=reps,
                      warmup=3, graph=True, how=how)  # fmt: skip
    if how["timing"] != "cuda graph":  # off CUDA, or a capture that failed
        raise RuntimeError(f"not timed in a CUDA graph: {how['timing']}")
    return 1000 * statistics.median(samples)


@dataclass(frozen=True)
class Pick:
    """What :func:`pick` chose for one weight shape and row count, and what it measured."""

    rows: int
    config: GemvConfig | None  # None: cuBLAS
    us: float
    cublas_us: float
    best_triton: tuple[GemvConfig, float] | None = None  # the fastest candidate, chosen or not
    failed: tuple[str, ...] = ()  # candidates that did not compile or run here

    def __str__(self) -> str:
        triton_part = (f"; best Triton {self.best_triton[0]} {self.best_triton[1]:.1f} us"
                       if self.best_triton else "")  # fmt: skip
        failed = f"; {len(self.failed)} failed ({self.failed[0]})" if self.failed else ""
        return (f"at {self.rows} rows: {self.config or 'cuBLAS'} "
                f"(cuBLAS {self.cublas_us:.1f} us{triton_part}{failed})")  # fmt: skip


@dataclass(frozen=True)
class Sweep:
    """cuBLAS and every candidate timed on one weight shape at one row count."""

    rows: int
    cublas_us: float
    candidates: tuple[tuple[GemvConfig, float], ...]  # those that ran, in CANDIDATES' order
    failed: tuple[str, ...] = ()  # "config: why", for those that did not compile or run

    @property
    def best(self) -> tuple[GemvConfig, float] | None:
        return min(self.candidates, key=lambda c: c[1]) if self.candidates else None


def sweep(weights: Sequence[torch.Tensor], rows: int) -> Sweep:
    """Times cuBLAS and each of :data:`CANDIDATES` for ``rows`` rows times ``weights`` (one
    shape; the layers' own, or copies, cycled through so each call reads from memory). A
    candidate that fails to compile or run is named in ``failed``; cuBLAS failing raises."""
    w0 = weights[0]
    x = torch.randn(rows, w0.shape[1], device=w0.device, dtype=w0.dtype)
    cublas = time_us(lambda w: F.linear(x, w), weights)
    timed, failed = [], []
    for config in candidates_for(rows):
        try:
            timed.append((config, time_us(lambda w, c=config: gemv(x, w, None, c), weights)))
        except Exception as e:  # noqa: BLE001 - a tile this GPU cannot run: not a choice
            failed.append(f"{config}: {type(e).__name__}: {str(e)[:120]}")
    return Sweep(rows, cublas, tuple(timed), tuple(failed))


def pick(weights: Sequence[torch.Tensor], rows: int) -> Pick:
    """The fastest of cuBLAS and :data:`CANDIDATES` for ``rows`` rows times ``weights``
    (:func:`sweep`): a candidate only where it beats cuBLAS."""
    timed = sweep(weights, rows)
    best = timed.best
    if best is not None and best[1] < timed.cublas_us:
        return Pick(rows, best[0], best[1], timed.cublas_us, best, timed.failed)
    return Pick(rows, None, timed.cublas_us, timed.cublas_us, best, timed.failed)


_PICKS: dict[tuple, Pick] = {}


class GemvLinear(nn.Linear):
    """An ``nn.Linear`` that runs the kernel :func:`install` picked for its row count, and
    cuBLAS for any other (prefill, large batches)."""

    gemv_configs: dict[int, GemvConfig]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        config = self.gemv_configs.get(x.numel() // x.shape[-1])
        if config is None:
            return F.linear(x, self.weight, self.bias)
        return gemv(x, self.weight, self.bias, config)


def enabled() -> bool:
    return triton is not None and os.environ.get(GEMV_ENV, "0") == "1"


def install(model: nn.Module, row_counts: Sequence[int]) -> list[str]:
    """Give the model's half-precision ``nn.Linear`` layers on a GPU the skinny kernels that
    beat cuBLAS for each of ``row_counts`` (<= :data:`MAX_ROWS`), timed on their own weights.
    Returns a line per (shape, rows) saying what was chosen, for the log."""
    by_shape: dict[tuple[int, int, torch.dtype], list[nn.Linear]] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if (
            type(module) is nn.Linear
            and w is not None
            and w.is_cuda
            and w.dtype in (torch.bfloat16, torch.float16)
            and w.stride(-1) == 1
        ):
            by_shape.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(module)
    lines = []
    with torch.inference_mode():
        for (n, k, dtype), modules in by_shape.items():
            configs: dict[int, GemvConfig] = {}
            weights = [m.weight for m in modules]
            for rows in sorted({r for r in row_counts if r <= MAX_ROWS}):
                # Timed once a process: a second engine (graphs and eager side by side) runs
                # the same kernels, so their sums, and tokens, are the same.
                key = (str(weights[0].device), n, k, dtype, rows)
                chosen = _PICKS.get(key) or _PICKS.setdefault(key, pick(weights, rows))
                if chosen.config is not None:
                    configs[rows] = chosen.config
                lines.append(f"{n}x{k} {chosen}")
            for m in modules:
                m.__class__ = GemvLinear
                m.gemv_configs = configs
    return lines

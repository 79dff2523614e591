"""The Triton paged-attention kernels against a float64 torch reference.

On a machine without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
set before the module under test defines them); it is slow, so shapes are small and the cases
are picked to cover each dimension (GQA group, head dim, block size, window, cache kind,
splits) rather than their product. The interpreter's bf16 arithmetic is wrong (bf16 dots come
back as garbage), so bf16 attention runs on CUDA only; the same tests run on the GPU there.
"""

from __future__ import annotations

import importlib
import math
import os
import zlib

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"].lower() not in ("1", "true", "on", "yes"):
        pytest.skip("no CUDA and TRITON_INTERPRET is off", allow_module_level=True)

pytest.importorskip("triton")

from infer.runner import kv_quant  # noqa: E402
from infer.runner.gpu import triton_attention as ta  # noqa: E402
from infer.runner.gpu.step import prefill_tiles  # noqa: E402

if DEVICE == "cpu" and type(ta._decode_kernel).__name__ != "InterpretedFunction":
    # Imported (by another test) before TRITON_INTERPRET was set: define the kernels again.
    ta = importlib.reload(ta)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
CPU_NO_BF16 = "the Triton interpreter computes bf16 dots wrongly; bf16 is checked on CUDA"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip(CPU_NO_BF16)
    return dtype


class Cache:
    """One layer's paged cache filled with random rows (quantized when ``kind`` is set)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hkv: int,
        d: int,
        dtype: torch.dtype,
        kind: str | None,
        gen: torch.Generator,
    ) -> None:
        self.block_size, self.kind, self.dtype = block_size, kind, dtype
        n = num_blocks * block_size
        k = torch.randn(n, hkv, d, generator=gen)
        v = torch.randn(n, hkv, d, generator=gen)
        if kind is None:
            self.k, self.v = k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)
            self.ks = self.vs = None
        else:
            kq, ks = kv_quant.quantize(k, kind)
            vq, vs = kv_quant.quantize(v, kind)
            self.k, self.v, self.ks, self.vs = (x.to(DEVICE) for x in (kq, vq, ks, vs))

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as float64 (what the kernel must attend to)."""
        if self.kind is None:
            return self.k.double(), self.v.double()
        return (
            kv_quant.dequantize(self.k, self.ks, self.kind, torch.float64),
            kv_quant.dequantize(self.v, self.vs, self.kind, torch.float64),
        )

    def kwargs(self) -> dict:
        return {
            "block_size": self.block_size,
            "k_scales": self.ks,
            "v_scales": self.vs,
            "kv_kind": self.kind,
        }


def _tables(
    lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator, share: bool = True
) -> torch.Tensor:
    """[len(lens), max_blocks] int32 tables drawn from a shuffled pool (unused blocks stay as
    holes); with ``share`` the second sequence starts with the first one's blocks (a shared
    prefix). Entries past a sequence's length are junk block ids, never to be read."""
    need = [max(1, math.ceil(n / block_size)) for n in lens]
    max_blocks = max(need)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.randint(0, num_blocks, (len(lens), max_blocks), generator=gen, dtype=torch.int32)
    for i, nb in enumerate(need):
        table[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    if share and len(lens) > 1:
        shared = min(need[0], need[1]) - 1  # full blocks both sequences cover
        table[1, :shared] = table[0, :shared]
    return table


def _context(cache: Cache, table_row: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values 0..n-1 of one sequence, gathered through its table: [n, Hkv, D] float64."""
    kf, vf = cache.dequantized()
    pos = torch.arange(n, device=kf.device)
    slots = table_row.to(kf.device).long()[pos // cache.block_size] * cache.block_size
    slots = slots + pos % cache.block_size
    return kf[slots], vf[slots]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, H, D], k/v [L, Hkv, D], allowed [n, L] -> [n, H, D] float64 (masked softmax)."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)


def ref_decode(q, cache, tables, lens, scale, window):
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for r, n in enumerate(lens):
        if n == 0:
            continue
        k, v = _context(cache, tables[r], n)
        pos = torch.arange(n, device=q.device)
        allowed = torch.ones(1, n, dtype=torch.bool, device=q.device)
        if window is not None:
            allowed &= pos[None] > n - 1 - window
        out[r] = _attend(q[r : r + 1], k, v, allowed, scale)[0]
    return out


def ref_prefill(q, cache, tables, qlens, pasts, scale, window):
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for s, (n, past) in enumerate(zip(qlens, pasts, strict=True)):
        k, v = _context(cache, tables[s], past + n)
        q_pos = torch.arange(past, past + n, device=q.device)[:, None]
        k_pos = torch.arange(past + n, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        out[start : start + n] = _attend(q[start : start + n], k, v, allowed, scale)
        start += n
    return out


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any()
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# (dtype, G, head_dim, block_size, window, kind, num_splits): every value of each dimension
# appears, not their product (the interpreter is slow).
DECODE_CASES = [
    ("float32", 1, 16, 16, None, None, 1),
    ("float32", 2, 64, 5, None, None, 3),
    ("float32", 4, 80, 16, 7, None, 1),
    ("float32", 8, 32, 16, None, "int8", 2),
    ("float32", 2, 128, 64, None, "fp8", 1),
    ("float32", 1, 256, 16, 20, None, 2),
    ("float16", 4, 64, 16, None, None, 1),
    ("float16", 8, 80, 5, 9, "fp8", 3),
    ("float16", 2, 128, 16, None, "int8", 4),
    ("float16", 6, 16, 16, None, None, 2),
    ("bfloat16", 4, 128, 16, None, None, 1),
    ("bfloat16", 2, 80, 16, 9, "int8", 3),
    ("bfloat16", 8, 256, 5, None, "fp8", 2),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_matches_reference(case) -> None:
    _run_decode(case)


def _run_decode(case: tuple) -> None:
    name, g, d, bs, window, kind, splits = case
    dtype = _dtype(name)
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    hkv = 2
    lens = [37, 30, 1, 16, 0]  # several blocks, 1 key, exactly one block (at 16), padding
    num_blocks = sum(math.ceil(n / bs) for n in lens) + 3
    cache = Cache(num_blocks, bs, hkv, d, dtype, kind, gen)
    tables = _tables(lens, bs, num_blocks, gen)
    tables = torch.cat([tables, tables[:1]]).to(DEVICE)  # R' > R
    q = torch.randn(len(lens), hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    out = ta.paged_decode_attention(
        q, cache.k, cache.v, tables, ctx, scale=scale, sliding_window=window,
        num_splits=splits, **cache.kwargs(),
    )  # fmt: skip
    assert out.dtype == dtype and out.shape == q.shape
    _check(out, ref_decode(q, cache, tables, lens, scale, window), dtype)
    assert (out[-1] == 0).all()  # the padding row


@pytest.mark.parametrize("window", [None, 5])
def test_decode_splits_agree(window: int | None) -> None:
    """Split-K (more splits than tiles too) gives the single pass's result, through a
    preallocated (larger) workspace and ``out``."""
    gen = torch.Generator().manual_seed(3)
    bs, hkv, g, d = 16, 2, 4, 32
    lens = [150, 70, 0, 3]
    cache = Cache(40, bs, hkv, d, torch.float32, None, gen)
    tables = _tables(lens, bs, 40, gen).to(DEVICE)
    q = torch.randn(len(lens), hkv * g, d, generator=gen).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kw = {"block_size": bs, "scale": 0.3, "sliding_window": window}
    one = ta.paged_decode_attention(q, cache.k, cache.v, tables, ctx, **kw)
    ws = ta.decode_workspace(8, hkv * g, d, 8, DEVICE)
    for splits in (2, 5, 8):
        ws.acc.fill_(float("nan"))  # stale contents must not leak in
        ws.stats.fill_(float("nan"))
        out = torch.full_like(q, float("nan"))
        res = ta.paged_decode_attention(
            q, cache.k, cache.v, tables, ctx, num_splits=splits, out=out, workspace=ws, **kw
        )
        assert res is out
        torch.testing.assert_close(out, one, atol=1e-5, rtol=1e-5)
        assert (out[2] == 0).all()
    _check(one, ref_decode(q, cache, tables, lens, 0.3, window), torch.float32)


def test_decode_block_larger_than_contexts_and_strided_q() -> None:
    """The contiguous backend's layout (one block of max_model_len per sequence), and q / out
    as views of wider buffers (a fused qkv)."""
    gen = torch.Generator().manual_seed(4)
    bs, hkv, g, d = 100, 2, 2, 16
    lens = [45, 100, 1]
    cache = Cache(4, bs, hkv, d, torch.float16, None, gen)
    tables = torch.tensor([[2], [0], [3]], dtype=torch.int32, device=DEVICE)
    qkv = torch.randn(3, (hkv * g + 2 * hkv) * d, generator=gen).half().to(DEVICE)
    q = qkv[:, : hkv * g * d].view(3, hkv * g, d)
    big = torch.zeros(3, hkv * g + 1, d, dtype=torch.float16, device=DEVICE)
    out = big[:, 1:]
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ta.paged_decode_attention(
        q, cache.k, cache.v, tables, ctx, block_size=bs, scale=0.25, num_splits=2, out=out
    )
    _check(out, ref_decode(q, cache, tables, lens, 0.25, None), torch.float16)
    assert (big[:, 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nothing_past_a_rows_visible_keys_is_read(dtype: torch.dtype) -> None:
    """Every slot no row can see holds NaN, and every table entry past a row's blocks names a
    block of NaN (as CUDA-graph padding and freed blocks may): a read of one would make NaN
    out of the row (0 x NaN), so the outputs must have none."""
    gen = torch.Generator().manual_seed(11)
    bs, hkv, g, d, num_blocks = 8, 2, 2, 32, 12
    poison = num_blocks - 1

    def caches(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = torch.full((num_blocks * bs, hkv, d), float("nan"), dtype=dtype)
        v = k.clone()
        tables = torch.full((len(lens), 6), poison, dtype=torch.int32)
        first = 0
        for row, n in enumerate(lens):
            used = math.ceil(n / bs)
            tables[row, :used] = torch.arange(first, first + used, dtype=torch.int32)
            first += used
            slots = tables[row].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs
            k[slots] = torch.randn(n, hkv, d, generator=gen).to(dtype)
            v[slots] = torch.randn(n, hkv, d, generator=gen).to(dtype)
        assert first <= poison
        return k.to(DEVICE), v.to(DEVICE), tables.to(DEVICE)

    lens = [13, 1, 40, 0, 17]  # (ending mid-block, one key, none: a padding row)
    k, v, tables = caches(lens)
    q = torch.randn(len(lens), hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for window in (None, 5):
        for splits in (1, 3):
            out = ta.paged_decode_attention(q, k, v, tables, ctx, block_size=bs, scale=0.2,
                                            sliding_window=window, num_splits=splits)  # fmt: skip
            assert not out[ctx > 0].isnan().any(), (window, splits)
    # Prefill: chunks of 11 (no past) and 5 (after 19 cached keys), ending mid-block.
    k, v, tables = caches([11, 24])
    q = torch.randn(16, hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    starts = torch.tensor([0, 11, 16], dtype=torch.int32, device=DEVICE)
    past = torch.tensor([0, 19], dtype=torch.int32, device=DEVICE)
    for window in (None, 4):
        out = ta.paged_prefill_attention(q, k, v, tables, starts, past, 11, block_size=bs,
                                         scale=0.2, sliding_window=window)  # fmt: skip
        assert not out.isnan().any(), window


def test_fp8_bit_arithmetic_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The e4m3 decoding used on GPUs without fp8 (before sm_89) gives the bitcast's values."""
    gen = torch.Generator().manual_seed(5)
    bs, hkv, g, d = 16, 1, 2, 32
    lens = [40, 9]
    cache = Cache(6, bs, hkv, d, torch.float32, "fp8", gen)
    # Every finite e4m3 byte (both signs, subnormals, 448) among the stored keys.
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)
    cache.k.view(-1)[: codes.numel()] = codes.to(DEVICE)
    tables = _tables(lens, bs, 6, gen).to(DEVICE)
    q = torch.randn(2, hkv * g, d, generator=gen).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    native = ta.paged_decode_attention(
        q, cache.k, cache.v, tables, ctx, scale=0.2, **cache.kwargs()
    )
    monkeypatch.setattr(ta, "_fp8_native", lambda device: False)
    bits = ta.paged_decode_attention(q, cache.k, cache.v, tables, ctx, scale=0.2, **cache.kwargs())
    torch.testing.assert_close(bits, native, atol=1e-6, rtol=1e-6)
    _check(bits, ref_decode(q, cache, tables, lens, 0.2, None), torch.float32)


# (dtype, G, head_dim, block_size, window, kind)
PREFILL_CASES = [
    ("float32", 1, 16, 16, None, None),
    ("float32", 2, 80, 5, None, None),
    ("float32", 4, 32, 16, 6, "int8"),
    ("float32", 8, 64, 16, None, "fp8"),
    ("float32", 1, 256, 16, 11, None),
    ("float16", 2, 64, 16, None, None),
    ("float16", 4, 128, 5, 13, "int8"),
    ("float16", 1, 80, 64, None, "fp8"),
    ("bfloat16", 2, 128, 16, None, None),
    ("bfloat16", 4, 256, 16, 13, "fp8"),
    ("bfloat16", 8, 80, 5, None, "int8"),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_prefill_matches_reference(case) -> None:
    """Several chunks in one launch: a fresh prompt, a chunk starting mid-block after a past,
    one query after a long past, and a long chunk (more than one query tile)."""
    _run_prefill(case)


def _run_prefill(case: tuple) -> None:
    name, g, d, bs, window, kind = case
    dtype = _dtype(name)
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    hkv = 2
    qlens = [21, 9, 1, 40]
    pasts = [0, 19, 30, 3]
    totals = [n + p for n, p in zip(qlens, pasts, strict=True)]
    num_blocks = sum(math.ceil(n / bs) for n in totals) + 2
    cache = Cache(num_blocks, bs, hkv, d, dtype, kind, gen)
    tables = _tables(totals, bs, num_blocks, gen).to(DEVICE)
    t = sum(qlens)
    q = torch.randn(t, hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    past = torch.tensor(pasts, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    out = ta.paged_prefill_attention(
        q, cache.k, cache.v, tables, qsl.to(DEVICE), past, max(qlens),
        scale=scale, sliding_window=window, **cache.kwargs(),
    )  # fmt: skip
    assert out.dtype == dtype and out.shape == q.shape
    _check(out, ref_prefill(q, cache, tables, qlens, pasts, scale, window), dtype)


@pytest.mark.parametrize(
    "case",
    [
        ("decode", "float32", 4, 64, 16, None, "int8", 1),
        ("decode", "float16", 2, 80, 5, 9, "fp8", 3),
        ("prefill", "float32", 2, 32, 16, 6, "fp8"),
        ("prefill", "float16", 4, 64, 5, None, "int8"),
    ],
    ids=lambda c: "-".join(map(str, c)),
)
def test_folded_scales(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 queries' way with a one-byte cache (scales on scores and softmax weights, not
    on every value), checked in the dtypes the interpreter computes correctly."""
    monkeypatch.setattr(ta, "_fold_scales", lambda dtype: True)
    if case[0] == "decode":
        _run_decode(case[1:])
    else:
        _run_prefill(case[1:])


def test_prefill_into_out_leaves_other_rows() -> None:
    """``out=`` is written only at the chunks' rows (trailing padding rows stay as they were);
    a max_query_len above every chunk's length only adds programs that exit."""
    gen = torch.Generator().manual_seed(6)
    bs, hkv, g, d = 8, 1, 2, 16
    cache = Cache(10, bs, hkv, d, torch.float32, None, gen)
    tables = _tables([12, 20], bs, 10, gen).to(DEVICE)
    q = torch.randn(18, hkv * g, d, generator=gen).to(DEVICE)
    # Rows 0..11: sequence 0 (no past); 12..15: sequence 1 (16 tokens past); 16, 17: padding.
    qsl = torch.tensor([0, 12, 16], dtype=torch.int32, device=DEVICE)
    past = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, 7.0)
    res = ta.paged_prefill_attention(
        q, cache.k, cache.v, tables, qsl, past, 70, block_size=bs, scale=0.5, out=out
    )
    assert res is out and (out[16:] == 7.0).all()
    ref = ref_prefill(q[:16], cache, tables, [12, 4], [0, 16], 0.5, None)
    _check(out[:16], ref, torch.float32)


def test_prefill_runs_the_tiles_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """``config=`` (how ``infer bench gpu`` times other tiles) is the launch's configuration,
    and the output is still attention."""
    launched = []
    kernel = ta._prefill_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launched.append((grid[2], meta["BLOCK_M"], meta["BLOCK_N"], meta["num_warps"]))
                return kernel[grid](*args, **meta)

            return launch

    monkeypatch.setattr(ta, "_prefill_kernel", Spy())
    gen = torch.Generator().manual_seed(8)
    bs, hkv, g, d = 8, 2, 2, 16
    cache = Cache(12, bs, hkv, d, torch.float32, None, gen)
    tables = _tables([40, 25], bs, 12, gen).to(DEVICE)
    q = torch.randn(45, hkv * g, d, generator=gen).to(DEVICE)
    qsl = torch.tensor([0, 40, 45], dtype=torch.int32, device=DEVICE)
    past = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
    out = ta.paged_prefill_attention(
        q, cache.k, cache.v, tables, qsl, past, 40, block_size=bs, scale=0.25,
        config=(16, 32, 2, 1),
    )  # fmt: skip
    assert launched == [(3, 16, 32, 2)]  # 40 queries: three tiles of 16
    _check(out, ref_prefill(q, cache, tables, [40, 5], [0, 20], 0.25, None), torch.float32)


@pytest.mark.parametrize(
    ("dtype", "width", "slot_dtype"),
    [
        (torch.float16, 24, torch.int64),
        (torch.bfloat16, 80, torch.int32),
        (torch.float32, 16, torch.int32),
        (torch.int8, 32, torch.int64),
        (torch.uint8, 32, torch.int32),
        (torch.bfloat16, 1, torch.int64),  # a one-byte cache's scales, as [T, Hkv, 1] views
    ],
)
def test_store_kv(dtype: torch.dtype, width: int, slot_dtype: torch.dtype) -> None:
    """Rows land at their slots bit for bit; negative slots are skipped and no other slot
    changes. k and v may be strided views (of a fused qkv)."""
    gen = torch.Generator().manual_seed(7)
    hkv, t, num_slots = 3, 6, 20

    def rand(*shape: int) -> torch.Tensor:
        if dtype in (torch.int8, torch.uint8):
            lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256)
            return torch.randint(lo, hi, shape, generator=gen).to(dtype).to(DEVICE)
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    fused = rand(t, 3, hkv, width)
    k, v = fused[:, 1], fused[:, 2]
    if width == 1:  # scales [T, Hkv] and [num_slots, Hkv] viewed as [.., 1]
        k_cache, v_cache = rand(num_slots, hkv)[..., None], rand(num_slots, hkv)[..., None]
    else:
        k_cache, v_cache = rand(num_slots, hkv, width), rand(num_slots, hkv, width)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, -1, 0, 19, -1, 7], dtype=slot_dtype, device=DEVICE)
    ta.store_kv(k, v, k_cache, v_cache, slots)
    exp_k, exp_v = before_k.clone(), before_v.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            exp_k[s], exp_v[s] = k[i], v[i]
    assert torch.equal(_bits(k_cache), _bits(exp_k))
    assert torch.equal(_bits(v_cache), _bits(exp_v))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(ta._BIT_VIEWS[x.element_size()])


def test_store_then_attend_quantized() -> None:
    """A step as the engine runs it: quantize, store values and scales with store_kv, then
    decode through the fresh rows."""
    gen = torch.Generator().manual_seed(8)
    bs, hkv, g, d, kind = 4, 2, 2, 16, "int8"
    cache = Cache(6, bs, hkv, d, torch.float32, kind, gen)
    tables = torch.tensor([[4, 1, 3]], dtype=torch.int32, device=DEVICE)
    k_new = torch.randn(2, hkv, d, generator=gen).to(DEVICE)
    v_new = torch.randn(2, hkv, d, generator=gen).to(DEVICE)
    kq, ksc = kv_quant.quantize(k_new, kind)
    vq, vsc = kv_quant.quantize(v_new, kind)
    slots = torch.tensor([1 * bs + 3, -1], dtype=torch.int64, device=DEVICE)  # position 7
    ta.store_kv(kq, vq, cache.k, cache.v, slots)
    ta.store_kv(ksc[..., None], vsc[..., None], cache.ks[..., None], cache.vs[..., None], slots)
    assert torch.equal(cache.k[7], kq[0]) and torch.equal(cache.vs[7], vsc[0])
    q = torch.randn(1, hkv * g, d, generator=gen).to(DEVICE)
    ctx = torch.tensor([8], dtype=torch.int32, device=DEVICE)
    out = ta.paged_decode_attention(q, cache.k, cache.v, tables, ctx, scale=0.25, **cache.kwargs())
    _check(out, ref_decode(q, cache, tables, [8], 0.25, None), torch.float32)


def test_triton_available() -> None:
    assert ta.triton_available()


@pytest.mark.parametrize(
    "case,num_programs",
    [
        (("float32", 2, 32, 5, None, None), 3),  # fewer programs than units: each loops
        (("float32", 4, 64, 16, 6, "int8"), 500),  # more: the extra ones find nothing
        (("float16", 1, 80, 16, None, "fp8"), 7),
        (("bfloat16", 4, 128, 16, 13, None), 64),
    ],
    ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else str(c),
)
def test_prefill_tiles_give_the_prefill_kernels_numbers(case: tuple, num_programs: int) -> None:
    """The fixed-grid kernel (a mixed step's CUDA graph) over a padded step: the tile list of
    the real chunks, padding rows after them and a stale sequence past them in the metadata
    (as the graph's buffers hold); the same output as the grid-per-step kernel, bit for bit,
    and the reference's; the padding rows are not written."""
    name, g, d, bs, window, kind = case
    dtype = _dtype(name)
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    hkv = 2
    qlens = [1, 21, 1, 40, 9]  # decodes as chunks of one beside prompt chunks
    pasts = [17, 0, 30, 3, 19]
    totals = [n + p for n, p in zip(qlens, pasts, strict=True)]
    num_blocks = sum(math.ceil(n / bs) for n in totals) + 4
    cache = Cache(num_blocks, bs, hkv, d, dtype, kind, gen)
    tables = _tables([*totals, 8], bs, num_blocks, gen).to(DEVICE)
    t = sum(qlens)
    padded = t + 6
    q = torch.randn(padded, hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    starts = [0, *torch.tensor(qlens).cumsum(0).tolist()]
    qsl = torch.tensor([*starts, padded], dtype=torch.int32, device=DEVICE)
    past = torch.tensor([*pasts, 5], dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    kw = dict(scale=scale, sliding_window=window, **cache.kwargs())
    plain = ta.paged_prefill_attention(
        q[:t], cache.k, cache.v, tables[:5], qsl[:6], past[:5], max(qlens), **kw
    )
    block_m = ta.prefill_block_m(d, dtype)
    seq, tile = prefill_tiles(qlens, block_m)
    assert len(seq) == sum(-(-n // block_m) for n in qlens)
    cap = padded // block_m + 6
    tile_seq = torch.full((cap,), 99, dtype=torch.int32)
    tile_index = torch.full((cap,), 99, dtype=torch.int32)
    tile_seq[: len(seq)] = torch.from_numpy(seq)
    tile_index[: len(seq)] = torch.from_numpy(tile)
    num_tiles = torch.tensor([len(seq)], dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    res = ta.paged_prefill_attention_tiles(
        q, cache.k, cache.v, tables, qsl, past,
        tile_seq.to(DEVICE), tile_index.to(DEVICE), num_tiles.to(DEVICE), num_programs,
        out=out, **kw,
    )  # fmt: skip
    assert res is out and (out[t:] == 7.0).all()
    assert torch.equal(out[:t], plain)
    _check(out[:t], ref_prefill(q[:t], cache, tables, qlens, pasts, scale, window), dtype)


@pytest.mark.parametrize(
    ("case", "prefill", "splits"),
    [
        (("float32", 2, 32, 5, None, None), "tiles", 1),
        (("float16", 4, 64, 16, 6, "int8"), "tiles", 3),
        (("float32", 4, 16, 4, 5, "fp8"), "grid", 2),
    ],
    ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else str(c),
)
def test_a_mixed_steps_decodes_through_the_decode_kernel(
    case: tuple, prefill: str, splits: int
) -> None:
    """A mixed step as the engine attends it by default: its one-token chunks listed for the
    decode kernel (entry: query row, the sequence's table, context; split over the keys), the
    unused entries of a fixed-size list (context 0) writing nothing, and no row outside the
    list written; the prefill kernel takes only the longer chunks (a padded step's tile list
    holds only theirs; the grid-per-step kernel skips chunks of one, ``min_query_len=2``).
    The two give the reference's attention, and the padding rows are not written."""
    name, g, d, bs, window, kind = case
    dtype = _dtype(name)
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    hkv = 2
    qlens = [1, 21, 1, 40, 1]
    pasts = [17, 0, 30, 3, 2]
    totals = [n + p for n, p in zip(qlens, pasts, strict=True)]
    num_blocks = sum(math.ceil(n / bs) for n in totals) + 4
    cache = Cache(num_blocks, bs, hkv, d, dtype, kind, gen)
    tables = _tables(totals, bs, num_blocks, gen).to(DEVICE)
    t, padded = sum(qlens), sum(qlens) + 5
    q = torch.randn(padded, hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    starts = [0, *torch.tensor(qlens).cumsum(0).tolist()]
    qsl = torch.tensor([*starts[:-1], padded], dtype=torch.int32, device=DEVICE)
    exact = torch.tensor(starts, dtype=torch.int32, device=DEVICE)  # the last chunk unpadded
    past = torch.tensor(pasts, dtype=torch.int32, device=DEVICE)
    one = [s for s, n in enumerate(qlens) if n == 1]
    decoded = [starts[s] for s in one]

    def i32(values: list[int]) -> torch.Tensor:  # the list, then two unused entries
        return torch.tensor(values + [0, 0], dtype=torch.int32, device=DEVICE)

    scale = d**-0.5
    kw = dict(scale=scale, sliding_window=window, **cache.kwargs())
    # the grid kernel alone leaves the chunks of one untouched
    skipped = torch.full_like(q, 7.0)
    ta.paged_prefill_attention(
        q, cache.k, cache.v, tables, exact, past, max(qlens), out=skipped, min_query_len=2, **kw
    )
    assert (skipped[decoded] == 7.0).all() and not (skipped[1:22] == 7.0).any()
    out = torch.full_like(q, 7.0)
    ta.paged_decode_attention(
        q, cache.k, cache.v, tables, i32([pasts[s] + 1 for s in one]),
        row_ids=i32(decoded), row_tables=i32(one), num_splits=splits, out=out, **kw,
    )  # fmt: skip
    untouched = [r for r in range(padded) if r not in decoded]
    assert (out[untouched] == 7.0).all() and not (out[decoded] == 7.0).any()
    if prefill == "grid":  # an exact step
        ta.paged_prefill_attention(
            q, cache.k, cache.v, tables, exact, past, max(qlens), out=out, min_query_len=2, **kw
        )
    else:
        seq, tile = prefill_tiles([0 if n == 1 else n for n in qlens], ta.prefill_block_m(d, dtype))
        assert set(seq.tolist()) == {1, 3}
        ta.paged_prefill_attention_tiles(
            q, cache.k, cache.v, tables, qsl, past,
            torch.from_numpy(seq).to(torch.int32).to(DEVICE),
            torch.from_numpy(tile).to(torch.int32).to(DEVICE),
            torch.tensor([len(seq)], dtype=torch.int32, device=DEVICE), 3, out=out, **kw,
        )  # fmt: skip
    assert (out[t:] == 7.0).all()
    _check(out[:t], ref_prefill(q[:t], cache, tables, qlens, pasts, scale, window), dtype)


def test_prefill_tiles_lay_out_each_chunks_query_tiles() -> None:
    seq, tile = prefill_tiles([3, 1, 130, 64, 65], 64)
    assert seq.tolist() == [0, 1, 2, 2, 2, 3, 4, 4]
    assert tile.tolist() == [0, 0, 0, 1, 2, 0, 0, 1]
    seq, tile = prefill_tiles([], 64)
    assert len(seq) == len(tile) == 0

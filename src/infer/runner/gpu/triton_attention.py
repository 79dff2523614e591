"""Triton kernels for attention over the paged KV cache (CUDA GPUs; CPU under the interpreter).

Three kinds of kernel, each reading K and V in place through the block tables (no gathered copy of a
context, no mask tensor):

- :func:`store_kv` writes a step's K and V rows at their slots (one launch for both; rows with
  a negative slot, the padding rows of a CUDA graph, are skipped);
- :func:`paged_decode_attention`: one query row per entry, flash-decoding (split-K);
- :func:`paged_prefill_attention`: every prefill / extend chunk of a step in one launch, causal
  over the sequence's past and the chunk itself (whose K/V are already stored);
  :func:`paged_prefill_attention_tiles` runs the same per-tile code from a list of query tiles
  held on the device, by a fixed number of programs (a mixed step's CUDA graph).

Cache layout (one layer, as :class:`infer.runner.attention.KVCache` holds it)::

    k_cache, v_cache : [num_slots, num_kv_heads, head_dim]
    slot(p)          = block_table[p // block_size] * block_size + p % block_size
    k_scales, v_scales (int8 / fp8 caches): [num_slots, num_kv_heads] bf16
    value            = stored * scale                      (see infer.runner.kv_quant)

A key tile is ``BLOCK_N`` consecutive positions; each position's slot is computed on its own, so
any ``block_size`` works (16, an odd 5, or ``max_model_len`` for the contiguous backend) and a
tile may straddle blocks. ``head_dim`` is padded to a power of two (>= 16) with masks, so 80 and
96 work. With ``num_heads = G * num_kv_heads`` (GQA) query head ``h`` reads kv head ``h // G``.

Numerics: online softmax in float32 (base 2: scores are scaled by ``scale * log2(e)`` once and
``exp2`` is used throughout). K and V are turned into the query's dtype before the dots; a
one-byte cache is dequantized in float32 first (exact for a float32 query), except under bf16
queries, where the stored values (exact in bf16) go into the dots and each key's scale
multiplies its score column, each value's scale its softmax weight (one multiply per key, not
per value: faster on an H100). The softmax weights are rounded to the query's dtype for the
``P @ V`` dot, as flash attention does; float32 inputs use exact ("ieee") dots, not TF32.
Tested on an H100 (torch 2.11, Triton 3.6) and under the interpreter (Triton 3.9).

Portability: only the core ``tl`` API is used, so the same source runs under the interpreter
(``TRITON_INTERPRET=1``, set before this module is imported) and compiled on an H100 with the
Triton of torch 2.11. The bf16 scales are passed as their int16 bits and rebuilt as float32 by a
16-bit shift (exact); fp8 bytes are bitcast to ``float8e4nv`` where the GPU has it (sm_89+)
and the interpreter, else converted by bit arithmetic. The launchers read no tensor values on
the host (no ``.item()``): grids depend only on shapes and Python ints, so they can be captured
in CUDA graphs (pass ``out=`` and ``workspace=`` buffers to keep every address static).
"""

from __future__ import annotations

import inspect
import math
import os
from typing import NamedTuple

import torch

from infer.runner import kv_quant

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the engine runs without triton (CPU kernels, SDPA)
    triton = None
    tl = None

_LOG2E = 1.4426950408889634

# Integer views of the float dtypes: store_kv copies bits, which is exact and avoids the
# interpreter's bf16 arithmetic entirely.
_BIT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def triton_available() -> bool:
    """Whether the kernels can run here: triton imports and either a CUDA GPU of compute
    capability 8.0 or above is present (bf16 dots, ``cp.async``), or ``TRITON_INTERPRET=1``
    runs them on the CPU (tests)."""
    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        return True
    if not torch.cuda.is_available():
        return False
    try:
        return torch.cuda.get_device_capability() >= (8, 0)
    except Exception:  # pragma: no cover - a broken driver counts as unusable
        return False


def _fp8_native(device: torch.device) -> bool:
    """Whether the kernels may bitcast bytes to ``float8e4nv`` (Triton supports it on sm_89+
    and under the interpreter); elsewhere e4m3 is decoded by bit arithmetic."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an integer tensor of the same item size (a view, any strides)."""
    return t.view(_BIT_VIEWS[t.element_size()])


def _kind_code(kv_kind: str | None, k_scales: torch.Tensor | None) -> int:
    if kv_kind not in kv_quant.KIND_CODES:
        raise ValueError(f"unknown kv_kind {kv_kind!r}")
    if kv_kind is not None and k_scales is None:
        raise ValueError(f"kv_kind {kv_kind!r} needs k_scales and v_scales")
    return kv_quant.KIND_CODES[kv_kind]


def _scale_args(
    k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Scale pointers as int16 bits (or the cache itself, never read) and their two strides."""
    if k_scales is None or v_scales is None:
        return k_cache, k_cache, 0, 0
    assert k_scales.dtype == torch.bfloat16 and v_scales.dtype == torch.bfloat16
    assert k_scales.stride() == v_scales.stride()
    return _bits(k_scales), _bits(v_scales), k_scales.stride(0), k_scales.stride(1)


class DecodeWorkspace(NamedTuple):
    """float32 buffers for the split-K partials of :func:`paged_decode_attention`.

    ``acc``: ``[R, H, num_splits, D]`` unnormalized outputs; ``stats``: ``[R, H, num_splits, 2]``
    running max (base-2 units) and sum of each split. A workspace made for more rows or splits
    than a call uses serves it too (it is indexed through its strides).
    """

    acc: torch.Tensor
    stats: torch.Tensor


def decode_workspace(
    num_rows: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device | str
) -> DecodeWorkspace:
    """Preallocated split-K buffers (static addresses for CUDA graphs); contents need no init."""
    acc = torch.empty(num_rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    stats = torch.empty(num_rows, num_heads, num_splits, 2, dtype=torch.float32, device=device)
    return DecodeWorkspace(acc, stats)


if triton is not None:
    if "input_precision" in inspect.signature(tl.dot).parameters:

        @triton.jit
        def _dot_exact(a, b):
            """A float32 dot without TF32 rounding."""
            return tl.dot(a, b, input_precision="ieee")

    else:  # pragma: no cover - Triton before 3.0

        @triton.jit
        def _dot_exact(a, b):
            """A float32 dot without TF32 rounding."""
            return tl.dot(a, b, allow_tf32=False)

    @triton.jit
    def _dot(a, b, EXACT: tl.constexpr):
        """``a @ b`` with a float32 accumulator; exact float32 products when ``EXACT``."""
        if EXACT:
            return _dot_exact(a, b)
        else:
            return tl.dot(a, b)

    @triton.jit
    def _bf16_bits_to_f32(bits):
        """bf16 given as its int16 bits -> float32 (exact: a bf16 is a float32's top half)."""
        return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_to_f32(x, FP8_NATIVE: tl.constexpr):
        """Bytes holding float8_e4m3fn bits -> float32 (NaN bytes, never stored, not kept)."""
        if FP8_NATIVE:
            return x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            b = x.to(tl.int32) & 0xFF
            e = (b >> 3) & 0xF
            m = b & 0x7
            normal = ((b & 0x80) << 24) | ((e + 120) << 23) | (m << 20)
            sub = m.to(tl.float32) * 0.001953125  # m * 2^-9, e4m3 subnormals
            sub = tl.where((b & 0x80) != 0, -sub, sub)
            return tl.where(e == 0, sub, normal.to(tl.float32, bitcast=True))

    @triton.jit
    def _load_scales(scales_ptr, slots, kv_head, mask_n, stride_sslot, stride_shead):
        """The bf16 scales of rows ``slots`` of one kv head, as float32 ``[BLOCK_N]``."""
        sbits = tl.load(
            scales_ptr + slots * stride_sslot + kv_head * stride_shead, mask=mask_n, other=0
        )
        return _bf16_bits_to_f32(sbits)

    @triton.jit
    def _load_kv_tile(
        cache_ptr,
        scales_ptr,
        slots,
        kv_head,
        offs_d,
        mask_n,
        mask_d,
        stride_slot,
        stride_head,
        stride_sslot,
        stride_shead,
        OUT_DTYPE: tl.constexpr,
        KV_KIND: tl.constexpr,
        FP8_NATIVE: tl.constexpr,
        FOLD_SCALES: tl.constexpr,
    ):
        """``[BLOCK_N, D_PAD]`` rows at ``slots`` (int64) of one kv head, in ``OUT_DTYPE``
        (masked rows and dims read as 0). A one-byte cache is dequantized in float32, or with
        ``FOLD_SCALES`` returned unscaled (exact in bf16 / fp16: at most 8 significant bits)
        for the caller to scale scores (K) and softmax weights (V) instead."""
        ptrs = cache_ptr + slots[:, None] * stride_slot + kv_head * stride_head + offs_d[None, :]
        x = tl.load(ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0)
        if KV_KIND == 0:
            return x.to(OUT_DTYPE)
        else:
            if KV_KIND == 1:
                xf = x.to(tl.float32)
            else:
                xf = _e4m3_to_f32(x, FP8_NATIVE)
            if FOLD_SCALES:
                return xf.to(OUT_DTYPE)
            else:
                s = _load_scales(scales_ptr, slots, kv_head, mask_n, stride_sslot, stride_shead)
                return (xf * s[:, None]).to(OUT_DTYPE)

    @triton.jit
    def _attend_tile(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        pos,
        valid,
        window,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        bt_row,
        kvh,
        offs_d,
        mask_d,
        stride_k_slot,
        stride_k_head,
        stride_v_slot,
        stride_v_head,
        stride_s_slot,
        stride_s_head,
        qk_scale,
        BLOCK_SIZE: tl.constexpr,
        DTYPE: tl.constexpr,
        KV_KIND: tl.constexpr,
        FP8_NATIVE: tl.constexpr,
        FOLD_SCALES: tl.constexpr,
        EXACT: tl.constexpr,
        MASK: tl.constexpr,
        WINDOWED: tl.constexpr,
    ):
        """One online-softmax step: query rows ``q`` ``[M, D_PAD]`` (positions ``q_pos``)
        against the keys at positions ``pos`` ``[BLOCK_N]`` (``valid``: in the context), read
        through the block table. ``MASK``: 0 every (row, key) pair is visible, 1 the keys'
        ``valid`` alone, 2 also causal (key <= row) and, when ``WINDOWED``, key > row - window.
        Returns the updated ``(acc, l_i, m_i)`` (scores in base-2 units)."""
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slots = blk * BLOCK_SIZE + pos % BLOCK_SIZE
        k = _load_kv_tile(
            k_ptr, ks_ptr, slots, kvh, offs_d, valid, mask_d,
            stride_k_slot, stride_k_head, stride_s_slot, stride_s_head,
            DTYPE, KV_KIND, FP8_NATIVE, FOLD_SCALES,
        )  # fmt: skip
        s = _dot(q, tl.trans(k), EXACT)  # [M, BLOCK_N]
        if KV_KIND != 0 and FOLD_SCALES:
            ks = _load_scales(ks_ptr, slots, kvh, valid, stride_s_slot, stride_s_head)
            s = s * (ks * qk_scale)[None, :]
        else:
            s = s * qk_scale
        if MASK == 1:
            s = tl.where(valid[None, :], s, float("-inf"))
        elif MASK == 2:
            ok = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            if WINDOWED:
                ok = ok & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
        # A row may see nothing in a tile (outside its window, a padding row): keep it NaN-free.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(
            v_ptr, vs_ptr, slots, kvh, offs_d, valid, mask_d,
            stride_v_slot, stride_v_head, stride_s_slot, stride_s_head,
            DTYPE, KV_KIND, FP8_NATIVE, FOLD_SCALES,
        )  # fmt: skip
        if KV_KIND != 0 and FOLD_SCALES:
            vs = _load_scales(vs_ptr, slots, kvh, valid, stride_s_slot, stride_s_head)
            p = p * vs[None, :]
        acc = acc * alpha[:, None] + _dot(p.to(DTYPE), v, EXACT)
        return acc, l_i, m_new

    @triton.jit
    def _store_kv_kernel(
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        slots_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_kc_slot,
        stride_kc_h,
        stride_vc_slot,
        stride_vc_h,
        W: tl.constexpr,
        NUM_ELEMS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Program t copies row t of k and v (``Hkv * W`` values, bits) to slot ``slots[t]``,
        unless that slot is negative. The last dim is contiguous everywhere."""
        t = tl.program_id(0)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        h = offs // W
        w = offs % W
        # One comparison (the interpreter rejects a mask made by & of a vector and a scalar).
        mask = offs < tl.where(slot >= 0, NUM_ELEMS, 0)
        row = t.to(tl.int64)
        k = tl.load(k_ptr + row * stride_kt + h * stride_kh + w, mask=mask)
        v = tl.load(v_ptr + row * stride_vt + h * stride_vh + w, mask=mask)
        tl.store(kc_ptr + slot * stride_kc_slot + h * stride_kc_h + w, k, mask=mask)
        tl.store(vc_ptr + slot * stride_vc_slot + h * stride_vc_h + w, v, mask=mask)

    @triton.jit
    def _decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        bt_ptr,
        lens_ptr,
        ids_ptr,
        rt_ptr,
        out_ptr,
        acc_ptr,
        stats_ptr,
        stride_qr,
        stride_qh,
        stride_k_slot,
        stride_k_head,
        stride_v_slot,
        stride_v_head,
        stride_s_slot,
        stride_s_head,
        stride_bt,
        stride_or,
        stride_oh,
        stride_ar,
        stride_ah,
        stride_as,
        stride_sr,
        stride_sh,
        stride_ss,
        qk_scale,
        window,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        WINDOWED: tl.constexpr,
        KV_KIND: tl.constexpr,
        FP8_NATIVE: tl.constexpr,
        FOLD_SCALES: tl.constexpr,
        EXACT: tl.constexpr,
        ROW_IDS: tl.constexpr,
    ):
        """One program = (row r, kv head, split): the group's G query heads against the split's
        key tiles. See :func:`paged_decode_attention` for the indexing. ``ROW_IDS``: entry r is
        query row ``ids[r]`` with table ``bt[rt[r]]``, and one of context 0 writes nothing (a
        mixed step's decodes)."""
        r = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        DTYPE = q_ptr.dtype.element_ty

        ctx = tl.load(lens_ptr + r)
        start = ctx * 0
        if WINDOWED:
            start = tl.maximum(ctx - window, 0)
        # The visible keys [start, ctx) in tiles of BLOCK_N, cut into NUM_SPLITS runs of tiles.
        tile_lo = start // BLOCK_N
        tile_hi = tl.cdiv(ctx, BLOCK_N)
        per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        my_lo = tile_lo + split * per_split
        my_hi = tl.minimum(my_lo + per_split, tile_hi)

        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        mask_g = offs_g < G
        mask_d = offs_d < HEAD_DIM
        heads = kvh * G + offs_g
        entry = r.to(tl.int64)  # the workspace's row
        mask_q = mask_g
        if ROW_IDS:
            row = tl.load(ids_ptr + r).to(tl.int64)
            bt_row = bt_ptr + tl.load(rt_ptr + r).to(tl.int64) * stride_bt
            # an unused entry (a padded step's list) reads nothing, not even its query
            mask_q = mask_g & ((offs_g * 0 + ctx) > 0)
        else:
            row = entry
            bt_row = bt_ptr + row * stride_bt
        q = tl.load(
            q_ptr + row * stride_qr + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_q[:, None] & mask_d[None, :],
            other=0,
        )

        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        for t in range(my_lo, my_hi):
            pos = t * BLOCK_N + offs_n
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, offs_g, pos, (pos >= start) & (pos < ctx), window,
                k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, offs_d, mask_d,
                stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                stride_s_slot, stride_s_head, qk_scale,
                BLOCK_SIZE, DTYPE, KV_KIND, FP8_NATIVE, FOLD_SCALES, EXACT, 1, False,
            )  # fmt: skip

        mask_gd = mask_g[:, None] & mask_d[None, :]
        if NUM_SPLITS == 1:
            # l_i == 0 only for a padding row (no keys): acc is 0 there, and so is the output
            # (not written with ROW_IDS: an unused entry of a mixed step's list).
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            if ROW_IDS:  # (ctx as a vector: the interpreter takes no scalar in a mask)
                mask_gd = mask_gd & ((offs_g * 0 + ctx) > 0)[:, None]
            tl.store(
                out_ptr + row * stride_or + heads[:, None] * stride_oh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=mask_gd,
            )
        else:
            a_ptrs = acc_ptr + entry * stride_ar + heads * stride_ah + split * stride_as
            tl.store(a_ptrs[:, None] + offs_d[None, :], acc, mask=mask_gd)
            s_ptrs = stats_ptr + entry * stride_sr + heads * stride_sh + split * stride_ss
            tl.store(s_ptrs, m_i, mask=mask_g)
            tl.store(s_ptrs + 1, l_i, mask=mask_g)

    @triton.jit
    def _decode_combine_kernel(
        acc_ptr,
        stats_ptr,
        out_ptr,
        ids_ptr,
        lens_ptr,
        stride_ar,
        stride_ah,
        stride_as,
        stride_sr,
        stride_sh,
        stride_ss,
        stride_or,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        S_PAD: tl.constexpr,
        ROW_IDS: tl.constexpr,
    ):
        """One program = (row, query head): rescale the splits' partials to their common max,
        sum, normalize. Splits with no keys carry max -inf and sum 0 and drop out.
        ``ROW_IDS``: entry r writes query row ``ids[r]``, and nothing at context 0."""
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask_s = offs_s < NUM_SPLITS
        mask_d = offs_d < HEAD_DIM
        s_ptrs = stats_ptr + r * stride_sr + h * stride_sh + offs_s * stride_ss
        m = tl.load(s_ptrs, mask=mask_s, other=float("-inf"))
        l = tl.load(s_ptrs + 1, mask=mask_s, other=0.0)  # noqa: E741
        m_max = tl.max(m, 0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_safe)  # 0 for empty splits
        total = tl.sum(w * l, 0)
        a_ptrs = acc_ptr + r * stride_ar + h * stride_ah + offs_s[:, None] * stride_as
        a = tl.load(a_ptrs + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        o = tl.sum(a * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        row = r
        if ROW_IDS:
            row = tl.load(ids_ptr + r).to(tl.int64)
            mask_d = mask_d & ((offs_d * 0 + tl.load(lens_ptr + r)) > 0)
        tl.store(
            out_ptr + row * stride_or + h * stride_oh + offs_d,
            o.to(out_ptr.dtype.element_ty),
            mask=mask_d,
        )

    @triton.jit
    def _prefill_program(
        seq,
        h,
        mt,
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        bt_ptr,
        qsl_ptr,
        past_ptr,
        out_ptr,
        stride_qt,
        stride_qh,
        stride_k_slot,
        stride_k_head,
        stride_v_slot,
        stride_v_head,
        stride_s_slot,
        stride_s_head,
        stride_bt,
        stride_ot,
        stride_oh,
        qk_scale,
        window,
        G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        WINDOWED: tl.constexpr,
        KV_KIND: tl.constexpr,
        FP8_NATIVE: tl.constexpr,
        FOLD_SCALES: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        """Query tile ``mt`` (BLOCK_M queries) of sequence ``seq``'s chunk, query head ``h``;
        the tile must start inside the chunk.

        Query i of the chunk sits at position ``past + i`` and sees keys ``j <= past + i``
        (and ``j > past + i - window``); the key loop covers the tile's union of those ranges,
        from the window's first tile (not 0) to the tile's last query, masking per element.
        """
        DTYPE = q_ptr.dtype.element_ty
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        past = tl.load(past_ptr + seq)
        kvh = h // G

        offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        mask_m = offs_m < q_len
        mask_d = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0,
        )
        q_pos = past + offs_m
        key_hi = past + tl.minimum((mt + 1) * BLOCK_M, q_len)  # last query's position + 1
        key_lo = key_hi * 0
        if WINDOWED:
            key_lo = tl.maximum(past + mt * BLOCK_M - window + 1, 0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        # Key tiles [lo, hi) split in three runs: [lo, a) and [b, hi) need the causal / window
        # mask, [a, b) is visible to every query of the tile (no mask arithmetic there).
        first_q = past + mt * BLOCK_M
        lo = key_lo // BLOCK_N
        hi = tl.cdiv(key_hi, BLOCK_N)
        full_lo = lo
        if WINDOWED:
            # every row sees key j when j > last row's position - window
            full_lo = tl.cdiv(tl.maximum(key_hi - window, 0), BLOCK_N)
        a = tl.minimum(tl.maximum(full_lo, lo), hi)
        b = tl.minimum(tl.maximum((first_q + 1) // BLOCK_N, a), hi)
        for t in range(lo, a):
            pos = t * BLOCK_N + offs_n
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, pos, pos < key_hi, window,
                k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, offs_d, mask_d,
                stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                stride_s_slot, stride_s_head, qk_scale,
                BLOCK_SIZE, DTYPE, KV_KIND, FP8_NATIVE, FOLD_SCALES, EXACT, 2, WINDOWED,
            )  # fmt: skip
        for t in range(a, b):
            pos = t * BLOCK_N + offs_n
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, pos, pos < key_hi, window,
                k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, offs_d, mask_d,
                stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                stride_s_slot, stride_s_head, qk_scale,
                BLOCK_SIZE, DTYPE, KV_KIND, FP8_NATIVE, FOLD_SCALES, EXACT, 0, WINDOWED,
            )  # fmt: skip
        for t in range(b, hi):
            pos = t * BLOCK_N + offs_n
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, pos, pos < key_hi, window,
                k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, offs_d, mask_d,
                stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                stride_s_slot, stride_s_head, qk_scale,
                BLOCK_SIZE, DTYPE, KV_KIND, FP8_NATIVE, FOLD_SCALES, EXACT, 2, WINDOWED,
            )  # fmt: skip

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )

    @triton.jit
    def _prefill_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        bt_ptr,
        qsl_ptr,
        past_ptr,
        out_ptr,
        stride_qt,
        stride_qh,
        stride_k_slot,
        stride_k_head,
        stride_v_slot,
        stride_v_head,
        stride_s_slot,
        stride_s_head,
        stride_bt,
        stride_ot,
        stride_oh,
        qk_scale,
        window,
        G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        WINDOWED: tl.constexpr,
        KV_KIND: tl.constexpr,
        FP8_NATIVE: tl.constexpr,
        FOLD_SCALES: tl.constexpr,
        EXACT: tl.constexpr,
        MIN_LEN: tl.constexpr,
    ):
        """One program = (sequence, query head, tile of BLOCK_M queries of the chunk); programs
        past their chunk's end, or of a chunk shorter than MIN_LEN, exit at once."""
        seq = tl.program_id(0)
        mt = tl.program_id(2)
        q_len = tl.load(qsl_ptr + seq + 1) - tl.load(qsl_ptr + seq)
        if (mt * BLOCK_M < q_len) & (q_len >= MIN_LEN):
            _prefill_program(
                seq, tl.program_id(1), mt,
                q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, qsl_ptr, past_ptr, out_ptr,
                stride_qt, stride_qh, stride_k_slot, stride_k_head, stride_v_slot,
                stride_v_head, stride_s_slot, stride_s_head, stride_bt, stride_ot,
                stride_oh, qk_scale, window, G, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N,
                BLOCK_SIZE, WINDOWED, KV_KIND, FP8_NATIVE, FOLD_SCALES, EXACT,
            )  # fmt: skip

    @triton.jit
    def _prefill_tiles_kernel(
        tile_seq_ptr,
        tile_mt_ptr,
        num_tiles_ptr,
        NUM_HEADS: tl.constexpr,
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        bt_ptr,
        qsl_ptr,
        past_ptr,
        out_ptr,
        stride_qt,
        stride_qh,
        stride_k_slot,
        stride_k_head,
        stride_v_slot,
        stride_v_head,
        stride_s_slot,
        stride_s_head,
        stride_bt,
        stride_ot,
        stride_oh,
        qk_scale,
        window,
        G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        WINDOWED: tl.constexpr,
        KV_KIND: tl.constexpr,
        FP8_NATIVE: tl.constexpr,
        FOLD_SCALES: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        """A fixed number of programs walking a list of (sequence, query tile) pairs read from
        the device: units ``u = tile * NUM_HEADS + head`` go to program ``u % programs``, so
        the grid depends on no step (a CUDA graph replays any list) and the heads of one tile
        (which share its kv heads' keys) run side by side."""
        units = tl.load(num_tiles_ptr) * NUM_HEADS
        for u in range(tl.program_id(0), units, tl.num_programs(0)):
            tile = u // NUM_HEADS
            _prefill_program(
                tl.load(tile_seq_ptr + tile), u % NUM_HEADS, tl.load(tile_mt_ptr + tile),
                q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, qsl_ptr, past_ptr, out_ptr,
                stride_qt, stride_qh, stride_k_slot, stride_k_head, stride_v_slot,
                stride_v_head, stride_s_slot, stride_s_head, stride_bt, stride_ot,
                stride_oh, qk_scale, window, G, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N,
                BLOCK_SIZE, WINDOWED, KV_KIND, FP8_NATIVE, FOLD_SCALES, EXACT,
            )  # fmt: skip


def _check_triton() -> None:
    if triton is None:
        raise RuntimeError("triton is not installed")


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write row ``t`` of ``k`` and ``v`` ``[T, Hkv, W]`` at slot ``slots[t]`` of ``k_cache`` and
    ``v_cache`` ``[num_slots, Hkv, W]``, in one launch; rows whose slot is negative (CUDA-graph
    padding) are skipped.

    ``k, v`` must have the caches' dtype (this is a copy, bit for bit: a one-byte cache's
    values and, with ``W = 1`` views ``[T, Hkv, 1]``, its scales are stored with the same call).
    Their last dim must be contiguous; rows and heads may be strided (views of a fused qkv).
    ``slots``: ``[T]`` int32 or int64.
    """
    _check_triton()
    t, hkv, w = k.shape
    assert v.shape == k.shape and slots.shape == (t,)
    assert slots.is_contiguous()  # (the kernel reads slots[t] at offset t)
    assert k_cache.shape[1:] == (hkv, w) and v_cache.shape == k_cache.shape
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, (
        "store_kv copies, dtypes must match"
    )
    assert w == 1 or all(x.stride(2) == 1 for x in (k, v, k_cache, v_cache))
    if t == 0:
        return
    kb, vb, kcb, vcb = (_bits(x) for x in (k, v, k_cache, v_cache))
    n = hkv * w
    _store_kv_kernel[(t,)](
        kb, vb, kcb, vcb, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        W=w, NUM_ELEMS=n, BLOCK=_next_pow2(n),
        num_warps=4 if n >= 512 else 1,
    )  # fmt: skip


def _decode_config(head_dim: int, dtype: torch.dtype, kv_kind: str | None) -> tuple[int, int, int]:
    """(BLOCK_N keys per tile, num_warps, num_stages) for the decode kernel.

    Measured on an H100 (bf16, 32 query heads on 8, head_dim 128; 64 rows x 2,048 keys and
    8 rows x 8,192 keys in 4 splits): 64 keys and 4 warps read a bf16 cache at ~2.9 TB/s;
    a one-byte cache goes best with 2 warps (~1.5 TB/s of bytes: its conversions bind).
    float32 (tests, rarely served) and head_dim 256 take half the keys.
    """
    if dtype == torch.float32:
        return (32 if head_dim <= 128 else 16), 4, 2
    if head_dim > 128:
        return 32, 4, 2
    return 64, (2 if kv_kind is not None else 4), 2


def _prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel.

    Measured on an H100 (bf16, 4 x 2,048-token prompts): 64 x 64 tiles with 4 warps up to
    head_dim 128 (~250 TFLOP/s at 128, causal, against ~520 for torch's flash SDPA on a
    contiguous cache; 128 x 128 with 8 warps within 5%); at 256, 128 x 64 with 8 warps
    (2.2x the 64 x 32 tiles). float32 (tests) takes small tiles.
    """
    if dtype == torch.float32:
        if head_dim <= 64:
            return 32, 32, 4, 2
        return (32, 16, 4, 2) if head_dim <= 128 else (16, 16, 4, 2)
    if head_dim <= 128:
        return 64, 64, 4, 2
    return 128, 64, 8, 2


def _fold_scales(dtype: torch.dtype) -> bool:
    """Whether a one-byte cache's scales multiply scores and softmax weights (one multiply per
    key) rather than every value: for bf16 queries (on an H100 7-25% faster decode than
    dequantizing each value). fp16 keeps per-value dequantization (a weight times a small
    scale could fall into fp16's subnormals) and float32 stays exact."""
    return dtype == torch.bfloat16


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    kv_kind: str | None = None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    row_ids: torch.Tensor | None = None,
    row_tables: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query row per entry over its paged context (flash-decoding).

    Args:
        q: ``[R, H, D]``; row r attends keys ``0 .. context_lens[r] - 1`` of the sequence whose
            table is ``block_tables[r]`` (``[R', max_blocks]`` int32, ``R' >= R``).
        context_lens: ``[R]`` int32; 0 marks a padding row, whose output is zeros.
        sliding_window: w: only keys ``p > len - 1 - w``.
        k_scales, v_scales, kv_kind: a one-byte cache (``"int8"`` / ``"fp8"``) and its bf16
            scales ``[num_slots, Hkv]``.
        num_splits: key-range parts attended by separate programs (more parallelism for few,
            long rows), combined by a second kernel; 1 writes the output directly.
        out: ``[R, H, D]`` in q's dtype (any row/head strides) to write into.
        workspace: split-K buffers from :func:`decode_workspace` (used when ``num_splits > 1``;
            allocated per call when missing).
        row_ids, row_tables: ``[E]`` int32 (contiguous, as ``context_lens`` is), a list of E
            entries instead of every row of q (a mixed step's decodes): entry e attends query
            row ``row_ids[e]`` with the table ``block_tables[row_tables[e]]`` (one per
            sequence) and context ``context_lens[e]`` (``[E]``), and writes that row of
            ``out``; an entry of context 0 writes nothing, nor does any row not in the list
            (the prefill kernel's). Entries name distinct rows.

    Grid ``(R, Hkv, num_splits)`` (R: the list's E entries with ``row_ids``); a program loads
    each K/V tile once for the G query heads of its kv head (padded to >= 16 rows for
    ``tl.dot``). Split-K over a row's key tiles, e.g.
    ``len = 300``, ``BLOCK_N = 64``, ``num_splits = 3``, no window::

        keys  0        64       128      192      256   300
              |  t0    |  t1    |  t2    |  t3    | t4  |..|   tiles = cdiv(300, 64) = 5
              '--- split 0 ---'  '--- split 1 ---' 'split 2'    per split = cdiv(5, 3) = 2
        key p -> slot = block_tables[r, p // block_size] * block_size + p % block_size

    With a window the tiles start at ``(len - w) // BLOCK_N`` (keys before it masked). Each
    split leaves ``acc = sum_p exp2(s_p - m) v_p``, ``m``, ``l = sum_p exp2(s_p - m)`` in the
    workspace (a split with no keys: 0, -inf, 0); the combine kernel (grid ``(R, H)``) scales
    each by ``exp2(m - max m)`` and divides the summed ``acc`` by the summed ``l``.

    Returns:
        ``[R, H, D]`` in q's dtype (``out`` when given).
    """
    _check_triton()
    r, h, d = q.shape
    _, hkv, dk = k_cache.shape
    assert dk == d and v_cache.shape == k_cache.shape and h % hkv == 0
    assert block_tables.stride(1) == 1 and q.stride(2) == 1
    rows = r  # query rows
    assert context_lens.is_contiguous()
    if row_ids is None:
        assert row_tables is None and context_lens.shape == (r,) and block_tables.shape[0] >= r
    else:
        assert row_tables is not None and row_ids.dtype == row_tables.dtype == torch.int32
        r = context_lens.shape[0]  # entries: the grid's rows
        assert row_ids.shape == row_tables.shape == (r,)
        assert row_ids.is_contiguous() and row_tables.is_contiguous()
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    kind = _kind_code(kv_kind, k_scales)
    if out is None:
        out = torch.empty(rows, h, d, dtype=q.dtype, device=q.device)
    assert out.shape == (rows, h, d) and out.stride(2) == 1
    if r == 0:
        return out
    ks, vs, s_slot, s_head = _scale_args(k_cache, k_scales, v_scales)
    g = h // hkv
    block_n, warps, stages = _decode_config(d, q.dtype, kv_kind)
    num_splits = max(1, int(num_splits))
    if num_splits > 1:
        if workspace is None:
            workspace = decode_workspace(r, h, d, num_splits, q.device)
        acc, stats = workspace
        assert acc.shape[0] >= r and acc.shape[1] == h and acc.shape[2] >= num_splits
        assert acc.shape[3] == d and acc.stride(3) == 1
        assert stats.shape[:3] == acc.shape[:3] and stats.stride(3) == 1
    else:
        acc, stats = out, out  # unused by the kernel
    d_pad = max(16, _next_pow2(d))
    ids = context_lens if row_ids is None else row_ids  # (unread without ROW_IDS)
    row_table = context_lens if row_tables is None else row_tables
    _decode_kernel[(r, hkv, num_splits)](
        q, k_cache, v_cache, ks, vs, block_tables, context_lens, ids, row_table, out, acc, stats,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        s_slot, s_head, block_tables.stride(0),
        out.stride(0), out.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        stats.stride(0), stats.stride(1), stats.stride(2),
        float(scale) * _LOG2E, int(sliding_window or 0),
        G=g, G_PAD=max(16, _next_pow2(g)), HEAD_DIM=d, D_PAD=d_pad,
        BLOCK_N=block_n, BLOCK_SIZE=int(block_size), NUM_SPLITS=num_splits,
        WINDOWED=sliding_window is not None, KV_KIND=kind,
        FP8_NATIVE=_fp8_native(q.device), FOLD_SCALES=_fold_scales(q.dtype),
        EXACT=q.dtype == torch.float32, ROW_IDS=row_ids is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_combine_kernel[(r, h)](
            acc, stats, out, ids, context_lens,
            acc.stride(0), acc.stride(1), acc.stride(2),
            stats.stride(0), stats.stride(1), stats.stride(2),
            out.stride(0), out.stride(1),
            HEAD_DIM=d, D_PAD=d_pad, NUM_SPLITS=num_splits, S_PAD=_next_pow2(num_splits),
            ROW_IDS=row_ids is not None, num_warps=1 if d_pad <= 128 else 2,
        )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed: torch.Tensor,
    max_query_len: int,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    kv_kind: str | None = None,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    min_query_len: int = 1,
) -> torch.Tensor:
    """Causal attention of every prefill / extend chunk of a step, in one launch.

    Args:
        q: ``[T, H, D]``; sequence s owns rows ``query_start_loc[s] .. query_start_loc[s+1]-1``
            (``query_start_loc``: ``[S + 1]`` int32).
        num_computed: ``[S]`` int32 tokens of s cached before this chunk: query i of s sits at
            position ``num_computed[s] + i`` and sees keys ``j <= `` that position (and, with a
            window w, ``j > position - w``). The chunk's own K/V must already be in the cache.
        block_tables: ``[S, max_blocks]`` int32.
        max_query_len: a Python int >= every chunk's length (sizes the grid; no host read).
        out: ``[T, H, D]`` in q's dtype to write into (rows outside every chunk untouched).
        config: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` instead of the engine's own
            (:func:`_prefill_config`): how ``infer bench gpu`` times other tiles.
        min_query_len: chunks shorter than this are skipped, their rows of ``out`` untouched
            (2: a mixed step's decodes, which :func:`paged_decode_attention` attends).

    Grid ``(S, H, cdiv(max_query_len, BLOCK_M))``; programs past their chunk's end exit at once.
    Each walks key tiles from its window's first (0 without a window) to its last query's
    position, every key's slot read through the block table, online softmax in float32.

    Returns:
        ``[T, H, D]`` in q's dtype (``out`` when given).
    """
    args, meta, out = _prefill_args(
        q, k_cache, v_cache, block_tables, query_start_loc, num_computed,
        block_size, scale, sliding_window, k_scales, v_scales, kv_kind, out, config,
    )  # fmt: skip
    num_seqs = num_computed.shape[0]
    if q.shape[0] == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    grid = (num_seqs, q.shape[1], math.ceil(max_query_len / meta["BLOCK_M"]))
    _prefill_kernel[grid](*args, **meta, MIN_LEN=int(min_query_len))
    return out


def prefill_block_m(head_dim: int, dtype: torch.dtype) -> int:
    """Queries per tile of the prefill kernels (the unit of a tile list,
    ``infer.runner.gpu.step.prefill_tiles``)."""
    return _prefill_config(head_dim, dtype)[0]


def paged_prefill_attention_tiles(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed: torch.Tensor,
    tile_seq: torch.Tensor,
    tile_index: torch.Tensor,
    num_tiles: torch.Tensor,
    num_programs: int,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    kv_kind: str | None = None,
    out: torch.Tensor | None = None,
    tile_size: int | None = None,
) -> torch.Tensor:
    """:func:`paged_prefill_attention` over a list of query tiles held on the device, by a
    fixed number of programs: what a CUDA graph of a mixed step (prompt chunks and decodes)
    replays, whatever the step's sequences and chunk lengths.

    ``tile_seq``, ``tile_index``: int32, the first ``num_tiles[0]`` entries the pairs of
    ``infer.runner.gpu.step.prefill_tiles`` (tiles of :func:`prefill_block_m` queries); ``num_programs`` a Python
    int (the grid). Each (tile, head) is computed by the same code as in
    :func:`paged_prefill_attention`, so both give the same numbers. ``query_start_loc``,
    ``num_computed`` and ``block_tables`` may hold more sequences than the tiles name.
    ``tile_size``: the queries per tile the list was made with, checked against the kernel's.
    Rows in no tile (a padded step's padding) are not written: with ``out=None`` they hold
    whatever the allocation held, which only ever reaches the padding rows' own outputs (every
    op after attention works row by row).
    """
    args, meta, out = _prefill_args(
        q, k_cache, v_cache, block_tables, query_start_loc, num_computed,
        block_size, scale, sliding_window, k_scales, v_scales, kv_kind, out,
    )  # fmt: skip
    assert tile_seq.shape == tile_index.shape and num_tiles.numel() == 1
    assert tile_seq.is_contiguous() and tile_index.is_contiguous()
    if tile_size is not None and tile_size != meta["BLOCK_M"]:
        raise ValueError(f"tiles of {tile_size} queries, but the kernel's are {meta['BLOCK_M']}")
    if q.shape[0] == 0 or num_programs <= 0:
        return out
    _prefill_tiles_kernel[(num_programs,)](
        tile_seq, tile_index, num_tiles, q.shape[1], *args, **meta
    )
    return out


def _prefill_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int | None,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    kv_kind: str | None,
    out: torch.Tensor | None,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[tuple, dict, torch.Tensor]:
    """The prefill kernels' common arguments (checked), their constants, and the output."""
    _check_triton()
    t, h, d = q.shape
    _, hkv, dk = k_cache.shape
    assert dk == d and v_cache.shape == k_cache.shape and h % hkv == 0
    num_seqs = num_computed.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] >= num_seqs
    assert query_start_loc.is_contiguous() and num_computed.is_contiguous()  # read by offset
    assert block_tables.stride(1) == 1 and q.stride(2) == 1
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    kind = _kind_code(kv_kind, k_scales)
    if out is None:
        out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    assert out.shape == (t, h, d) and out.stride(2) == 1
    ks, vs, s_slot, s_head = _scale_args(k_cache, k_scales, v_scales)
    block_m, block_n, warps, stages = config or _prefill_config(d, q.dtype)
    args = (
        q, k_cache, v_cache, ks, vs, block_tables, query_start_loc, num_computed, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        s_slot, s_head, block_tables.stride(0),
        out.stride(0), out.stride(1),
        float(scale) * _LOG2E, int(sliding_window or 0),
    )  # fmt: skip
    meta = dict(
        G=h // hkv, HEAD_DIM=d, D_PAD=max(16, _next_pow2(d)),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=int(block_size),
        WINDOWED=sliding_window is not None, KV_KIND=kind,
        FP8_NATIVE=_fp8_native(q.device), FOLD_SCALES=_fold_scales(q.dtype),
        EXACT=q.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return args, meta, out

"""Fused element-wise kernels for the GPU step (Triton): what torch runs as several kernels each.

At batch 1 a decode step's time is the weights' read plus, per kernel, a few microseconds of
launch and ramp even inside a CUDA graph; a Llama layer in torch ops is ~30 kernels, most of
them element-wise (the RMSNorm alone is nine). These make the layer's glue three kernels:

- ``add_rms_norm``: residual add + RMSNorm (the decoder carries each layer's output unadded);
- ``act_and_mul``: ``act(gate) * up`` over the fused gate/up projection (SiLU or tanh-GELU);
- ``rope_and_store``: q and k rotated in place in the fused qkv projection, k and v written to
  the KV cache at the step's slots (slot -1: a padding row, written nowhere).

Each rounds where torch's ops round (to the activation dtype after the add, after the
normalisation, after the activation, after ``x * cos``), so outputs stay within float32
summation-order differences of the torch path. ``INFER_TRITON_FUSED=0`` turns them off (the
torch ops run instead), to measure what they buy; ``INFER_TRITON_FUSED=compile`` keeps
``rope_and_store`` and has ``torch.compile`` fuse the norms and the activation instead
(:mod:`infer.runner.gpu.compiled_ops`), to measure the compiler against them.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None
    tl = None

FUSED_ENV = "INFER_TRITON_FUSED"
ACTIVATIONS = ("silu", "gelu_tanh")


def fused_enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernels take ``x``: a CUDA tensor, triton present, not switched off."""
    return x.is_cuda and triton is not None and os.environ.get(FUSED_ENV, "1") != "0"


def compiled_glue() -> bool:
    """``INFER_TRITON_FUSED=compile``: the norms and the activation by ``torch.compile``."""
    return os.environ.get(FUSED_ENV, "1") == "compile"


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,
        h_ptr,
        w_ptr,
        res_ptr,
        out_ptr,
        dim,
        eps,
        stride_x,
        stride_h,
        stride_r,
        stride_o,
        HAS_H: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < dim
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_H:
            h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + h.to(tl.float32)).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / dim
        y = (xf * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _act_and_mul_kernel(
        x_ptr,
        out_ptr,
        inter,
        stride_x,
        stride_o,
        GELU: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            tanh = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
            a = 0.5 * g * (1.0 + tanh)
        else:
            a = g / (1.0 + tl.exp(-g))
        a = a.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_and_store_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slots_ptr,
        stride_t,
        stride_cos,
        stride_slot,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
    ):
        """One program per token: rotate its q heads in place; rotate its k heads in place
        and store them with v in the cache.

        Each head is loaded, rotated and stored by the same loop iteration (a k head goes to
        the qkv row and to the cache from the same registers): nothing reads back a value
        another warp wrote, which would need a barrier (a k head's tile row differs between
        loops whenever the number of q heads is not a multiple of ``HEADS_PAD``)."""
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF_PAD)
        hd = tl.arange(0, HEADS_PAD)
        dmask = d < HALF
        cos_lo = tl.load(cos_ptr + t * stride_cos + d, mask=dmask, other=0.0).to(tl.float32)
        cos_hi = tl.load(cos_ptr + t * stride_cos + HALF + d, mask=dmask, other=0.0)
        sin_lo = tl.load(sin_ptr + t * stride_cos + d, mask=dmask, other=0.0).to(tl.float32)
        sin_hi = tl.load(sin_ptr + t * stride_cos + HALF + d, mask=dmask, other=0.0)
        cos_hi = cos_hi.to(tl.float32)
        sin_hi = sin_hi.to(tl.float32)
        head_dim = 2 * HALF
        row = qkv_ptr + t * stride_t
        dt = qkv_ptr.dtype.element_ty
        # x * cos rounded to the activation dtype first, then + swapped * sin (torch's addcmul)
        for start in range(0, NUM_HEADS, HEADS_PAD):
            heads = start + hd
            m = (heads < NUM_HEADS)[:, None] & dmask[None, :]
            p = row + heads[:, None] * head_dim + d[None, :]
            lo = tl.load(p, mask=m, other=0.0).to(tl.float32)
            hi = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
            new_lo = ((lo * cos_lo[None, :]).to(dt).to(tl.float32) + hi * sin_lo[None, :]).to(dt)
            new_hi = ((hi * cos_hi[None, :]).to(dt).to(tl.float32) + lo * sin_hi[None, :]).to(dt)
            tl.store(p, new_lo, mask=m)
            tl.store(p + HALF, new_hi, mask=m)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        for start in range(0, NUM_KV_HEADS, HEADS_PAD):
            heads = start + hd
            m = (heads < NUM_KV_HEADS)[:, None] & dmask[None, :]
            p = row + (NUM_HEADS + heads)[:, None] * head_dim + d[None, :]
            lo = tl.load(p, mask=m, other=0.0).to(tl.float32)
            hi = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
            k_lo = ((lo * cos_lo[None, :]).to(dt).to(tl.float32) + hi * sin_lo[None, :]).to(dt)
            k_hi = ((hi * cos_hi[None, :]).to(dt).to(tl.float32) + lo * sin_hi[None, :]).to(dt)
            tl.store(p, k_lo, mask=m)
            tl.store(p + HALF, k_hi, mask=m)
            if slot >= 0:
                dst = slot * stride_slot + heads[:, None] * head_dim + d[None, :]
                v_src = p + NUM_KV_HEADS * head_dim
                v_lo = tl.load(v_src, mask=m, other=0.0)
                v_hi = tl.load(v_src + HALF, mask=m, other=0.0)
                tl.store(k_cache_ptr + dst, k_lo, mask=m)
                tl.store(k_cache_ptr + dst + HALF, k_hi, mask=m)
                tl.store(v_cache_ptr + dst, v_lo, mask=m)
                tl.store(v_cache_ptr + dst + HALF, v_hi, mask=m)


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + h, rms_norm(x + h) * weight)`` for ``[T, dim]`` rows (``h`` None: ``(x, norm(x))``)."""
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    rows = x2.shape[0]
    out = torch.empty_like(x2)
    res = x2 if h is None else torch.empty_like(x2)
    h2 = x2 if h is None else h.reshape(-1, dim)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x2,
            h2,
            weight,
            res,
            out,
            dim,
            eps,
            x2.stride(0),
            h2.stride(0),
            res.stride(0),
            out.stride(0),
            HAS_H=h is not None,
            BLOCK=triton.next_power_of_2(dim),
            num_warps=4 if dim <= 4096 else 8,
        )
    return res.view(x.shape), out.view(x.shape)


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` of ``[T, 2 I]`` (gate first, then up) -> ``[T, I]``."""
    if act not in ACTIVATIONS:
        raise ValueError(f"no fused kernel for activation {act!r}")
    x = gate_up.reshape(-1, gate_up.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    block = 1024
    if x.shape[0]:
        _act_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
            x,
            out,
            inter,
            x.stride(0),
            out.stride(0),
            GELU=act == "gelu_tanh",
            BLOCK=block,
        )
    return out.view(*gate_up.shape[:-1], inter)


def rope_and_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Rotate q and k of ``qkv`` ``[T, (H + 2 Hkv) D]`` in place by ``cos, sin`` (``[T, D]``
    rows, the sign of "rotate half" in ``sin``) and write k, v to ``k_cache, v_cache``
    ``[slots, Hkv, D]`` at ``slots`` (``[T]``; negative: not stored)."""
    t = qkv.shape[0]
    cos = cos.reshape(t, -1)
    sin = sin.reshape(t, -1)
    assert cos.shape[1] == head_dim and qkv.stride(1) == 1 and cos.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if t == 0:
        return
    half = head_dim // 2
    _rope_and_store_kernel[(t,)](
        qkv,
        cos,
        sin,
        k_cache,
        v_cache,
        slots,
        qkv.stride(0),
        cos.stride(0),
        k_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HEADS_PAD=min(triton.next_power_of_2(num_heads + num_kv_heads), 16),
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4,
    )

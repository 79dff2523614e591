"""One-byte KV cache values: int8 or float8 (e4m3), with a bfloat16 scale per (token, kv head).

::

    scale  = absmax(row) / qmax, rounded *up* to bf16     (qmax: 127 for int8, 448 for e4m3)
    stored = round(row * (1 / scale))                     (int8: half to even; e4m3: its RNE)
    row   ~= stored * scale

A row is one head's ``head_dim`` values of one token, so a token's scale never changes after it
is written (append-only, like the cache itself) and the error of a value is at most half a step
of its own row's scale. Rounding the scale up keeps ``|row / scale| <= qmax``: no clipping, no
fp8 overflow. A bf16 scale costs 2 bytes per ``head_dim`` bytes (3.1% at head_dim 64), so a
one-byte cache holds ``2 / (1 + 2 / head_dim)`` times the tokens of a bf16 one: 1.94x at 64.

The C++ kernels (``csrc/fused.cpp`` stores, ``csrc/paged_attention.cpp`` reads) compute exactly
this; these torch functions are the reference and the path where the kernels are unavailable.
fp8 values are kept as raw bytes (``uint8``) holding ``float8_e4m3fn`` bits.
"""

from __future__ import annotations

import torch

from infer.kv_cache.sizing import KV_SCALE_BYTES

QMAX = {"int8": 127.0, "fp8": 448.0}
STORAGE_DTYPES = {"int8": torch.int8, "fp8": torch.uint8}
SCALE_DTYPE = torch.bfloat16
assert SCALE_DTYPE.itemsize == KV_SCALE_BYTES
KIND_CODES = {None: 0, "int8": 1, "fp8": 2}
"""What the C++ kernels call each storage kind."""


def round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> the smallest bf16 at or above it (as a bf16 tensor)."""
    bits = x.float().contiguous().view(torch.int32)
    bits = bits + ((bits & 0xFFFF) != 0).to(torch.int32) * 0x10000
    return (bits & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., head_dim]`` -> ``(values [..., head_dim], scales [...] bf16)``."""
    xf = x.float()
    scale = round_up_bf16(xf.abs().amax(-1) / QMAX[kind])
    sf = scale.float()
    inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
    y = xf * inv[..., None]
    if kind == "int8":
        values = torch.round(y).clamp(-127, 127).to(torch.int8)
    else:
        values = y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return values, scale


def dequantize(
    values: torch.Tensor, scales: torch.Tensor, kind: str, dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of :func:`quantize`, in ``dtype``."""
    v = values.view(torch.float8_e4m3fn).float() if kind == "fp8" else values.float()
    return (v * scales.float()[..., None]).to(dtype)

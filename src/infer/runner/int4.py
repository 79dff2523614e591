"""4-bit weights: ``--quantization int4 | w4a8`` at load, and GPTQ / AWQ checkpoints kept in 4 bits.

A weight ``[N, K]`` is cut along its inputs into groups of ``group_size`` (32, 64, 128; or the
whole row); each group of each output has a float16 scale and a zero (an integer; a float16
for GGUF's Q4_1 / Q4_K groups, :mod:`infer.model.gguf_checkpoint`), and each weight is a value
``q`` in 0..15::

    weight[n, k] = scale[n, k // group_size] * (q[n, k] - zero[n, k // group_size])

:func:`quantize_int4` makes them from a bf16 / float32 weight (asymmetric by default: the
group's range, widened to hold 0, split into 15 steps; or symmetric, zero 8 and
``scale = absmax / 7``). GPTQ and AWQ folders bring their own (:mod:`infer.model.quantized_checkpoint`
unpacks them), and GPTQ's act-order ``g_idx`` becomes an input permutation: the layer gathers
its inputs into group order before the product.

The C++ kernels (``csrc/linear_int4.cpp``) read the packed nibbles, half int8's bytes (decode
at small batch is bound by those bytes), and unpack them in registers:

- ``int4`` (GPTQ / AWQ folders too): activations as they are, bf16 (CPUs with AVX-512 BF16;
  on CPUs with AVX2 and FMA but not those, ``csrc/linear_int4_avx2.cpp`` widens them and the
  nibbles to float32); the products are the dequantized weight's, to float32 rounding.
- ``w4a8``: each activation row's groups quantized to int8 (absmax / 127 per group) and one
  exact integer dot product per group (CPUs with AVX-512 VNNI): fewer instructions per
  weight, for batches and prefill, at the cost of 8-bit activations. It also reads 5- and
  6-bit values (GGUF's Q5 types and Q6_K: ``bits``), held as the nibbles plus one or two bit
  planes, and GGUF's K-quant and Q6_K scales as the file holds them.

Elsewhere (CPUs without AVX2, CUDA) the weight is dequantized to the model's dtype for each
product: correct, not fast.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from infer.model.quantized_checkpoint import KQuantScales, Q6KScales
from infer.runner.cpu.kernels import int4_flags
from infer.runner.cpu.prepack import tiled_linear_kernels

logger = logging.getLogger("infer.runner")

INT4_GROUP_SIZE = 32
"""The default group of ``--quantization int4`` (held-out perplexity: docs/quantization.md)."""

_FP16_MIN_NORMAL = 2.0**-14


def quantize_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> ``(q uint8 [N, K] in 0..15, scales float16 [N, G], zeros uint8 [N, G])``
    with ``G = K / group_size`` (``group_size`` -1: one group per row). The scales are rounded
    to float16 before the weights are divided by them, so dequantizing gives exactly the values
    the kernel multiplies by."""
    n, k = weight.shape
    group = k if group_size == -1 else group_size
    if group <= 0 or k % group:
        raise ValueError(f"int4: {k} inputs do not split into groups of {group_size}")
    w = weight.detach().float().reshape(n, k // group, group)
    if symmetric:
        scale = w.abs().amax(dim=2) / 7.0
        zero = torch.full_like(scale, 8.0)
    else:
        lo = w.amin(dim=2).clamp(max=0.0)
        hi = w.amax(dim=2).clamp(min=0.0)
        scale = (hi - lo) / 15.0
    scale16 = scale.clamp(_FP16_MIN_NORMAL, 65504.0).to(torch.float16)
    s = scale16.float()
    if not symmetric:
        zero = torch.round(-lo / s).clamp(0, 15)
    q = (torch.round(w / s[..., None]) + zero[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), scale16, zero.to(torch.uint8)


def dequantize_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``scale * (q - zero)`` per group, ``[N, K]`` in ``dtype`` (exact in float32)."""
    n, k = q.shape
    groups = scales.shape[1]
    w = q.float().view(n, groups, k // groups) - zeros.float()[..., None]
    return (w * scales.float()[..., None]).view(n, k).to(dtype)


def pack_int4(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    int8_activations: bool = False,
    bits: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' layouts (``csrc/linear_int4.cpp``): q ``[N, K]`` (N % 16 == 0, K % 8 == 0)
    -> packed ``[N/16, K/8, 64 + 16 (bits - 4)]`` bytes (bits 4, 5 or 6); scales and zeros
    ``[N, G]`` -> ``[N/16, G, 16]``.

    ::

        64 bytes per (16 outputs, 8 inputs k = 8o .. 8o+7); output c's 4 bytes:
        int4  two 16-bit words h = 0, 1; nibble r of word h = q[n, 8o + 2r + h]
        w4a8  byte p = 4c + j (j = 0..3): low nibble q[n, 8o + j] & 15, high nibble
              q[n, 8o + 4 + j] & 15; with 5 or 6 bits (w4a8 only), then per bit e = 4, 5 two
              little-endian 64-bit masks: bit p = bit e of q[n, 8o + j], and of q[n, 8o + 4 + j]
    """
    n, k = q.shape
    g = scales.shape[1]
    if bits not in (4, 5, 6) or (bits > 4 and not int8_activations):
        raise ValueError(f"{bits}-bit weights: 4 bits, or 5 and 6 for the w4a8 kernel only")
    if int8_activations:
        val = q.view(n // 16, 16, k // 8, 2, 4).permute(0, 2, 3, 1, 4)  # nb, o, half, c, j
        nib = val & 15
        packed = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(n // 16, k // 8, 64)
        planes = []
        for e in range(bits - 4):
            bit = ((val >> (4 + e)) & 1).reshape(n // 16, k // 8, 2, 8, 8).to(torch.int64)
            masks = (bit << torch.arange(8)).sum(dim=-1).to(torch.uint8)  # bytes, little end
            planes.append(masks.reshape(n // 16, k // 8, 16))
        packed = torch.cat([packed, *planes], dim=2) if planes else packed
    else:
        nib = q.view(n // 16, 16, k // 8, 4, 2).permute(0, 2, 1, 4, 3)  # nb, o, c, h, r
        packed = torch.stack([nib[..., 0] | (nib[..., 1] << 4), nib[..., 2] | (nib[..., 3] << 4)],
                             dim=-1)  # fmt: skip
    return (
        packed.reshape(n // 16, k // 8, -1).contiguous(),
        scales.view(n // 16, 16, g).transpose(1, 2).contiguous(),
        zeros.view(n // 16, 16, g).transpose(1, 2).contiguous(),
    )


KQUANT_RECORD = 320
"""Bytes of one K-quant record (csrc/kernels.h ``INFER_INT4_KQUANT``): 16 outputs x 256 inputs."""


def _to_records(t: torch.Tensor, per_record: int) -> torch.Tensor:
    """``[N, R * per_record]`` (one value per output and group) -> ``[N/16, R, 16 per_record]``:
    each record's groups in order, each group's 16 outputs side by side."""
    n, cols = t.shape
    r = cols // per_record
    return t.view(n // 16, 16, r, per_record).permute(0, 2, 3, 1).reshape(n // 16, r, -1)


def _from_records(b: torch.Tensor, per_record: int) -> torch.Tensor:
    """:func:`_to_records` undone."""
    blocks, r = b.shape[:2]
    return b.reshape(blocks, r, per_record, 16).permute(0, 3, 1, 2).reshape(blocks * 16, -1)


def _halves_to_records(t: torch.Tensor) -> torch.Tensor:
    """``[N, R]`` float16 (one per output and record) -> ``[N/16, R, 32]`` bytes."""
    n, r = t.shape
    return t.view(n // 16, 16, r).transpose(1, 2).contiguous().view(torch.uint8)


def _halves_from_records(b: torch.Tensor) -> torch.Tensor:
    """:func:`_halves_to_records` undone."""
    blocks, r = b.shape[:2]
    return b.contiguous().view(torch.float16).transpose(1, 2).reshape(blocks * 16, r)


def pack_kquant(kquant: KQuantScales) -> torch.Tensor:
    """GGUF K-quant scales (``[N, G]`` sc and m, ``[N, G/8]`` d and dmin; N % 16 == 0) -> the
    w4a8 kernel's records ``[N/16, G/8, 320]`` bytes::

        sc[8][16] uint8 | m[8][16] uint8 | d[16] float16 | dmin[16] float16
        (group j of the super-block, output c of the 16)
    """
    parts = [_to_records(kquant.sc, 8), _to_records(kquant.m, 8),
             _halves_to_records(kquant.d), _halves_to_records(kquant.dmin)]  # fmt: skip
    return torch.cat(parts, dim=2).contiguous()


def unpack_kquant(records: torch.Tensor) -> KQuantScales:
    """:func:`pack_kquant`'s records back to the scales."""
    return KQuantScales(
        _from_records(records[..., :128], 8),
        _from_records(records[..., 128:256], 8),
        _halves_from_records(records[..., 256:288]),
        _halves_from_records(records[..., 288:]),
    )


def dequantize_kquant(q: torch.Tensor, kquant: KQuantScales, dtype: torch.dtype) -> torch.Tensor:
    """``d sc q - dmin m`` per group of 32, ``[N, K]`` in ``dtype`` (float32 arithmetic)."""
    n, k = q.shape
    d = kquant.d.float().repeat_interleave(8, dim=1)
    dmin = kquant.dmin.float().repeat_interleave(8, dim=1)
    scale, offset = d * kquant.sc.float(), dmin * kquant.m.float()
    w = q.float().view(n, k // 32, 32) * scale[..., None] - offset[..., None]
    return w.view(n, k).to(dtype)


Q6K_RECORD = 288
"""Bytes of one Q6_K record (csrc/kernels.h ``INFER_INT4_Q6K``): 16 outputs x 256 inputs."""

Q6K_ACTIVATION_GROUP = 256
"""The activations' int8 group for a Q6_K layer: a row's 256 inputs of one super-block share a
scale (llama.cpp's Q8_K blocks), so the sub-scales' integer sums need one float step per
256 inputs; groups of 32 (the 4-bit layers') ran 7-15% slower than int8 per channel at 16 and
256 rows, 256 ran 7% faster (the kernel takes any group dividing 256)."""


def pack_q6k(scales: Q6KScales) -> torch.Tensor:
    """GGUF Q6_K scales (``[N, K/16]`` int8 sc, ``[N, K/256]`` float16 d; N % 16 == 0) -> the
    w4a8 kernel's records ``[N/16, K/256, 288]`` bytes::

        sc[16][16] int8 (sub-group s of 16 inputs, output c) | d[16] float16 (output c)
    """
    sc = _to_records(scales.sc, 16).view(torch.uint8)
    return torch.cat([sc, _halves_to_records(scales.d)], dim=2).contiguous()


def unpack_q6k(records: torch.Tensor) -> Q6KScales:
    """:func:`pack_q6k`'s records back to the scales."""
    sc = records[..., :256].contiguous().view(torch.int8)
    return Q6KScales(_from_records(sc, 16), _halves_from_records(records[..., 256:]))


def dequantize_q6k(q: torch.Tensor, scales: Q6KScales, dtype: torch.dtype) -> torch.Tensor:
    """``d sc (q - 32)`` per 16 inputs, ``[N, K]`` in ``dtype`` (float32 arithmetic, as
    llama.cpp's: (d sc) first)."""
    n, k = q.shape
    scale = scales.d.float().repeat_interleave(16, dim=1) * scales.sc.float()
    w = (q.float().view(n, k // 16, 16) - 32.0) * scale[..., None]
    return w.view(n, k).to(dtype)


def unpack_int4(packed: torch.Tensor, int8_activations: bool = False) -> torch.Tensor:
    """:func:`pack_int4`'s packed bytes back to q ``[N, K]`` (its bit planes too)."""
    blocks, octets = packed.shape[:2]
    nibbles, planes = packed[..., :64], packed[..., 64:]
    lo, hi = nibbles & 15, nibbles >> 4
    if int8_activations:
        both = torch.stack([lo, hi], dim=-1).view(blocks, octets, 16, 4, 2)  # nb, o, c, j, half
        both = both.permute(0, 1, 4, 2, 3).reshape(blocks, octets, 2, 64)  # nb, o, half, p
        for e in range(planes.shape[-1] // 16):
            masks = planes[..., 16 * e : 16 * (e + 1)].reshape(blocks, octets, 2, 8, 1)
            bit = (masks >> torch.arange(8, dtype=torch.uint8)) & 1  # nb, o, half, byte, bit
            both = both | (bit.reshape(blocks, octets, 2, 64) << (4 + e))
        q = both.view(blocks, octets, 2, 16, 4).permute(0, 3, 1, 2, 4)  # nb, c, o, half, j
    else:
        b = torch.stack([lo, hi], dim=-1).view(
            blocks, octets, 16, 2, 2, 2
        )  # nb, o, c, h, byte, nib
        q = b.reshape(blocks, octets, 16, 2, 4).permute(0, 2, 1, 4, 3)  # nb, c, o, r, h
    return q.reshape(blocks * 16, octets * 8)


def w4a8_kernel_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    kquant: KQuantScales | Q6KScales | None = None,
    group: int | None = None,
) -> torch.Tensor:
    """What the w4a8 kernel computes, in float64: each row's groups quantized to int8 exactly as
    the kernel does it (float32 ``127 / absmax``, rounded to nearest even), integer dot products
    per group, then the scales (``kquant``: ``d sc`` times the product, less ``dmin m`` times
    the group's quantized sum; Q6_K: ``d sc`` times each 16 inputs' product with ``q - 32``,
    ``group`` the activations' group). For tests."""
    m, k = x.shape
    groups = scales.shape[1] if group is None else k // group
    group = k // groups
    xg = x.float().view(m, groups, group)
    absmax = xg.abs().amax(dim=2)
    inv = torch.where(absmax > 0, torch.tensor(127.0) / absmax, torch.zeros_like(absmax))
    xq = torch.round(xg * inv[..., None]).to(torch.int64)  # [m, G, group]
    x_scale = torch.where(absmax > 0, absmax / 127.0, torch.zeros_like(absmax)).double()
    if isinstance(kquant, Q6KScales):
        subs = k // 16
        xs = xq.view(m, subs, 16)
        w = (q.to(torch.int64) - 32).view(q.shape[0], subs, 16)
        sub_dots = torch.einsum("msk,nsk->mns", xs, w) * kquant.sc.to(torch.int64)[None]
        dots = sub_dots.view(m, q.shape[0], groups, group // 16).sum(dim=3).double()
        d = kquant.d.double().repeat_interleave(256 // group, dim=1)[None]  # per group
        return (dots * d * x_scale[:, None, :]).sum(dim=2)
    qg = q.to(torch.int64).view(q.shape[0], groups, group)  # [n, G, group]
    dots = torch.einsum("mgk,ngk->mng", xq, qg).double()
    xsum = xq.sum(dim=2).double()[:, None, :]
    if kquant is not None:
        d = kquant.d.double().repeat_interleave(8, dim=1)[None]
        dmin = kquant.dmin.double().repeat_interleave(8, dim=1)[None]
        terms = d * kquant.sc.double()[None] * dots - dmin * kquant.m.double()[None] * xsum
        return (terms * x_scale[:, None, :]).sum(dim=2)
    dots = dots - zeros.double()[None] * xsum  # uint8 or float16
    w_scale = scales.double()[None]  # [1, n, G]
    return (dots * w_scale * x_scale[:, None, :]).sum(dim=2)


def int4_kernel_available(device: torch.device, int8_activations: bool = False) -> bool:
    """4-bit products through the C++ kernel: a CPU with AVX-512 BF16, or AVX2 and FMA
    (``int8_activations``: AVX-512 VNNI)."""
    if device.type != "cpu":
        return False
    kernels = tiled_linear_kernels()
    if kernels is None:
        return False
    return kernels.has_w4a8 if int8_activations else kernels.has_int4


class Int4Linear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` held in 4 bits (module docstring); through the C++ kernel
    where the CPU has it (``int8_activations``: each activation row's groups in int8), else
    dequantized per call. ``bits`` 5 (GGUF's Q5 types: q in 0..31) or 6 (Q6_K: 0..63) is held
    as the nibbles plus one or two bit planes, for the w4a8 kernel (unpacked q elsewhere).
    ``kquant`` (GGUF's Q4_K / Q5_K, or Q6_K's :class:`Q6KScales`): the w4a8 kernel reads the
    file's own scales (:func:`pack_kquant`, :func:`pack_q6k`; ``scales`` and ``zeros`` are then
    not kept), elsewhere the float16 ``scales`` and ``zeros`` serve. 6-bit weights take the
    kernel with Q6_K's scales only."""

    def __init__(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        perm: torch.Tensor | None = None,
        int8_activations: bool = False,
        bits: int = 4,
        kquant: KQuantScales | Q6KScales | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scales.shape[1]
        self.dtype = dtype
        self.int8_activations = int8_activations
        self.bits = bits
        self.register_buffer("perm", perm, False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype), False)
        kernels = tiled_linear_kernels() if q.device.type == "cpu" else None
        q6k = isinstance(kquant, Q6KScales) and self.in_features % 256 == 0
        if (
            kernels is not None
            and (kernels.has_w4a8 if int8_activations else kernels.has_int4)
            and (bits == 4 or int8_activations)
            and (bits < 6 or q6k)
            and self.group_size % 16 == 0
            and dtype == torch.bfloat16  # a float32 model's activations stay float32
        ):
            self.mode = "kernel"
            self._kernels = kernels
            self.kquant = (
                isinstance(kquant, KQuantScales)
                and int8_activations
                and self.group_size == 32
                and self.in_features % 256 == 0
            )
            self.q6k = q6k
            if q6k:
                self.group_size = Q6K_ACTIVATION_GROUP  # (the kernel's group: the activations')
            self.kernel_flags = int4_flags(int8_activations, zeros.dtype, bits, self.kquant, q6k)
            # The kernel takes 16 outputs at a time: pad with zero rows, cut off after.
            self.padded = -self.out_features % 16

            def pad(t: torch.Tensor) -> torch.Tensor:
                return torch.cat([t, t.new_zeros(self.padded, *t.shape[1:])]) if self.padded else t

            q, scales, zeros = pad(q), pad(scales), pad(zeros)
            packed, s, z = pack_int4(q, scales, zeros, int8_activations, bits)
            if self.kquant:
                assert isinstance(kquant, KQuantScales)
                s = pack_kquant(KQuantScales(*(pad(t) for t in (kquant.sc, kquant.m, kquant.d,
                                                                 kquant.dmin))))  # fmt: skip
                z = torch.empty(0, dtype=torch.uint8)
            elif q6k:
                assert isinstance(kquant, Q6KScales)
                s = pack_q6k(Q6KScales(pad(kquant.sc), pad(kquant.d)))
                z = torch.empty(0, dtype=torch.uint8)
            self.register_buffer("packed", packed, False)
            self.register_buffer("scales", s, False)
            self.register_buffer("zeros", z, False)
            fbias = None if bias is None else bias.detach().float()
            if fbias is not None and self.padded:
                fbias = torch.cat([fbias, fbias.new_zeros(self.padded)])
            self.register_buffer("fbias", fbias, False)
            return
        self.mode = "dequant"
        self.kquant = self.q6k = False
        self.padded = 0
        packed = q if bits > 4 else q[:, 0::2] | (q[:, 1::2] << 4)  # wider: a byte each
        self.register_buffer("packed", packed.contiguous(), False)
        self.register_buffer("scales", scales.contiguous(), False)
        self.register_buffer("zeros", zeros.contiguous(), False)

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int = INT4_GROUP_SIZE,
        symmetric: bool = False,
        int8_activations: bool = False,
    ) -> Int4Linear:
        q, scales, zeros = quantize_int4(weight, group_size, symmetric)
        return cls(q, scales, zeros, bias, weight.dtype, int8_activations=int8_activations)

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel() + self.scales.nbytes + self.zeros.nbytes

    def dequantized_weight(self) -> torch.Tensor:
        """The ``[N, K]`` weight in the model's dtype, inputs in group order (after ``perm``)."""
        if self.mode == "kernel":
            n = self.out_features + self.padded
            q = unpack_int4(self.packed, self.int8_activations)
            if self.kquant:
                return dequantize_kquant(q, unpack_kquant(self.scales), self.dtype)[
                    : self.out_features
                ]
            if self.q6k:
                return dequantize_q6k(q, unpack_q6k(self.scales), self.dtype)[: self.out_features]
            g = self.scales.shape[1]
            scales = self.scales.transpose(1, 2).reshape(n, g)
            zeros = self.zeros.transpose(1, 2).reshape(n, g)
            return dequantize_int4(q, scales, zeros, self.dtype)[: self.out_features]
        q = self.packed
        if self.bits == 4:
            q = torch.stack([q & 15, q >> 4], dim=-1).view(self.out_features, -1)
        return dequantize_int4(q, self.scales, self.zeros, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        if self.mode == "kernel":
            out_dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
            y = self._kernels.int4_linear(
                flat.to(torch.bfloat16).contiguous(), self.packed, self.scales, self.zeros,
                self.fbias, self.out_features + self.padded, self.group_size, self.kernel_flags,
                out_dtype,
            )  # fmt: skip
            if self.padded:
                y = y[:, : self.out_features]
            y = y.to(x.dtype)
        else:
            y = F.linear(flat, self.dequantized_weight().to(x.dtype), self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


def keep_checkpoint_int4(
    model: nn.Module, int8_activations: bool = False, lm_head: bool = True
) -> list[Int4Linear]:
    """Swap each linear layer of a GPTQ / AWQ / GGUF model whose 4-bit integers the loader
    kept (``model.checkpoint_int4``, parameter name ->
    :class:`~infer.model.quantized_checkpoint.Int4Parts`) for an :class:`Int4Linear` over them,
    so its weight takes 4 bits, not the dequantized copy's 16 (``int8_activations``: the w4a8
    kernel). With ``lm_head``, a vocabulary projection kept so (a GGUF file's Q6_K
    ``token_embd``) becomes ``model.packed_logits`` where the kernel runs it (the embedding
    keeps its dequantized rows). Returns the layers made; the others stay dequantized."""
    parts_by_name = getattr(model, "checkpoint_int4", None) or {}
    vocab_weight = model.vocab_projection_weight()
    params = dict(model.named_parameters())
    made = []
    for pname, parts in parts_by_name.items():
        device = params[pname].device  # the loader's integers are on the CPU
        perm = None if parts.perm is None else parts.perm.to(device)
        build = functools.partial(Int4Linear, parts.q.to(device), parts.scales.to(device),
                                  parts.zeros.to(device), perm=perm,
                                  int8_activations=int8_activations, bits=parts.bits,
                                  kquant=parts.kquant)  # fmt: skip
        if params[pname] is vocab_weight:
            classifier = getattr(model, "classifier", None) is not None  # (projects no vocab)
            if lm_head and not classifier and parts.q.shape == vocab_weight.shape:
                head = build(None, vocab_weight.dtype)
                if head.mode == "kernel":  # (dequantized per product: slower than packed)
                    model.packed_logits = head
                    made.append(head)
            continue
        path = pname.removesuffix(".weight")
        module = model.get_submodule(path)
        if not isinstance(module, nn.Linear) or module.weight.shape != parts.q.shape:
            continue  # a reshaped one
        new = build(module.bias, module.weight.dtype)
        parent_name, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        made.append(new)
    return made

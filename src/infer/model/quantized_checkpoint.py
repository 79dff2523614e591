"""Pre-quantized checkpoints: GPTQ and AWQ folders, read as those formats define their tensors.

A quantized linear layer ``X`` is stored as ``X.qweight``, ``X.qzeros``, ``X.scales`` (and for
GPTQ ``X.g_idx``) instead of ``X.weight``; ``config.json``'s ``quantization_config`` says how.
4-bit values are packed eight to an int32, lowest nibble first, but the two formats pack along
different axes::

    GPTQ  qweight [in / 8, out]    nibble k of qweight[r, j] = q[8 r + k, j]      (input rows)
          qzeros  [groups, out / 8] nibble k of qzeros[g, c] = z[g, 8 c + k]      (output cols)
          scales  [groups, out]     g_idx [in]: the group of each input row (desc_act: any
                                    order; without it, i // group_size)
          "gptq" checkpoints (AutoGPTQ's format) store each zero minus one: z = stored + 1
          (so its zeros run 1..16, without wrapping); "gptq_v2" stores it as is. 8-bit GPTQ
          packs four bytes to an int32 the same way.
    AWQ   qweight [in, out / 8]     nibble k of qweight[i, c] = q[i, 8 c + ORDER[k]]  (output
          qzeros  [groups, out / 8] cols, interleaved: ORDER = 0 2 4 6 1 3 5 7)
          scales  [groups, out]     group of input row i: i // group_size

    weight[j, i] = scales[g(i), j] * (q[i, j] - z[g(i), j])

:func:`unpack` turns one layer into its integers (``[out, in]`` rows), :func:`layer_weight`
into its ``[out, in]`` float32 matrix, exactly (the products of small integers and a float16
scale are exact in float32), and :func:`checkpoint_int4_parts` into what a 4-bit linear layer
(``runner/int4.py``) holds, so 4-bit layers stay 4-bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

METHODS = ("gptq", "awq")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column of nibble k within a packed int32


class QuantizedCheckpointError(ValueError):
    """A quantized checkpoint infer cannot read; the message names the field or tensor."""


@dataclass(frozen=True)
class QuantizedFormat:
    """What ``quantization_config`` says about a GPTQ or AWQ checkpoint."""

    method: str  # "gptq" | "awq" | "gguf" (infer.model.gguf_checkpoint)
    bits: int
    group_size: int  # -1: one group over the whole input
    desc_act: bool = False
    zeros_minus_one: bool = False  # GPTQ's "gptq" checkpoint format


def read_format(config: dict[str, Any]) -> QuantizedFormat | None:
    """The quantized format of a ``config.json``, None for a plain checkpoint; raises
    :class:`QuantizedCheckpointError` naming the field for one infer cannot read."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizedCheckpointError("config.json: quantization_config must be an object")
    if qc.get("dynamic"):
        raise QuantizedCheckpointError(
            "config.json: quantization_config.dynamic (per-module bits or group sizes, as "
            "GPTQModel writes them) is not supported: every layer must share one format"
        )
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise QuantizedCheckpointError(
            f"config.json: quantization_config.quant_method {qc.get('quant_method')!r} is not "
            f"supported (infer reads {', '.join(METHODS)})"
        )
    bits = qc.get("bits", qc.get("w_bit"))
    allowed = (4, 8) if method == "gptq" else (4,)
    if bits not in allowed:
        raise QuantizedCheckpointError(
            f"config.json: quantization_config.bits is {bits!r}: infer reads "
            f"{' or '.join(map(str, allowed))}-bit {method}"
        )
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise QuantizedCheckpointError(
            f"config.json: quantization_config.group_size {group!r} must be a positive integer "
            "or -1"
        )
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizedCheckpointError(
                f"config.json: quantization_config.version {version!r}: infer reads AWQ's "
                "GEMM layout only"
            )
        if qc.get("zero_point", True) is False:
            raise QuantizedCheckpointError(
                "config.json: quantization_config.zero_point false (symmetric AWQ) is not supported"
            )
        return QuantizedFormat("awq", 4, group)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizedCheckpointError(
            f"config.json: quantization_config.checkpoint_format {fmt!r} is not supported "
            "(gptq, gptq_v2)"
        )
    return QuantizedFormat(
        "gptq", bits, group, desc_act=bool(qc.get("desc_act", False)), zeros_minus_one=fmt == "gptq"
    )


def _nibbles(packed: torch.Tensor, axis: int, bits: int = 4) -> torch.Tensor:
    """int32 ``packed`` -> its ``bits``-bit values (``32 / bits`` per int32 along ``axis``, 0:
    rows, 1: columns), lowest first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    if axis == 0:  # [r, j, k] -> rows 8 r + k
        return values.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return values.reshape(packed.shape[0], -1)


@dataclass(frozen=True)
class KQuantScales:
    """GGUF's K-quant scales as the file holds them (Q4_K, Q5_K): per group of 32 inputs and
    output a 6-bit scale ``sc`` and min ``m`` (uint8 ``[out, groups]``), per super-block of 256
    inputs a float16 ``d`` and ``dmin`` (``[out, groups / 8]``): weight = d sc q - dmin m."""

    sc: torch.Tensor
    m: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    def rows(self, index: torch.Tensor) -> KQuantScales:
        return KQuantScales(self.sc[index], self.m[index], self.d[index], self.dmin[index])

    @staticmethod
    def cat(parts: list[KQuantScales]) -> KQuantScales:
        """Parts stacked along the outputs (a fused q/k/v, gate/up)."""
        return KQuantScales(
            *(torch.cat([getattr(p, f) for p in parts]) for f in ("sc", "m", "d", "dmin"))
        )


@dataclass(frozen=True)
class Q6KScales:
    """GGUF's Q6_K scales as the file holds them: per 16 inputs and output an int8 ``sc``
    (``[out, in / 16]``), per super-block of 256 inputs a float16 ``d`` (``[out, in / 256]``):
    weight = d sc (q - 32), q 0..63."""

    sc: torch.Tensor
    d: torch.Tensor

    def rows(self, index: torch.Tensor) -> Q6KScales:
        return Q6KScales(self.sc[index], self.d[index])

    @staticmethod
    def cat(parts: list[Q6KScales]) -> Q6KScales:
        """Parts stacked along the outputs (a fused q/k/v, gate/up)."""
        return Q6KScales(torch.cat([p.sc for p in parts]), torch.cat([p.d for p in parts]))


@dataclass(frozen=True)
class UnpackedLayer:
    """One layer's integers as ``[out, in]`` rows: ``weight[j, i] = scales[j, g_idx[i]] *
    (q[j, i] - zeros[j, g_idx[i]])``."""

    q: torch.Tensor  # uint8 [out, in]
    zeros: torch.Tensor  # uint8 [out, groups]
    scales: torch.Tensor  # [out, groups], as stored (GPTQ and AWQ store float16)
    g_idx: torch.Tensor  # int64 [in]
    bits: int = 4  # q's width: 5 for GGUF's Q5 types, 6 for Q6_K
    # a K-quant's / Q6_K's own scales (the scales above: d sc, per 32 / 16 inputs)
    kquant: KQuantScales | Q6KScales | None = None


def unpack(
    fmt: QuantizedFormat,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
) -> UnpackedLayer:
    """One layer's packed tensors as integers (see the module doc); raises
    :class:`QuantizedCheckpointError` for tensors that do not describe one layer."""
    if fmt.method == "gptq":
        q = _nibbles(qweight, axis=0, bits=fmt.bits)  # [in, out]
        z = _nibbles(qzeros, axis=1, bits=fmt.bits)  # [groups, out]
        if fmt.zeros_minus_one:
            z = z + 1
    else:
        order = torch.tensor(_AWQ_ORDER)
        inverse = torch.argsort(order)  # column 8c + m sits in nibble inverse[m]

        def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
            values = _nibbles(packed, axis=1).view(packed.shape[0], -1, 8)
            return values[:, :, inverse].reshape(packed.shape[0], -1)

        q, z = unpack_columns(qweight), unpack_columns(qzeros)
    in_features, out_features = q.shape
    if scales.shape[1] != out_features or z.shape != scales.shape:
        raise QuantizedCheckpointError(
            f"qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
            f"{tuple(scales.shape)} do not describe one layer"
        )
    if g_idx is None:
        group = fmt.group_size if fmt.group_size > 0 else in_features
        g_idx = torch.arange(in_features) // group
    g = g_idx.long()
    if g.shape != (in_features,) or int(g.max()) >= scales.shape[0] or int(g.min()) < 0:
        raise QuantizedCheckpointError(
            f"g_idx {tuple(g_idx.shape)} does not map {in_features} input rows to "
            f"{scales.shape[0]} groups"
        )
    # 8-bit zeros reach 256 in the "gptq" format (stored 255, plus one): int16 holds them.
    small = torch.uint8 if fmt.bits == 4 else torch.int16
    return UnpackedLayer(q.t().to(small).contiguous(), z.t().to(small).contiguous(),
                         scales.t().contiguous(), g)  # fmt: skip


def layer_weight(layer: UnpackedLayer) -> torch.Tensor:
    """The ``[out, in]`` float32 weight of an unpacked layer (exact: small integers times a
    16-bit scale)."""
    g = layer.g_idx
    return layer.scales.float()[:, g] * (layer.q.float() - layer.zeros.float()[:, g])


@dataclass(frozen=True)
class Int4Parts:
    """A 4-bit layer as :class:`infer.runner.int4.Int4Linear` takes it: inputs in group order
    (``perm[i]``: the checkpoint's input at position i; None when they already are), ``q``
    ``[out, in]``, ``scales`` float16 and ``zeros`` ``[out, groups]``; ``bits`` 5 for GGUF's
    Q5 types, 6 for Q6_K; ``kquant``: a K-quant or Q6_K layer's own scales too (the w4a8
    kernel reads them)."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None
    bits: int = 4
    kquant: KQuantScales | Q6KScales | None = None


def checkpoint_int4_parts(
    fmt: QuantizedFormat, layers: list[UnpackedLayer], source: Any, tp: Any
) -> Int4Parts | None:
    """The 4-bit layer one parameter is made of (its checkpoint layers stacked along the
    outputs: fused q/k/v, gate/up), or None where it must stay dequantized: 8-bit, scales not
    float16, a transform, a tensor-parallel shard, parts with different act-order
    permutations, or groups of unequal size. GGUF parts of different types (a Q4_K q / k
    beside a Q5_K v) are joined at the widest part's bits (integer zeros as float16 where
    another part's are)."""
    if fmt.bits != 4 or source.transform is not None or (tp.size > 1 and source.shard):
        return None
    if any(layer.scales.dtype != torch.float16 for layer in layers):
        return None
    g_idx = layers[0].g_idx
    if any(not torch.equal(layer.g_idx, g_idx) for layer in layers[1:]):
        return None
    groups = layers[0].scales.shape[1]
    if len(g_idx) % groups or not torch.equal(
        torch.bincount(g_idx, minlength=groups), torch.full((groups,), len(g_idx) // groups)
    ):
        return None
    perm = torch.argsort(g_idx, stable=True)
    in_order = torch.equal(perm, torch.arange(len(g_idx)))
    q = torch.cat([layer.q for layer in layers])
    kinds: list[Any] = [layer.kquant for layer in layers]
    zero_dtype = functools.reduce(torch.promote_types, (layer.zeros.dtype for layer in layers))
    return Int4Parts(
        q if in_order else q[:, perm].contiguous(),
        torch.cat([layer.scales for layer in layers]),
        torch.cat([layer.zeros.to(zero_dtype) for layer in layers]),
        None if in_order else perm,
        max(layer.bits for layer in layers),
        type(kinds[0]).cat(kinds)
        if in_order and all(type(k) is type(kinds[0]) for k in kinds) and kinds[0] is not None
        else None,
    )

"""The weights of a GGUF file (llama.cpp's format), read as the loader asks for them.

The loader asks for Hugging Face tensor names (``model.layers.0.self_attn.q_proj.weight``);
llama.cpp's name map (the ``gguf`` package's, which llama.cpp maintains) gives the GGUF name
(``blk.0.attn_q.weight``). Each tensor is dequantized to float32 by the ``gguf`` package
(llama.cpp's reference code, in numpy) for every type it knows, then undone as llama.cpp's
converter stored it: a Llama's q / k rows are interleaved per head (un-permuted here), Gemma
3's norm weights are stored plus one.

4-bit types keep their integers too, so 4-bit layers stay 4-bit (:class:`UnpackedLayer`, as a
GPTQ layer does): per group of 32 inputs, ``weight = scale * (q - zero)`` with::

    Q4_0  (32 weights: d f16 | qs[16])              weight = d * (q - 8)      zero 8, exact
    Q4_1  (32 weights: d f16 | m f16 | qs[16])      weight = d * q + m        zero = -m / d
    Q4_K  (256 weights: d | dmin | scales[12] | qs[128], 8 groups of 32 with 6-bit sc, m)
                                                    weight = d sc q - dmin m  scale = d sc,
                                                                              zero = dmin m / scale
      qs[16] of Q4_0 / Q4_1: byte l holds q[l] (low nibble) and q[l + 16] (high nibble);
      qs[128] of Q4_K: 4 chunks of 32 bytes, chunk c's byte l holds q[64c + l] (low) and
      q[64c + 32 + l] (high); sc, m of group j (0..7) from scales[12]:
        j < 4:  sc = s[j] & 63,  m = s[j + 4] & 63
        j >= 4: sc = s[j + 4] & 15 | (s[j - 4] >> 6) << 4,  m = s[j + 4] >> 4 | (s[j] >> 6) << 4

The scale and a non-integer zero are held as float16 (the 4-bit kernel's format): each rounded
by at most 2^-12 of itself, so a weight moves by less than 2^-9 of its group's largest (a 32nd
of a 4-bit step); Q4_0's integer zero is exact. A float32
model keeps none (``keep_4bit`` False): every weight is then exactly llama.cpp's value.

With ``keep_wide`` (int8 activations: the w4a8 kernel reads bit planes above the nibbles) the
5-bit types keep their integers too (:func:`unpack_wide`: Q5_0, Q5_1, Q5_K in groups of 32),
and Q6_K (:func:`unpack_q6k`: 0..63 with its int8 scale per 16 inputs and float16 d per 256),
rather than being held in int8 per channel.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infer.model.folders import ModelLoadError
from infer.model.gguf_folder import FLOAT_TYPES, FOUR_BIT_TYPES, WIDE_TYPES
from infer.model.quantized_checkpoint import KQuantScales, Q6KScales, UnpackedLayer

GROUP = 32  # the inputs sharing a scale and zero in Q4_0, Q4_1 and Q4_K
# An expert's weight: llama.cpp stacks each layer's experts into one [experts, rows, cols]
# tensor (``blk.N.ffn_gate_exps``), named as ``LAYER.experts.PART`` without the index.
_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<index>\d+)\.(?P<part>[^.]+\.(weight|bias))$")


# A bert reranker's head (``cls``: dense, ``cls.output``: a row per label) under the names a
# BertForSequenceClassification's head is read by (model/bert.py classifier_tensors).
BERT_CLASSIFIER = {
    f"{hf}.{suffix}": f"{ours}.{suffix}"
    for hf, ours in (("pooler.dense", "cls"), ("classifier", "cls.output"))
    for suffix in ("weight", "bias")
}


# A modern-bert reranker's output projection (the gguf package maps "classifier" to cls, the
# head's dense: ModernBertForSequenceClassification's head.dense is cls too).
MODERN_BERT_CLASSIFIER = {f"classifier.{s}": f"cls.output.{s}" for s in ("weight", "bias")}


class GGUFCheckpoint:
    """Tensors of one GGUF file by Hugging Face name (memory-mapped; read on demand)."""

    def __init__(
        self, file: Path, num_heads: int, num_kv_heads: int, keep_4bit: bool, keep_wide: bool
    ) -> None:
        import gguf

        self.file = Path(file)
        try:
            self.reader = gguf.GGUFReader(self.file)
        except Exception as e:  # noqa: BLE001 - gguf raises ValueError, struct.error, ...
            raise ModelLoadError(f"cannot read GGUF file {file}: {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        field = self.reader.fields["general.architecture"]
        self.arch = str(field.contents())
        block_count = self.reader.fields[f"{self.arch}.block_count"].contents()
        arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.arch), None)
        if arch_id is None:
            raise ModelLoadError(
                f"{file}: the installed gguf package does not know architecture {self.arch!r} "
                "(upgrade it: pip install -U gguf)"
            )
        self.name_map = gguf.get_tensor_name_map(arch_id, int(block_count))
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.keep_4bit = keep_4bit
        self.keep_wide = keep_wide  # the 5- and 6-bit types' integers too (WIDE_TYPES)
        self.used: set[str] = set()

    def gguf_name(self, name: str) -> str | None:
        """The GGUF name of Hugging Face tensor ``name``, None when the file has no such tensor
        (an expert's: the tensor stacking every expert of its layer, :meth:`_expert`)."""
        if name == "score.weight":  # (a reranker's head; the gguf package's map lacks it)
            return "cls.output.weight" if "cls.output.weight" in self.tensors else None
        head = {"bert": BERT_CLASSIFIER, "modern-bert": MODERN_BERT_CLASSIFIER}.get(self.arch, {})
        if name in head:  # (model/gguf_bert.py)
            return head[name] if head[name] in self.tensors else None
        expert = _EXPERT.match(name)
        if expert is not None:
            name = f"{expert['layer']}.{expert['part']}"
        base, _, suffix = name.rpartition(".")
        mapped = self.name_map.get_name(base)
        full = None if mapped is None else f"{mapped}.{suffix}"
        return full if full in self.tensors else None

    def _data(self, name: str, tensor: Any) -> tuple[np.ndarray, tuple[int, ...]]:
        """The raw data of ``tensor`` for ``name`` and its shape (rows first): an expert's
        slice of its layer's stacked ``[experts, rows, cols]`` tensor, or the whole tensor."""
        shape = tuple(int(n) for n in reversed(tensor.shape))
        expert = _EXPERT.match(name)
        if expert is None:
            return tensor.data, shape
        index = int(expert["index"])
        if len(shape) != 3 or index >= shape[0]:
            raise ModelLoadError(
                f"{self.file}: {tensor.name} {shape} holds no expert {index} (for {name})"
            )
        return tensor.data[index], shape[1:]

    def read(self, name: str, pname: str) -> tuple[torch.Tensor, UnpackedLayer | None]:
        """Tensor ``name`` (for parameter ``pname``) as float32 (exactly what llama.cpp's
        dequantization gives), and its
        4-bit integers where its type has them and ``keep_4bit`` (None otherwise)."""
        from gguf import dequantize

        gname = self.gguf_name(name)
        if gname is None:
            raise ModelLoadError(
                f"tensor {name!r} (for {pname}) is missing from GGUF file {self.file}"
            )
        self.used.add(gname)
        tensor = self.tensors[gname]
        data, shape = self._data(name, tensor)
        try:
            values = dequantize(data, tensor.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(
                f"{self.file}: tensor {gname} is {tensor.tensor_type.name}, a type the gguf "
                "package cannot dequantize"
            ) from None
        weight = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
        if name.endswith("shared_expert_gate.weight") and weight.dim() == 1:
            weight = weight[None]  # Qwen2-MoE's [1, hidden] gate, stored as [hidden]
        layer = None
        kind = tensor.tensor_type.name
        if self.keep_4bit and kind in FOUR_BIT_TYPES and weight.dim() == 2:
            layer = unpack_4bit(np.asarray(data), kind, weight.shape)
        elif self.keep_wide and kind == "Q6_K" and weight.dim() == 2:
            layer = unpack_q6k(np.asarray(data), weight.numpy())
        elif self.keep_wide and kind in WIDE_TYPES and weight.dim() == 2:
            layer = unpack_wide(np.asarray(data), kind, weight.numpy())
        rows = self._row_order(name, weight.shape[0])
        if rows is not None:
            weight = weight[rows]
            if layer is not None:
                layer = dataclasses.replace(
                    layer,
                    q=layer.q[rows],
                    zeros=layer.zeros[rows],
                    scales=layer.scales[rows],
                    kquant=None if layer.kquant is None else layer.kquant.rows(rows),
                )
        if self.arch in ("gemma3", "gemma-embedding") and name.endswith("norm.weight"):
            weight = weight - 1.0  # stored as the (1 + w) Gemma's norms multiply by
        return weight, layer

    def has(self, name: str) -> bool:
        """Whether the file holds Hugging Face tensor ``name``."""
        return self.gguf_name(name) is not None

    def stored_quantized(self, name: str) -> bool:
        """Whether tensor ``name`` is stored in a quantized type (not F32 / F16 / BF16)."""
        gname = self.gguf_name(name)
        return gname is not None and self.tensors[gname].tensor_type.name not in FLOAT_TYPES

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """The stored row of each Hugging Face row of a Llama q / k projection (its weight and
        bias), which llama.cpp stores with each head's two rotary halves interleaved::

            HF row  h*D + i*D/2 + j   (head h, half i, j < D/2)
            GGUF    h*D + 2j + i
        """
        if self.arch != "llama" or not name.endswith(
            ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
        ):
            return None
        heads = self.num_heads if "q_proj" in name else self.num_kv_heads
        half = rows // heads // 2
        return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)

    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each GGML type the file holds, most first (``{"Q4_K": 97, ...}``)."""
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def close(self) -> None:
        """Drop the memory map (tensors already read are copies); the names stay for
        :meth:`unused`."""
        self.tensors = dict.fromkeys(self.tensors)
        self.reader = None

    def unused(self) -> list[str]:
        """The file's tensors no parameter took (rope_freqs is derived state, not a weight;
        EmbeddingGemma's Dense projections are read into its folder: model/gguf_embedding_gemma.py)."""
        taken = {"rope_freqs.weight", "dense_2.weight", "dense_3.weight"}
        return sorted(n for n in self.tensors if n not in self.used and n not in taken)


def unpack_4bit(data: np.ndarray, kind: str, shape: tuple[int, int]) -> UnpackedLayer | None:
    """One Q4_0 / Q4_1 / Q4_K tensor's raw blocks (``[rows, bytes]``) as integers, float16
    scales and zeros per group of 32 inputs (see the module doc); None when a group's zero
    overflows float16 (the layer is then held dequantized)."""
    rows, cols = shape
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1)
    if kind == "Q4_K":
        blocks = raw.reshape(rows, cols // 256, 144)
        d, dmin = _half(blocks, 0).astype(np.float32), _half(blocks, 2).astype(np.float32)
        sc, m = _k_scales_mins(blocks[..., 4:16])
        qs = blocks[..., 16:].reshape(rows, cols // 256, 4, 1, 32)
        q = np.concatenate([qs & 15, qs >> 4], axis=3)  # chunk c, half h = group 2c + h
        scale = d[..., None] * sc  # [rows, blocks, 8]
        offset = -(dmin[..., None] * m)
        layer = _half_zeros(q.reshape(rows, cols // GROUP, GROUP), scale, offset, 4)
        return _with_k_scales(layer, blocks, sc, m)
    else:
        size = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(rows, cols // GROUP, size)
        d = _half(blocks, 0).astype(np.float32)
        qs = blocks[..., size - 16 :].reshape(rows, cols // GROUP, 1, 16)
        q = np.concatenate([qs & 15, qs >> 4], axis=2)
        if kind == "Q4_0":
            q = torch.from_numpy(q.reshape(rows, cols).astype(np.uint8))
            scales = torch.from_numpy(d.astype(np.float16))
            zeros = torch.full(scales.shape, 8, dtype=torch.uint8)
            return UnpackedLayer(q, zeros, scales, torch.arange(cols) // GROUP)
        scale = d
        offset = _half(blocks, 2).astype(np.float32)
    return _half_zeros(q.reshape(rows, cols // GROUP, GROUP), scale, offset, 4)


def unpack_wide(data: np.ndarray, kind: str, values: np.ndarray) -> UnpackedLayer | None:
    """One Q5_0 / Q5_1 / Q5_K tensor (``WIDE_TYPES``) as integers 0..31 with float16 scales and
    zeros per group of 32, like :func:`unpack_4bit`. Only each group's scale and min are
    parsed from the blocks; the integers are recovered from ``values`` (the ``gguf`` package's
    dequantization, ``scale * q + offset`` in float32, so ``(value - offset) / scale`` rounds
    back to q exactly)::

        Q5_0  (32: d f16 | qh[4] | qs[16])                     d (q - 16)      zero 16, exact
        Q5_1  (32: d f16 | m f16 | qh[4] | qs[16])             d q + m         zero = -m / d
        Q5_K  (256: d | dmin | scales[12] | qh[32] | qs[128])  d sc q - dmin m (Q4_K's sc, m)

    None when a scale or zero float16 cannot hold (the layer is then held as before)."""
    bits, group = 5, GROUP
    rows, cols = values.shape
    block, size = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q5_K": (256, 176)}[kind]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // block, size)

    def half(at: int) -> np.ndarray:
        return _half(blocks, at).astype(np.float32)

    if kind == "Q5_0":
        scale = half(0)
    elif kind == "Q5_1":
        scale, offset = half(0), half(2)
    else:
        sc, m = _k_scales_mins(blocks[..., 4:16])
        scale = half(0)[..., None] * sc
        offset = -(half(2)[..., None] * m)
    scale = scale.reshape(rows, cols // group)
    grouped = values.reshape(rows, cols // group, group)
    if kind == "Q5_0":
        integer_zero = 16
        scale16 = scale.astype(np.float16)
        if not np.isfinite(scale16).all():
            return None
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(scale[..., None] == 0, integer_zero,
                         np.rint(grouped / scale[..., None]) + integer_zero)  # fmt: skip
        q = np.clip(q, 0, (1 << bits) - 1).astype(np.uint8).reshape(rows, cols)
        zeros = np.full(scale16.shape, integer_zero, dtype=np.uint8)
        return UnpackedLayer(torch.from_numpy(q), torch.from_numpy(zeros),
                             torch.from_numpy(scale16), torch.arange(cols) // group,
                             bits)  # fmt: skip
    offset = offset.reshape(rows, cols // group)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] == 0, 0,
                     np.rint((grouped - offset[..., None]) / scale[..., None]))  # fmt: skip
    q = np.clip(q, 0, (1 << bits) - 1).astype(np.uint8)
    layer = _half_zeros(q, scale, offset, bits)
    return _with_k_scales(layer, blocks, sc, m) if kind == "Q5_K" else layer


def unpack_q6k(data: np.ndarray, values: np.ndarray) -> UnpackedLayer | None:
    """One Q6_K tensor as integers 0..63 with its own scales (:class:`Q6KScales`) and, for
    wherever the kernel does not run, float16 scales ``d sc`` and zeros 32 per 16 inputs::

        Q6_K  (256: ql[128] | qh[64] | scales[16] int8 | d f16)    weight = d sc (q - 32)

    Only ``scales`` and ``d`` are parsed; the integers are recovered from ``values`` (the
    ``gguf`` package's dequantization, ``(d sc) (q - 32)`` in float32, so ``value / (d sc)``
    rounds back exactly; a sub-group whose ``d sc`` is 0 is all zeros: q 32). None when the
    recovered integers do not give ``values`` back, or ``d sc`` overflows float16."""
    rows, cols = values.shape
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // 256, 210)
    sc = blocks[..., 192:208].copy().view(np.int8)  # [rows, supers, 16]
    d = _half(blocks, 208)  # [rows, supers]
    scale = (d.astype(np.float32)[..., None] * sc.astype(np.float32)).reshape(rows, -1, 1)
    grouped = values.reshape(rows, cols // 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale == 0, 0.0, np.rint(grouped / scale))
    if q.min(initial=0) < -32 or q.max(initial=0) > 31 or not np.array_equal(scale * q, grouped):
        return None
    scale16 = scale[..., 0].astype(np.float16)
    if not np.isfinite(scale16).all():
        return None
    return UnpackedLayer(
        torch.from_numpy((q + 32).astype(np.uint8).reshape(rows, cols)),
        torch.full(scale16.shape, 32, dtype=torch.uint8),
        torch.from_numpy(scale16),
        torch.arange(cols) // 16,
        bits=6,
        kquant=Q6KScales(torch.from_numpy(sc.reshape(rows, -1).copy()), torch.from_numpy(d)),
    )


def _with_k_scales(layer: UnpackedLayer | None, blocks: np.ndarray, sc: np.ndarray,
                   m: np.ndarray) -> UnpackedLayer | None:  # fmt: skip
    """A Q4_K / Q5_K layer with its own scales beside (``[rows, super-blocks, bytes]`` blocks
    leading with d and dmin; ``sc``, ``m`` ``[rows, super-blocks, 8]``), which the w4a8 kernel
    reads as they are: 4.625 / 5.625 bits a weight, against 5 / 6 with a float16 scale and
    zero per group."""
    if layer is None:
        return None
    rows = blocks.shape[0]
    scales = KQuantScales(torch.from_numpy(sc.reshape(rows, -1).astype(np.uint8)),
                          torch.from_numpy(m.reshape(rows, -1).astype(np.uint8)),
                          torch.from_numpy(_half(blocks, 0)), torch.from_numpy(_half(blocks, 2)))  # fmt: skip
    return dataclasses.replace(layer, kquant=scales)


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte ``at`` of each block (``[..., bytes]`` uint8)."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0]


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's 8 six-bit scales and mins from its 12 bytes (module doc)."""
    s = s.astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def _half_zeros(q: np.ndarray, scale: np.ndarray, offset: np.ndarray,
                bits: int) -> UnpackedLayer | None:  # fmt: skip
    """``weight = scale * q + offset`` per group (q ``[rows, groups, group]``) as a float16
    scale and float16 zero, or None where they cannot hold."""
    rows, groups, group = q.shape
    cols = groups * group
    scale = scale.reshape(rows, -1)
    offset = offset.reshape(rows, -1)
    # weight = scale * q + offset = scale16 * (q - zero): zero = -offset / scale16. A group
    # whose scale is 0 is the constant offset: q 0, scale -offset, zero 1.
    scale16 = scale.astype(np.float16)
    flat = scale16 == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(flat, 1.0, -offset / scale16.astype(np.float32))
    scale16 = np.where(flat, (-offset).astype(np.float16), scale16)
    zero = np.where(flat & (offset == 0), 0.0, zero)
    if not (np.isfinite(zero.astype(np.float16)).all() and np.isfinite(scale16).all()):
        return None  # a zero float16 cannot hold (a tiny scale beside a large min)
    q = np.where(flat[..., None], 0, q).reshape(rows, cols)
    return UnpackedLayer(
        torch.from_numpy(q.astype(np.uint8)),
        torch.from_numpy(zero.astype(np.float16)),
        torch.from_numpy(scale16),
        torch.arange(cols) // group,
        bits,
    )

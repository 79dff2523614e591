"""Weight quantization at load time: ``--quantization int8 | w8a8 | fp8``.

Every linear layer (and the vocabulary projection, unless ``--no-quantize-lm-head``; the
embedding table stays in the model's dtype) is replaced by a quantized one, from the
checkpoint's own bf16 / fp32 weights: no pre-quantized checkpoint is needed.

- ``int8``: weight-only, symmetric, one float32 scale per output channel
  (``scale = absmax(row) / 127``, ``q = round(w / scale)``). Activations stay in the model's
  dtype. On CPUs with AMX, or AVX-512 BF16 with VBMI (AMD Zen 4/5), the C++ kernel reads the
  int8 tiles and widens them to bf16 in cache or registers, so decode streams half the bytes of
  bf16; elsewhere torch's ``_weight_int8pack_mm`` (bf16) or a dequantize-then-matmul reference.
- ``w8a8``: the same int8 weights, and each activation row quantized to int8 when the layer
  runs (symmetric, absmax / 127): the C++ kernel multiplies bytes by bytes with AVX-512 VNNI
  (VPDPBUSD, 64 multiply-adds an instruction, twice bf16's), so it helps where the multiplies
  bind (batches of sequences, prefill), not only where the weights' bytes do. CPUs with
  AVX-512 VNNI only; anything else is refused at start-up.
- ``int4``: 4-bit weights in groups of 32 inputs, a float16 scale and a zero per group
  (:mod:`infer.runner.int4`), activations in the model's dtype: the C++ kernel unpacks the
  nibbles to bf16 (CPUs with AVX-512 BF16) or float32 (AVX2 + FMA: Intel's desktop cores, AMD
  Zen 2/3) in registers; elsewhere the weight is dequantized per product. ``w4a8``: the same
  weights and each activation row's groups quantized to int8,
  multiplied byte by nibble with VNNI (CPUs with AVX-512 VNNI only). For both, the vocabulary
  projection is quantized to int8 instead (4 bits there costs the most accuracy for the fewest
  bytes), unless ``--no-quantize-lm-head`` keeps it in the model's dtype.
- ``fp8``: e4m3 weights with a float32 scale per output channel, and each activation row
  quantized to e4m3 on the fly, multiplied by ``torch._scaled_mm`` (a CUDA GPU with fp8 matmuls,
  compute capability 8.9 or newer; anything else is refused at start-up).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from infer.config import QUANTIZATIONS
from infer.runner.cpu.prepack import (
    count_kinds,
    prepack_linears,
    replace_linears,
    tiled_linear_kernels,
)
from infer.runner.int4 import INT4_GROUP_SIZE, Int4Linear, int4_kernel_available

logger = logging.getLogger("infer.runner")

FP8_MAX = 448.0


def _row_absmax(weight: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each output row's largest magnitude. A row-parallel shard (tensor parallelism) holds part
    of each row: the loader keeps the whole row's (``full_row_absmax``), so every rank count
    gives one scale per output channel, the same as one rank's."""
    full = getattr(weight, "full_row_absmax", None)
    return w.abs().amax(dim=1) if full is None else full.to(w.device)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> ``(q int8 [N, K], scale float32 [N])`` with ``weight ~= q * scale[:, None]``."""
    w = weight.detach().float()
    absmax = _row_absmax(weight, w)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> ``(q float8_e4m3fn [N, K], scale float32 [N])``; never NaN or inf."""
    w = weight.detach().float()
    absmax = _row_absmax(weight, w)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def fp8_matmul_available(device: torch.device) -> bool:
    """fp8 weight matmuls: CUDA with compute capability 8.9+ (Ada, Hopper and later)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def int8_kernel_available(device: torch.device) -> bool:
    """int8 weights through the C++ tiled kernel: a CPU with AMX, or AVX-512 BF16 and VBMI.
    Elsewhere ``Int8Linear`` runs torch's ``_weight_int8pack_mm``: on a 2-core Zen 2 (AVX2) a
    2048 x 8192 layer took as long as the bf16 kernel at one row and twice as long at 16, so
    int8 there saves memory, not time."""
    if device.type != "cpu":
        return False
    kernels = tiled_linear_kernels()
    return kernels is not None and kernels.linear_int8


def gguf_int8_default(is_encoder: bool, device: torch.device) -> bool:
    """``--gguf-int8`` unset: a GGUF decoder's layers of types the 4-bit kernel does not take
    are held in int8 where the int8 kernel runs (:func:`int8_kernel_available`: half the bytes
    to read); an encoder's, and any elsewhere, are dequantized (int8 is no faster there)."""
    return not is_encoder and int8_kernel_available(device)


def w8a8_available(device: torch.device) -> bool:
    """int8 x int8 linears: the CPU kernel, built with AVX-512 VNNI."""
    if device.type != "cpu":
        return False
    kernels = tiled_linear_kernels()
    return kernels is not None and kernels.has_w8a8


def check_quantization(method: str | None, device: torch.device) -> None:
    """A clear start-up error for an unknown method, w8a8 without its CPU kernel, or fp8 on a
    device without fp8 matmuls."""
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise ValueError(
            f"--quantization {method!r} is not supported (choices: {', '.join(QUANTIZATIONS)})"
        )
    if method == "w8a8" and not w8a8_available(device):
        raise ValueError(
            f"--quantization w8a8 needs a CPU with AVX-512 VNNI and the C++ kernels (a g++); "
            f"this engine runs on {device}: use --quantization int8"
        )
    if method == "w4a8" and not int4_kernel_available(device, int8_activations=True):
        raise ValueError(
            f"--quantization w4a8 needs a CPU with AVX-512 VNNI and the C++ kernels (a g++); "
            f"this engine runs on {device}: use --quantization int4"
        )
    if method == "fp8" and not fp8_matmul_available(device):
        raise ValueError(
            f"--quantization fp8 needs a CUDA GPU with fp8 matmuls (compute capability 8.9 or "
            f"newer); this engine runs on {device}: use --quantization int8"
        )


class Int8Linear(nn.Module):
    """``y = x @ (q * scale)^T + b``: int8 weights, activations in the model's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype
        q, scale = quantize_int8(weight)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), False)
        self._kernels = tiled_linear_kernels() if weight.device.type == "cpu" else None
        if (
            self._kernels is not None
            and self.dtype == torch.bfloat16
            and self._kernels.tiled_linear_supports(q)
        ):
            self.mode = "tiled"
            self.register_buffer("q", self._kernels.tile_pack(q), False)
            self.register_buffer("scale", scale.contiguous(), False)
            fbias = None if bias is None else bias.detach().float().contiguous()
            self.register_buffer("fbias", fbias, False)
            return
        self.register_buffer("q", q, False)
        self.register_buffer("scale", scale, False)
        self.mode = "dequant"
        if self.dtype == torch.bfloat16 and hasattr(torch, "_weight_int8pack_mm"):
            self.register_buffer("scale_model_dtype", scale.to(self.dtype), False)
            if self._int8pack_agrees():
                self.mode = "int8pack"

    @property
    def weight_bytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def _int8pack_agrees(self) -> bool:
        """torch's kernel has shape and device constraints of its own: probe it once."""
        x = torch.randn(2, self.in_features, dtype=self.dtype, device=self.q.device)
        try:
            got = torch._weight_int8pack_mm(x, self.q, self.scale_model_dtype).float()
        except RuntimeError:
            return False
        want = F.linear(x, dequantize(self.q, self.scale, self.dtype)).float()
        return torch.allclose(got, want, atol=5e-2, rtol=5e-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.mode == "tiled":
            assert self._kernels is not None
            y = self._kernels.tiled_linear(
                flat.contiguous(), self.q, self.fbias, self.out_features, scales=self.scale
            )
        elif self.mode == "int8pack":
            y = torch._weight_int8pack_mm(flat.contiguous(), self.q, self.scale_model_dtype)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(flat, dequantize(self.q, self.scale, x.dtype), self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class W8A8Linear(nn.Module):
    """``y = (xq @ q^T) * x_scale * scale + b``: int8 weights (a scale per output channel) and
    each row of x quantized to int8 (a scale per row) as the layer runs, through the VNNI kernel.
    Output in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        kernels = tiled_linear_kernels()
        assert kernels is not None and kernels.has_w8a8, "check_quantization refuses this"
        assert self.in_features % 16 == 0, "make_w8a8_linear keeps such layers"
        self._kernels = kernels
        q, scale = quantize_int8(weight)
        # The kernel takes 16 outputs at a time: a vocabulary of 32,001 gets 15 zero rows,
        # whose outputs are cut off.
        self.padded = -self.out_features % 16
        if self.padded:
            q = torch.cat([q, q.new_zeros(self.padded, self.in_features)])
            scale = torch.cat([scale, scale.new_ones(self.padded)])
            if bias is not None:
                bias = torch.cat([bias, bias.new_zeros(self.padded)])
        packed, colsum = kernels.w8a8_pack(q)
        self.register_buffer("packed", packed, False)
        self.register_buffer("colsum", colsum, False)
        self.register_buffer("scale", scale.contiguous(), False)
        fbias = None if bias is None else bias.detach().float().contiguous()
        self.register_buffer("fbias", fbias, False)

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel() + self.scale.numel() * 4 + self.colsum.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        out_dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
        y = self._kernels.w8a8_linear(
            flat.to(torch.bfloat16).contiguous(), self.packed, self.colsum, self.scale,
            self.fbias, self.out_features + self.padded, out_dtype,
        )  # fmt: skip
        if self.padded:
            y = y[:, : self.out_features]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def make_w8a8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> W8A8Linear | None:
    """A ``W8A8Linear``, or None (the layer stays as it is) for an input width the kernel does
    not take (not a multiple of 16)."""
    if weight.shape[1] % 16:
        logger.warning("w8a8: a %s weight stays unquantized (in features %% 16 != 0)",
                       tuple(weight.shape))  # fmt: skip
        return None
    return W8A8Linear(weight, bias)


class Fp8Linear(nn.Module):
    """``y = x @ (q * scale)^T + b`` with e4m3 weights and per-row e4m3 activations, through
    ``torch._scaled_mm`` (CUDA, compute capability 8.9+)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        q, scale = quantize_fp8(weight)
        self.register_buffer("q", q, False)
        self.register_buffer("scale", scale, False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), False)

    @property
    def weight_bytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    scaled_mm_failed = False  # set (once, for every layer) if this GPU refuses row-wise scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cuda" and not Fp8Linear.scaled_mm_failed:
            row_max = flat.abs().amax(dim=1, keepdim=True).float()
            x_scale = torch.where(row_max > 0, row_max / FP8_MAX, torch.ones_like(row_max))
            xq = (flat.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            try:
                y = torch._scaled_mm(
                    xq,
                    self.q.t(),
                    scale_a=x_scale,
                    scale_b=self.scale[None, :],
                    bias=self.bias,
                    out_dtype=x.dtype,
                )
                return y.view(*x.shape[:-1], self.out_features)
            except RuntimeError as e:
                Fp8Linear.scaled_mm_failed = True
                logger.warning("fp8 matmul with row-wise scales failed (%s); dequantizing", e)
        # The reference math: tests on CPU, and GPUs whose _scaled_mm refuses row-wise scales.
        y = F.linear(flat, dequantize(self.q, self.scale, x.dtype), self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def make_int4_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, int8_activations: bool = False
) -> Int4Linear | None:
    """An ``Int4Linear`` (group size ``INFER_INT4_GROUP_SIZE``, default 32; asymmetric unless
    ``INFER_INT4_SYMMETRIC=1``: the knobs ``infer bench quant`` measures), or None (the layer
    stays as it is) for an input width the groups do not divide."""
    group = int(os.environ.get("INFER_INT4_GROUP_SIZE", INT4_GROUP_SIZE))
    if group != -1 and weight.shape[1] % group:
        logger.warning("int4: a %s weight stays unquantized (in features %% %d != 0)",
                       tuple(weight.shape), group)  # fmt: skip
        return None
    symmetric = os.environ.get("INFER_INT4_SYMMETRIC", "0") == "1"
    return Int4Linear.from_weight(weight, bias, group, symmetric, int8_activations)


def make_w4a8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Int4Linear | None:
    return make_int4_linear(weight, bias, int8_activations=True)


QUANTIZED_LINEARS = {
    "int8": Int8Linear,
    "w8a8": make_w8a8_linear,
    "fp8": Fp8Linear,
    "int4": make_int4_linear,
    "w4a8": make_w4a8_linear,
}
# What each method makes of the vocabulary projection, where not the same as its layers'.
VOCAB_LINEARS = {"int4": Int8Linear, "w4a8": Int8Linear}


@torch.inference_mode()
def quantize_checkpoint_layers(model: nn.Module, lm_head: bool = True) -> list[nn.Module]:
    """Hold in int8 (per output channel) each ``nn.Linear`` the checkpoint stored quantized in a
    type no kernel here reads (``model.checkpoint_quantized``: a GGUF file's Q6_K, Q5_K,
    Q8_0, ... layers), and with ``lm_head`` the vocabulary projection if it was, rather than
    dequantized in the model's dtype: a batch-1 decode reads their bytes, half of bf16's. The
    other layers are left as they are. Returns the modules made."""
    names = getattr(model, "checkpoint_quantized", None) or set()
    ids = {id(p) for name, p in model.named_parameters() if name in names}

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        return Int8Linear(weight, bias) if id(weight) in ids else None

    vocab = lm_head and getattr(model, "packed_logits", None) is None  # (kept as stored)
    made = replace_linears(model, make, vocab=vocab)
    logger.info("held %d linear weights the checkpoint stores quantized in int8", len(made))
    return made


@torch.inference_mode()
def quantize_linears(model: nn.Module, method: str, lm_head: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model`` (and, with ``lm_head``, its vocabulary
    projection, as ``model.packed_logits``) by a ``method``-quantized one; without it the
    vocabulary projection stays in the model's dtype (pre-packed where a CPU kernel takes it).
    Returns how many were quantized."""
    made = replace_linears(model, QUANTIZED_LINEARS[method], vocab=False)
    if lm_head:
        made += replace_linears(model, VOCAB_LINEARS.get(method, QUANTIZED_LINEARS[method]),
                                layers=False)  # fmt: skip
    if getattr(model, "packed_logits", None) is None:
        # Kept in the model's dtype, by choice or because the method refused its shape.
        prepack_linears(model, layers=False)
    logger.info(
        "quantized %d linear weights to %s (%s)",
        len(made),
        method,
        count_kinds(made, lambda m: getattr(m, "mode", method)),
    )
    return len(made)

"""Linear weights laid out once, at load, for the CPU's fastest bfloat16 matmul.

``F.linear`` on a bfloat16 CPU tensor re-lays out the weight for oneDNN's blocked kernels on every
call. Two replacements for ``nn.Linear`` (and for the vocabulary projection) avoid that:

- :class:`TiledLinear` (CPUs with AMX, AVX-512 BF16 or AVX2, where the C++ kernels build): the
  weight in AMX's tile layout, multiplied by :func:`infer.runner.cpu.kernels.CpuKernels.tiled_linear`
  (AMX tiles, else ``VDPBF16PS`` on the same layout, else float32 FMAs on weights widened in
  registers), which streams each weight from memory once per call. Decode is bound by reading
  weights: measured on a 2-core Sapphire Rapids VM, the ~110M Llama's 49 projections take 8.1 ms
  at 1 row and 13.2 ms at 64 rows, against 10.3 and 16.0 ms with oneDNN's packed weights (a
  2-core Zen 5 VM without AMX: 0.02 vs 0.04 ms for the 768 x 2304 qkv at 1 row, 1.9 vs 5.8 ms at
  512 rows; a 2-core Zen 3 VM, AVX2 only, where oneDNN packs no bf16 and ``F.linear`` takes
  torch's slow bf16 path: the whole model at 16 rows 28 vs 195 ms). A row's result does not
  depend on the other rows of the batch, so a token gets the same bits whatever it is batched
  with.
- :class:`PackedLinear` (elsewhere, where oneDNN packs bf16: AVX-512 or AVX-NE-CONVERT): the
  weight pre-packed for oneDNN (``torch.ops.mkldnn``, what
  inductor uses for the same purpose): about half the time of ``F.linear``'s per-call reorder at
  decode sizes, the same kernel's results bit for bit.

Neither applies to float32 models, other devices, or when ``INFER_PREPACK_WEIGHTS=0`` is set;
``INFER_TILED_LINEAR=0`` keeps oneDNN where the tiled kernel would be used.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cache

import torch
from torch import nn

from infer.runner.cpu.kernels import CpuKernels, cpu_kernels

logger = logging.getLogger("infer.runner")


class PackedLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` pre-packed for oneDNN; input ``[..., in_features]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().clone(), persistent=False
        )

    @property
    def weight_bytes(self) -> int:
        return self.in_features * self.out_features * self.packed_weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(
            flat, self.packed_weight, self.bias, "none", [None], ""
        )
        return y.view(*x.shape[:-1], self.out_features)


class TiledLinear(nn.Module):
    """``y = x @ W^T + b`` by the tiled kernel (AMX, else AVX-512 BF16, else AVX2); ``W`` in its tile
    layout, ``b`` kept in float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: CpuKernels):
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self._kernels = kernels
        self.register_buffer("packed_weight", kernels.tile_pack(weight), persistent=False)
        fbias = None if bias is None else bias.detach().float().contiguous()
        self.register_buffer("bias", fbias, persistent=False)

    @property
    def weight_bytes(self) -> int:
        return self.packed_weight.numel() * self.packed_weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        if flat.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        y = self._kernels.tiled_linear(flat, self.packed_weight, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as they are held: parameters plus packed or quantized
    copies (modules with a ``weight_bytes`` of their own; rope tables are not counted)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        total += getattr(module, "weight_bytes", 0)
    return total


def _usable(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    return os.environ.get("INFER_PREPACK_WEIGHTS", "1") != "0"


@cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU (it refuses without AVX-512 or
    AVX-NE-CONVERT, e.g. on AMD Zen 3)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), None)
    except RuntimeError as exc:
        logger.info("no oneDNN bfloat16 weight packing on this CPU: %s", str(exc).splitlines()[0])
        return False
    return True


def tiled_linear_kernels() -> CpuKernels | None:
    if os.environ.get("INFER_TILED_LINEAR", "1") == "0":
        return None
    kernels = cpu_kernels()
    return kernels if kernels is not None and kernels.linear_kind >= 1 else None


def _candidates(weight: torch.Tensor, bias: torch.Tensor | None) -> list:
    """Packed modules to try for this weight, fastest first (each built on demand)."""
    out = []
    kernels = tiled_linear_kernels()
    if kernels is not None and kernels.tiled_linear_supports(weight):
        out.append(lambda: TiledLinear(weight, bias, kernels))
    if onednn_bf16_available():
        out.append(lambda: PackedLinear(weight, bias))
    return out


def _agrees(packed: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A probe per kind of module: it must give what ``F.linear`` gives (to bf16 rounding)."""
    x = torch.randn(3, weight.shape[1], dtype=weight.dtype)
    want = torch.nn.functional.linear(x, weight, bias).float()
    return torch.allclose(packed(x).float(), want, atol=1e-2, rtol=1e-2)


def replace_linears(
    model: nn.Module,
    make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module | None],
    layers: bool = True,
    vocab: bool = True,
) -> list[nn.Module]:
    """Swap every ``nn.Linear`` of ``model`` for ``make(weight, bias)`` (``layers``) and set
    ``model.packed_logits = make(vocabulary projection weight, None)`` (``vocab``); ``make``
    returning None keeps that layer as it is. Returns the modules made.

    The vocabulary projection is read through ``project_to_vocab``, never called as a module, so
    an untied ``lm_head`` is left in place and only its replacement is used. A sequence
    classifier projects nothing onto the vocabulary: no copy is made for it."""
    vocab_fn = getattr(model, "vocab_projection_weight", None)
    vocab_weight = vocab_fn() if callable(vocab_fn) else None
    if getattr(model, "classifier", None) is not None:
        vocab = False
    linears = [
        (name, m)
        for name, m in model.named_modules()
        if layers and isinstance(m, nn.Linear) and m.weight is not vocab_weight
    ]
    made = []
    for name, module in linears:
        new = make(module.weight, module.bias)
        if new is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
        made.append(new)
    if vocab and vocab_weight is not None:
        new = make(vocab_weight, None)
        if new is not None:
            model.packed_logits = new
            made.append(new)
    return made


def count_kinds(modules: list[nn.Module], kind=lambda m: type(m).__name__) -> str:
    """``"40 TiledLinear, 9 PackedLinear"``: a log line's summary of what was made."""
    counts: dict[str, int] = {}
    for m in modules:
        counts[kind(m)] = counts.get(kind(m), 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


@torch.inference_mode()
def prepack_linears(model: nn.Module, layers: bool = True) -> int:
    """Swap every bfloat16 CPU ``nn.Linear`` of ``model`` for an :class:`TiledLinear` or a
    :class:`PackedLinear` (unless ``layers`` is False), and pack the vocabulary projection
    (``model.packed_logits``) unless something already holds it. Returns how many weights
    were packed."""
    checked: dict[type, bool] = {}  # module type -> its probe agreed with F.linear

    def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        if not _usable(weight):
            return None
        for make in _candidates(weight, bias):
            packed = make()
            kind = type(packed)
            if kind not in checked:
                checked[kind] = _agrees(packed, weight, bias)
                if not checked[kind]:
                    logger.warning("%s disagrees with F.linear; not using it", kind.__name__)
            if checked[kind]:
                return packed
        return None

    vocab = getattr(model, "packed_logits", None) is None
    made = replace_linears(model, pack, layers=layers, vocab=vocab)
    if made:
        logger.info("packed %d linear weights (%s)", len(made), count_kinds(made))
    return len(made)

"""Reading a PEFT LoRA adapter folder and checking it against the base model.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` with, per targeted projection,
``...layers.{i}.self_attn.q_proj.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight``
(``[out, r]``). The projection's output becomes ``W x + scale * B (A x)`` with ``scale =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA; per-module ``rank_pattern`` /
``alpha_pattern`` entries override ``r`` and ``lora_alpha`` for the modules they match).

Which projections an adapter touches is read from its tensors (PEFT's ``target_modules`` rules,
names, regexes or ``all-linear``, decided that when it saved them). What infer cannot serve is
refused here with the reason: DoRA, LoRA biases, ``modules_to_save``, embedding or vocabulary
projection adapters, a rank above ``--max-lora-rank``, shapes that do not fit the base model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.model.folders import ModelLoadError, read_json

# PEFT's projection names -> (our fused module under layers.{i}, the part index within it).
PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("attn.qkv_proj", 0),
    "k_proj": ("attn.qkv_proj", 1),
    "v_proj": ("attn.qkv_proj", 2),
    "o_proj": ("attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
    r"(?P<proj>\w+))\.lora_(?P<ab>A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the reason."""


@dataclass(frozen=True)
class LoRAModule:
    """One projection's low-rank pair, float32: ``a [r, in]``, ``b [out, r]``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter read from disk: ``modules[(layer, peft projection name)]``."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    modules: dict[tuple[int, str], LoRAModule]

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() + m.b.numel() for m in self.modules.values()) * 4


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rule: a pattern applies to a module whose name ends with it (after a dot)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _read_config(name: str, folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} is not a folder")
    if not path.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} has no adapter_config.json")
    try:
        config = read_json(path, what="adapter config")
    except ModelLoadError as e:
        raise LoRAError(f"LoRA adapter {name!r}: {e}") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    refusals = [
        (peft_type != "LORA", f"peft_type {peft_type!r} (only LORA is supported)"),
        (bool(config.get("use_dora")), "use_dora (DoRA adapters are not supported)"),
        (config.get("bias", "none") != "none", f"bias={config.get('bias')!r} (only 'none')"),
        (bool(config.get("modules_to_save")),
         f"modules_to_save={config.get('modules_to_save')!r} (fully trained modules are not "
         "supported)"),
        (bool(config.get("layer_replication")), "layer_replication (not supported)"),
    ]  # fmt: skip
    for refused, why in refusals:
        if refused:
            raise LoRAError(f"LoRA adapter {name!r}: {why}")
    if not config.get("r") or not config.get("lora_alpha"):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json needs r and lora_alpha")
    return config


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    st, pt = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if not st.is_file() and not pt.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} has no adapter_model.safetensors")
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(st)
        return torch.load(pt, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as e:  # a damaged file: safetensors' and pickle's errors are many kinds
        # (torch's own message is advice to the file's owner about weights_only, not ours)
        why = f"{type(e).__name__}: {e}" if st.is_file() else type(e).__name__
        raise LoRAError(
            f"LoRA adapter {name!r}: {st if st.is_file() else pt} cannot be read ({why})"
        ) from None


def load_adapter(
    name: str,
    path: str | Path,
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
    max_rank: int,
) -> LoRAAdapter:
    """Read and check the adapter at ``path``.

    ``shapes``: PEFT projection name -> ``(out, in)`` of the base model's projection (one
    tensor-parallel rank holds the whole model: LoRA runs without tensor parallelism).
    Raises :class:`LoRAError` naming the problem.
    """
    folder = Path(path).expanduser()
    config = _read_config(name, folder)
    tensors = _read_tensors(name, folder)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    keys: dict[tuple[int, str], str] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m["proj"] not in PROJECTIONS:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {key!r} adapts a module infer does not serve "
                f"adapters for (supported: {', '.join(PROJECTIONS)} of the decoder layers)"
            )
        layer = int(m["layer"])
        if layer >= num_layers:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}; the base model "
                f"has {num_layers} layers (an adapter for another base model?)"
            )
        pairs.setdefault((layer, m["proj"]), {})[m["ab"]] = tensor
        keys[(layer, m["proj"])] = m["module"]
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: no LoRA tensors in {folder}")
    alpha, rslora = float(config["lora_alpha"]), bool(config.get("use_rslora", False))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    modules: dict[tuple[int, str], LoRAModule] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        where = f"layer {layer} {proj}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAError(f"LoRA adapter {name!r}: {where} has no {missing} tensor")
        a, b = ab["A"].float(), ab["B"].float()
        out, inp = shapes[proj]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or b.shape != (out, r):
            raise LoRAError(
                f"LoRA adapter {name!r}: {where} has lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)}; the base model's {proj} needs [r, {inp}] and [{out}, r] "
                "(an adapter for another base model?)"
            )
        if r > max_rank:
            raise LoRAError(
                f"LoRA adapter {name!r}: rank {r} ({where}) is above --max-lora-rank {max_rank}"
            )
        module_key = keys[(layer, proj)]
        r_cfg = _pattern_value(rank_pattern, module_key, config["r"])
        if int(r_cfg) != r:
            raise LoRAError(
                f"LoRA adapter {name!r}: {where} has rank {r} but adapter_config.json says {r_cfg}"
            )
        a_m = float(_pattern_value(alpha_pattern, module_key, alpha))
        scale = a_m / math.sqrt(r) if rslora else a_m / r
        modules[(layer, proj)] = LoRAModule(a.contiguous(), b.contiguous(), scale)
    return LoRAAdapter(name, str(folder), max(m.rank for m in modules.values()), modules)

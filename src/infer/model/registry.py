"""Which :class:`CausalLM` class serves a checkpoint, by ``architectures`` or ``model_type``."""

from __future__ import annotations

from typing import Any

from infer.model.gemma3 import Gemma3ForCausalLM
from infer.model.gpt2 import GPT2LMHeadModel
from infer.model.layers import CausalLM
from infer.model.llama import LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM
from infer.model.qwen import (
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

ARCHITECTURES: dict[str, type[CausalLM]] = {
    cls.architecture: cls
    for cls in (
        LlamaForCausalLM,
        MistralForCausalLM,
        MixtralForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
        Qwen2MoeForCausalLM,
        Qwen3MoeForCausalLM,
        Gemma3ForCausalLM,
        GPT2LMHeadModel,
    )
}

MODEL_TYPES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no implementation here."""


def model_class(config: dict[str, Any]) -> tuple[str, type[CausalLM]]:
    """``(architecture name, class)`` for a ``config.json`` dict.

    ``architectures`` decides when present; ``model_type`` is the fallback for configs that
    omit it (NanoGPT exports often do).
    """
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch, ARCHITECTURES[arch]
    model_type = config.get("model_type")
    if not archs and model_type in MODEL_TYPES:
        cls = MODEL_TYPES[model_type]
        return cls.architecture, cls
    named = ", ".join(archs) if archs else f"model_type {model_type!r}"
    raise UnsupportedArchitectureError(
        f"unsupported architecture {named}; supported: {', '.join(ARCHITECTURES)}"
    )

"""Model layer: our own torch modules for Llama, Qwen 2/3, Gemma 3 (text) and GPT-2, loaded
from safetensors checkpoints (local folders or the local Hugging Face cache).

The names below are imported on first use, so importing one module of the package (the
folder lookup, the tokenizer) does not import the torch modules of the rest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infer.model.folders import ModelLoadError, find_model_folder
    from infer.model.layers import CausalLM
    from infer.model.loader import load_model, load_model_spec
    from infer.model.registry import ARCHITECTURES
    from infer.model.spec import ModelSpec
    from infer.model.tokenizer import load_tokenizer

_WHERE = {
    "ARCHITECTURES": "infer.model.registry",
    "CausalLM": "infer.model.layers",
    "ModelLoadError": "infer.model.folders",
    "ModelSpec": "infer.model.spec",
    "find_model_folder": "infer.model.folders",
    "load_model": "infer.model.loader",
    "load_model_spec": "infer.model.loader",
    "load_tokenizer": "infer.model.tokenizer",
}

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "ModelLoadError",
    "ModelSpec",
    "find_model_folder",
    "load_model",
    "load_model_spec",
    "load_tokenizer",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'infer.model' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

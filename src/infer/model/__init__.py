"""Model layer: our own torch modules for Llama, Qwen 2/3, Gemma 3 (text) and GPT-2, loaded
from safetensors checkpoints (local folders or the local Hugging Face cache)."""

from infer.model.layers import CausalLM
from infer.model.loader import (
    ModelLoadError,
    find_model_folder,
    load_model,
    load_model_spec,
)
from infer.model.registry import ARCHITECTURES
from infer.model.spec import ModelSpec
from infer.model.tokenizer import load_tokenizer

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

"""The ``Dense`` projections a sentence-transformers model applies to its pooled vector
(:class:`infer.model.pooling.DenseLayer`: LaBSE's 768 -> 768 tanh, stella's 1536 -> 1024),
read from each module's folder and run in float32 on the pooled rows, before the
normalization."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from infer.model.folders import ModelLoadError
from infer.model.pooling import DenseLayer

_ACTIVATIONS = {"tanh": torch.tanh, "identity": lambda x: x, "relu": F.relu, "gelu": F.gelu,
                "sigmoid": torch.sigmoid, "silu": F.silu}  # fmt: skip


def _state(layer: DenseLayer) -> dict[str, torch.Tensor]:
    """A Dense module's tensors as ``linear.weight`` / ``linear.bias``: from its ``file``, else
    ``model.safetensors``, else ``pytorch_model.bin`` (a ColBERT checkpoint's own file holds
    its model too: only these are read from a safetensors one)."""
    path, prefix = layer.path, layer.prefix
    if layer.file is not None:
        state = torch.load(path / layer.file, map_location="cpu", weights_only=True)
        return {f"linear.{k[len(prefix) :]}": v for k, v in state.items() if k.startswith(prefix)}
    if (path / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k.startswith("linear.")}  # noqa: SIM118
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{path}: a Dense module without model.safetensors or "
                         "pytorch_model.bin")  # fmt: skip


class EmbeddingProjection:
    """The pooled rows ``[N, hidden]`` (float32) through each Dense layer in turn."""

    def __init__(
        self, layers: Sequence[DenseLayer], hidden_size: int, device: torch.device | str
    ) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor | None, str]] = []
        width = hidden_size
        for layer in layers:
            if layer.in_features != width:
                raise ModelLoadError(f"{layer.path}: a Dense module taking {layer.in_features} "
                                     f"values after the model's {width}")  # fmt: skip
            state = _state(layer)
            weight = state.get("linear.weight")
            if weight is None or tuple(weight.shape) != (layer.out_features, layer.in_features):
                raise ModelLoadError(f"{layer.path}: linear.weight is not "
                                     f"[{layer.out_features}, {layer.in_features}]")  # fmt: skip
            bias = state.get("linear.bias") if layer.bias else None
            if layer.bias and (bias is None or tuple(bias.shape) != (layer.out_features,)):
                raise ModelLoadError(f"{layer.path}: linear.bias is not [{layer.out_features}]")
            self.layers.append((weight.float().to(device),
                                None if bias is None else bias.float().to(device),
                                layer.activation))  # fmt: skip
            width = layer.out_features

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        for weight, bias, act in self.layers:
            pooled = _ACTIVATIONS[act](F.linear(pooled, weight, bias))
        return pooled

"""The KV memory formula, in one place (the engine, ``infer plan`` and the model spec use it)."""

from __future__ import annotations


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of KV cache one token costs: ``2 (K and V) x layers x kv_heads x head_dim x bytes``."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes

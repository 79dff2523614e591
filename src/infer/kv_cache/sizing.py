"""The KV memory formula, in one place (the engine, ``infer plan`` and the model spec use it)."""

from __future__ import annotations

KV_SCALE_BYTES = 2
"""A one-byte (int8 / fp8) cache keeps a bf16 scale per token and kv head."""

QUANTIZED_KV_DTYPES = ("int8", "fp8")
KV_CACHE_DTYPES = ("auto", *QUANTIZED_KV_DTYPES)
"""``--kv-cache-dtype`` choices: ``auto`` stores the model's dtype."""


def check_kv_cache_dtype(name: str) -> str | None:
    """``--kv-cache-dtype`` -> the one-byte storage kind (None for ``auto``); a ``ValueError``
    naming the option and its choices otherwise."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {name!r} is not supported (choices: {', '.join(KV_CACHE_DTYPES)})"
        )
    return None if name == "auto" else name


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, scale_bytes: int = 0
) -> int:
    """Bytes of KV cache one token costs:
    ``2 (K and V) x layers x kv_heads x (head_dim x bytes + scale bytes per row)``."""
    return 2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)


def kv_value_bytes(kv_dtype: str, model_dtype_bytes: int) -> tuple[int, int]:
    """``(bytes per value, scale bytes per row)`` of a cache: ``auto`` stores the model dtype."""
    if kv_dtype in QUANTIZED_KV_DTYPES:
        return 1, KV_SCALE_BYTES
    return model_dtype_bytes, 0

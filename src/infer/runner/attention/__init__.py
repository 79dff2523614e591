"""Attention over the paged KV cache: the cache (``cache.py``), a step's metadata
(``context.py``) and the backends that compute it, one per file behind ``backend.py``'s
interface (``torch_ref.py``, ``cpu.py``, ``null.py``)."""

from infer.core.messages import SequenceSlice
from infer.runner.attention.backend import AttentionBackend, default_backend
from infer.runner.attention.cache import KVCache
from infer.runner.attention.context import AttentionContext, dense_context, split_qkv

__all__ = [
    "AttentionBackend",
    "AttentionContext",
    "KVCache",
    "SequenceSlice",
    "default_backend",
    "dense_context",
    "split_qkv",
]

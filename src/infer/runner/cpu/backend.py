"""The CPU's device backend (see :mod:`infer.runner.backend`)."""

from __future__ import annotations

import ctypes
import os

import torch

from infer.runner.backend import DeviceBackend

DEFAULT_CPU_KV_BYTES = 2 << 30
"""The KV budget on a CPU when none is given (the cap of the default sizing)."""

MALLOC_ENV = "INFER_MALLOC_TUNING"
"""Set to 0 to leave glibc's malloc settings alone (see :func:`keep_freed_memory`)."""


def keep_freed_memory() -> bool:
    """Have glibc serve allocations up to 32 MiB from its heap and keep freed memory there.

    A forward pass allocates its activations anew for every layer; above glibc's (adaptive)
    mmap threshold each one is a fresh mapping whose pages the kernel faults in and zeroes on
    first touch. Measured on a 2048-token prefill step of the ~110M Llama: 520-630 ms -> 380 ms
    (the act(gate) * up kernel alone: ~10 ms -> 1.8 ms per layer). The cost is that the process
    keeps up to its peak of temporaries (a few hundred MiB) instead of returning it. Returns
    whether the settings were applied (False off glibc or with ``INFER_MALLOC_TUNING=0``).
    """
    if os.environ.get(MALLOC_ENV, "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


class CpuBackend(DeviceBackend):
    """The CPU: C++ kernels (AVX-512, AMX where there is one), pre-packed weights, huge pages,
    and the fused decode step (``runner/cpu/decode_fast.py``)."""

    def _prepare(self) -> None:
        keep_freed_memory()

    def resolve_dtype(self, name: str, checkpoint_dtype: str | None) -> torch.dtype:
        dtype = super().resolve_dtype(name, checkpoint_dtype)
        if name == "auto" and dtype == torch.float16:
            return torch.bfloat16  # fp16 matmuls are slow on CPU; bf16 keeps the range
        return dtype

    def kv_budget(self, wanted: int, utilization: float, reserve: int = 0) -> int:
        # NOTE: by default enough for every sequence slot at full length, capped at 2 GiB.
        return min(wanted, DEFAULT_CPU_KV_BYTES)

"""Which step a runner takes on a device, asked before anything of the GPU step is imported:
the Triton step (``cuda_step.py``) on CUDA where triton runs, else the CPU's or torch's path.
Triton itself is imported only when the answer may be the Triton step (0.2-0.3 s a process a
CPU-only server would otherwise pay at start-up)."""

from __future__ import annotations

import os

import torch


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """``auto|torch|triton`` -> the backend the runner uses on ``device`` (``cpu`` on a CPU,
    where the C++ kernels or torch run). ``triton`` on a CPU runs only under Triton's
    interpreter (``TRITON_INTERPRET=1``: tests)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not (name == "triton" and interpreted):
        if name == "triton":
            raise ValueError("--attention-backend triton runs on CUDA GPUs (use --device cuda)")
        return "cpu"
    if name == "torch":
        return name
    from infer.runner.gpu.triton_attention import triton_available

    if name == "auto":
        return "triton" if triton_available() else "torch"
    if name == "triton" and not triton_available():
        raise ValueError("--attention-backend triton needs the triton package (pip install triton)")
    return name

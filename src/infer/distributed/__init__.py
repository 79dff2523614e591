"""Tensor parallelism: one engine over several processes (torch.distributed, gloo or NCCL).

This module imports no torch: the engine loop names :class:`EngineDeadError` without it.
"""


class EngineDeadError(RuntimeError):
    """The engine cannot go on (a tensor-parallel rank died or fell out of step)."""

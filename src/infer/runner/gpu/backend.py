"""The CUDA device backend (see :mod:`infer.runner.backend`)."""

from __future__ import annotations

import torch

from infer.runner.backend import DeviceBackend


class CudaBackend(DeviceBackend):
    """A CUDA GPU: the Triton step (``runner/gpu/``), CUDA graphs for decode steps."""

    collectives = "nccl"
    pins_cores = False  # a rank computes on its own GPU

    @classmethod
    def rank_device(cls, device: torch.device, rank: int) -> torch.device:
        """Rank ``r`` of an engine on ``cuda:k`` uses ``cuda:k+r``."""
        index = (device.index or 0) + rank
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"tensor parallel rank {rank} needs cuda:{index}, but only "
                f"{torch.cuda.device_count()} CUDA devices are visible"
            )
        return torch.device("cuda", index)

    def _prepare(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was given but CUDA is not available")
        if self._make_current:
            torch.cuda.set_device(self.device)

    def kv_budget(self, wanted: int, utilization: float, reserve: int = 0) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        # What torch's caching allocator holds but no tensor uses (an engine dropped earlier
        # in this process, say) is free to this one: the allocator hands it out first.
        reserved = torch.cuda.memory_reserved(self.device)
        cached = reserved - torch.cuda.memory_allocated(self.device)
        used = total - free - cached
        budget = max(int(total * utilization) - used, 0)
        return max(budget - reserve, 0)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

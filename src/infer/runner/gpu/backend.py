"""The CUDA device backend (see :mod:`infer.runner.backend`)."""

from __future__ import annotations

import torch

from infer.runner.backend import DeviceBackend


class CudaBackend(DeviceBackend):
    """A CUDA GPU: the Triton step (``runner/gpu/``), CUDA graphs for decode steps."""

    def __init__(self, device: torch.device, seed: int, *, make_current: bool = False) -> None:
        self._make_current = make_current
        super().__init__(device, seed)

    def _prepare(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was given but CUDA is not available")
        if self._make_current:  # a tensor-parallel rank's process: its one device
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

"""CUDA graphs of a step's forward pass, one per bucket of rows.

A decode step of ``n`` rows replays the graph of the smallest bucket ``B >= n``; rows ``n..B``
are padding (token 0 at position 0, slot -1: stored nowhere, context 0: attends to nothing), so
every replay reads the same buffers at the same addresses. Buckets as vLLM's capture sizes::

    1 2 4 8 16 24 32 40 ... (steps of 8) ... max

A mixed step (prompt chunks beside decodes) of ``n`` tokens likewise replays the graph of the
smallest token bucket holding it (opt-in, see ``cuda_step``); its padding rows belong to no
sequence::

    16 24 32 48 64 96 128 192 256 384 512 (up to the step's token budget)

Graphs are captured largest first into one shared memory pool (both kinds share it): the
activations of one replay are dead before the next starts, so the pool holds about one large
bucket's worth.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def capture_sizes(max_rows: int) -> list[int]:
    """The bucket sizes for decode steps of up to ``max_rows`` rows (ascending)."""
    sizes = [s for s in (1, 2, 4) if s <= max_rows]
    sizes += range(8, max_rows + 1, 8)
    if max_rows not in sizes:
        sizes.append(max_rows)
    return sorted(set(sizes))


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """The token buckets for mixed steps of up to ``max_tokens`` tokens (ascending): 16, then
    steps of a half or a third of a power of two (padding wastes at most a third), and
    ``max_tokens`` itself when it falls between."""
    sizes, power = [], 16
    while power <= max_tokens:
        sizes += [s for s in (power, power * 3 // 2) if s <= max_tokens]
        power *= 2
    if max_tokens >= 1 and (not sizes or sizes[-1] < max_tokens):
        sizes.append(max_tokens)
    return sorted(set(sizes))


def bucket(sizes: list[int], rows: int) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``rows`` rows, or None (run eagerly)."""
    return next((size for size in sizes if size >= rows), None)


class StepGraphs:
    """One captured forward per bucket.

    ``forward(B)`` (given to :meth:`capture` and :meth:`replay`, not kept: the runner that owns
    the graphs owns the model, and no cycle keeps a dropped engine's memory alive) runs the model
    on the step buffers' first ``B`` rows and returns the final hidden states ``[B, hidden]``;
    its output tensor is what a replay refreshes. On a device without CUDA graphs (the CPU, in
    tests) ``capture`` records nothing and ``replay`` calls ``forward`` on the same padded
    buffers: what the padding does to outputs is testable without a GPU.
    """

    def __init__(self, sizes: list[int], device: torch.device, what: str = "decode steps") -> None:
        self.sizes = sorted(sizes)
        self.device = device
        self.what = what  # for the start-up log line
        self.pool: tuple | None = None  # the memory pool the graphs were captured into
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    @torch.inference_mode()
    def capture(self, forward: Callable[[int], torch.Tensor], pool: tuple | None = None) -> None:
        """Capture every bucket (``pool``: another ``StepGraphs``' pool to share)."""
        if self.device.type != "cuda":
            return
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self.pool = pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            # Warm-up outside the graph: Triton compiles, cuBLAS picks its kernels.
            forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        logger.info(
            "captured %d CUDA graphs for %s of %d..%d rows in %.1fs, %.0f MiB",
            len(self.sizes),
            self.what,
            self.sizes[0],
            self.sizes[-1],
            self.capture_seconds,
            self.capture_bytes / 2**20,
        )

    def replay(self, size: int, forward: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The hidden states ``[size, hidden]`` of the bucket's forward on the current buffers
        (``forward`` runs only where nothing was captured)."""
        graph = self.graphs.get(size)
        if graph is None:
            return forward(size)
        graph.replay()
        return self.outputs[size]

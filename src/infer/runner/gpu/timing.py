"""Timing GPU work the way a decode step runs it: CUDA events around replays of a CUDA graph.

A kernel shorter than its launch from Python (a Triton kernel's launch takes tens of
microseconds) is timed by its launch unless the calls run back to back from the device; a graph
of them does that. Used by ``infer bench gpu`` and by the runner's start-up choices
(``triton_gemv.pick``); off CUDA the wall clock times plain calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for ``device`` (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[], Any],
    device: torch.device,
    reps: int,
    inner: int = 1,
    warmup: int = 2,
    graph: bool = False,
    how: dict | None = None,
) -> list[float]:
    """Milliseconds per call of ``fn``, ``reps`` samples of ``inner`` calls each (CUDA events
    on a GPU, the wall clock elsewhere), after ``warmup`` calls.

    ``graph``: on CUDA, the ``inner`` calls are captured in one CUDA graph and each sample is a
    replay, so a kernel shorter than its launch from Python is timed, not the launch (falls
    back to plain calls if the capture fails). ``how["timing"]`` says which ran.
    """
    how = how if how is not None else {}
    how["timing"] = "events" if device.type == "cuda" else "wall clock"
    for _ in range(warmup):
        fn()
    sync(device)

    def calls() -> None:
        for _ in range(inner):
            fn()

    run = calls
    if graph and device.type == "cuda":
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                calls()
            torch.cuda.current_stream(device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                calls()
            g.replay()
            run = g.replay
            how["timing"] = "cuda graph"
        except Exception as e:  # noqa: BLE001 - time the plain calls instead
            how["timing"] = f"events (graph capture failed: {type(e).__name__}: {e})"[:200]
        sync(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / inner)
        else:
            t = time.perf_counter()
            run()
            out.append((time.perf_counter() - t) * 1000 / inner)
    return out

"""``--cpu-bind``: which cores the engine's threads and the HTTP server run on (Linux). No torch.

The engine's step is a serial stretch of Python on its main thread (schedule, prepare, sample,
detokenize, send the replies) between parallel kernels that every compute thread joins. The
kernels hand out their work dynamically: if the HTTP process takes a core from a worker thread
for a millisecond, the other threads take over the worker's share and the step loses about that
millisecond divided by the number of threads. If it takes the core of the main thread, the whole
step waits that millisecond, and the workers spin. Left to itself, Linux wakes the HTTP process on
the core of the thread that wrote to the pipe (the main thread, after every step), so on a
machine with as many cores as compute threads the step waits for the server's work on it every
time. With a binding the main thread owns a core, the workers and the server share the others::

    --cpu-bind 0-1 (or auto on a 2-core machine)

      core 0: engine main thread (scheduler, Python, its share of every kernel)
      core 1: engine compute thread  +  server process (HTTP, tokenizing, SSE)

Measured over HTTP with ``vllm bench serve`` (the ~110M Llama, 64/64 at C=16, 2-core Zen 4 VM,
12 runs each, alternating): 704 -> 720 tok/s mean (+2.3%); measured again later (6 runs each,
alternating, same set-up): 740 with it, 740 without, so the gain is within this VM's noise.
vLLM's CPU backend binds its compute threads the same way (``VLLM_CPU_OMP_THREADS_BIND``).

Off by default: two servers started without their own core sets would both put their main thread
on the first core.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuBinding:
    """Cores for the engine's main thread, its other compute threads, and the server process."""

    main: int
    workers: frozenset[int]
    server: frozenset[int]

    @property
    def num_threads(self) -> int:
        """Compute threads the engine runs: one per bound core."""
        return 1 + len(self.workers)


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (the ``taskset -c`` / cpuset list syntax)."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            msg = f"--cpu-bind: {part!r} is not a core number or range (e.g. 0-3,6)"
            raise ValueError(msg) from None
        if first < 0 or last < first:
            raise ValueError(f"--cpu-bind: {part!r} is not a range of cores (e.g. 0-3)")
        cores.extend(c for c in range(first, last + 1) if c not in cores)
    return cores


def plan_cpu_binding(spec: str, allowed: set[int] | None = None) -> CpuBinding | None:
    """The binding ``--cpu-bind spec`` asks for: ``off``, ``auto`` (every core this process may
    use) or a core list. ``None`` when there is nothing to bind (off, or a single core).

    The first core is the main thread's; the rest take the other compute threads. The server
    process gets the cores outside the list if this process may use any, else the workers'.
    """
    if spec == "off":
        return None
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    if spec == "auto":
        cores = sorted(allowed)
    else:
        cores = parse_cpu_list(spec)
        outside = sorted(set(cores) - allowed)
        if outside:
            raise ValueError(
                f"--cpu-bind {spec}: core(s) {', '.join(map(str, outside))} are not available "
                f"to this process (it may use {', '.join(map(str, sorted(allowed)))})"
            )
    if len(cores) < 2:
        return None
    workers = frozenset(cores[1:])
    return CpuBinding(cores[0], workers, frozenset(allowed - set(cores)) or workers)


def bind_process(cores: frozenset[int]) -> None:
    """Every thread of this process (and so every thread it starts later) on ``cores``."""
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cores)


_helper_cores: frozenset[int] | None = None  # set in a bound engine process


def bind_engine_threads(binding: CpuBinding) -> None:
    """In the engine process's main thread, once its compute threads exist: every thread on the
    workers' cores, then the calling (main) thread alone on its core. Threads it starts later
    inherit its core; helper threads move off it with :func:`leave_main_core`."""
    global _helper_cores
    _helper_cores = binding.workers
    bind_process(binding.workers)
    os.sched_setaffinity(0, {binding.main})  # 0: the calling thread


def leave_main_core() -> None:
    """For a helper thread (grammar compilation, ...) at its start: in a bound engine process,
    go to the workers' cores rather than share the main thread's; elsewhere, nothing."""
    if _helper_cores is not None:
        os.sched_setaffinity(0, _helper_cores)

"""The driver's side of tensor parallelism: start ranks 1..N-1, send them each step, notice
when one dies.

::

    driver = rank 0 (the engine)                     worker rank r = 1 .. N-1
    ──────────────────────────────────               ────────────────────────────────
    spawn the workers ─────────────────────────────► init_process_group(rank r)
    init_process_group(rank 0)                       load its slice of every layer
    load its slice of every layer
    plan the KV cache ── broadcast KVSetup ────────► KVCache(num_kv_heads / N heads)
    each step: schedule, prepare a StepBatch
               ── broadcast StepBatch ─────────────► runner.run(batch)
               runner.run(batch)   ◄── all-reduce / all-gather inside every layer ──►
               sample (the driver only)
    close ─────── broadcast None ──────────────────► exit

The scheduler, the KV block manager and the sampler exist once, in the driver: workers only
run forward passes, in lockstep with it. A worker that dies closes its sockets, and the
driver's next collective raises at once (gloo: "connection closed by peer"); the engine then
stops with :class:`EngineDeadError` naming the rank, never waiting on a dead peer.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infer.distributed import EngineDeadError
from infer.model.parallel import TensorParallel, set_tensor_parallel

logger = logging.getLogger("infer.distributed")

# Idle workers wait in a broadcast for the next step; the engine may idle for days.
IDLE_TIMEOUT = datetime.timedelta(days=30)


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker needs to build its slice of the model (pickled to the new process)."""

    rank: int
    size: int
    init_method: str
    backend: str
    model_path: Path
    dtype: torch.dtype
    device: str
    quantization: str | None
    quantize_lm_head: bool
    seed: int
    num_threads: int
    cores: tuple[int, ...] | None
    log_level: int


@dataclass(frozen=True)
class KVSetup:
    """The driver's KV cache plan, which every rank allocates for its own heads."""

    num_blocks: int
    block_size: int
    kv_cache_dtype: str
    num_swap_blocks: int
    attention_backend: str = "auto"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``r`` of a CUDA engine on ``cuda:k`` uses ``cuda:k+r``; CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"tensor parallel rank {rank} needs cuda:{index}, but only "
            f"{torch.cuda.device_count()} CUDA devices are visible"
        )
    return torch.device("cuda", index)


def core_groups(size: int) -> list[tuple[int, ...]]:
    """This process's cores cut into ``size`` groups, one per rank (fewer cores: shared)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per = max(len(cores) // size, 1)
    if len(cores) < size:
        return [tuple(cores)] * size
    return [tuple(cores[r * per : (r + 1) * per]) for r in range(size)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelWorkers:
    """Ranks 1..N-1 of a tensor-parallel engine, seen from the driver (rank 0).

    Construction spawns the workers and joins the process group; the caller then builds its
    own slice of the model (the layers read the group from
    :func:`~infer.model.parallel.get_tensor_parallel`).
    """

    def __init__(
        self,
        size: int,
        model_path: Path,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str | None,
        quantize_lm_head: bool,
        seed: int,
    ) -> None:
        self.size = size
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        groups = core_groups(size)
        num_threads = max(min(torch.get_num_threads(), len(groups[0])), 1)
        ctx = mp.get_context("spawn")
        self.procs = []
        for rank in range(1, size):
            args = WorkerArgs(
                rank=rank,
                size=size,
                init_method=init_method,
                backend=backend,
                model_path=model_path,
                dtype=dtype,
                device=str(rank_device(device, rank)),
                quantization=quantization,
                quantize_lm_head=quantize_lm_head,
                seed=seed,
                num_threads=num_threads,
                cores=groups[rank] if device.type == "cpu" else None,
                log_level=logging.getLogger().level,
            )
            from infer.distributed.worker import worker_main

            proc = ctx.Process(
                target=worker_main, args=(args,), name=f"infer-tp-{rank}", daemon=True
            )
            proc.start()
            self.procs.append(proc)
        # The driver's own share of the cores: its thread count, not its affinity (the HTTP
        # server may share this process). Restored by close().
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            dist.init_process_group(
                backend, init_method=init_method, rank=0, world_size=size, timeout=IDLE_TIMEOUT
            )
        except Exception:
            self._kill()
            raise
        # Step batches are Python objects: they go over gloo even when the model uses NCCL.
        self.control = dist.new_group(backend="gloo") if backend != "gloo" else None
        set_tensor_parallel(TensorParallel(rank=0, size=size, group=dist.group.WORLD))
        self.failure: str | None = None
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name="infer-tp-watchdog", daemon=True)
        self._watchdog.start()
        logger.info(
            "tensor parallel: %d ranks over %s, %d threads each, worker pids %s",
            size,
            backend,
            num_threads,
            ", ".join(str(p.pid) for p in self.procs),
        )

    def _watch(self) -> None:
        """Name the first worker that exits while the engine still needs it."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
        ready = wait(list(sentinels))
        if self._closed:
            return
        rank = sentinels[ready[0]]
        proc = self.procs[rank - 1]
        proc.join(5)  # reap it: its exit code is unknown until then
        for _ in range(100):  # another thread may be the one reaping it
            if proc.exitcode is not None:
                break
            time.sleep(0.01)
        code = proc.exitcode
        self.failure = f"tensor parallel worker rank {rank} exited (code {code})"
        logger.error("%s: the engine stops at its next step", self.failure)

    def broadcast(self, obj: Any) -> None:
        """Send ``obj`` (a StepBatch, a KVSetup, or None: stop) to every worker."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        try:
            dist.broadcast_object_list([obj], src=0, group=self.control)
        except RuntimeError as e:
            raise self.dead(e) from e

    send = broadcast  # ModelRunner's name for it

    def dead(self, error: BaseException) -> EngineDeadError:
        """The error to stop the engine with after ``error`` broke a step: which rank died if
        one did (its exit can lag the broken socket by a moment), else the error itself."""
        self._watchdog.join(timeout=5)
        why = self.failure or f"a tensor parallel step failed ({type(error).__name__}: {error})"
        return EngineDeadError(f"{why}; the ranks are out of step, so the engine stops")

    def close(self) -> None:
        """Stop the workers and leave the process group (the driver can build a new one)."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            with contextlib.suppress(RuntimeError):
                dist.broadcast_object_list([None], src=0, group=self.control)
        for proc in self.procs:
            proc.join(10)
        self._kill()
        try:
            dist.destroy_process_group()
        finally:
            set_tensor_parallel(TensorParallel())
            torch.set_num_threads(self._threads_before)

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)

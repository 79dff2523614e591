"""The driver's side of tensor parallelism: start ranks 1..N-1, send them each step, notice
when one dies.

::

    driver = rank 0 (the engine)                     worker rank r = 1 .. N-1
    ──────────────────────────────────               ────────────────────────────────
    TCPStore (the rendezvous), spawn the workers ──► connect, set joined/r
    wait: every joined/r, or a rank's exit,          init_process_group(rank r)
          or the start-up deadline                   load its slice of every layer
    init_process_group(rank 0)                       set ready/r
    load its slice of every layer
    wait: every ready/r (same watch)
    plan the KV cache ── broadcast RunnerSetup ────► KVCache(num_kv_heads / N heads)
    each step: schedule, prepare a StepBatch
               ── broadcast StepBatch ─────────────► runner.run(batch)
               runner.run(batch)   ◄── all-reduce / all-gather inside every layer ──►
               sample (the driver only)
    close ─────── broadcast None ──────────────────► exit

The scheduler, the KV block manager and the sampler exist once, in the driver: workers only
run forward passes, in lockstep with it. A worker that dies closes its sockets, and the
driver's next collective raises at once (gloo: "connection closed by peer"); the engine then
stops with :class:`EngineDeadError` naming the rank, never waiting on a dead peer.

Nothing waits without a bound. Start-up: the driver polls the rendezvous store and the ranks'
processes, so a rank that exits before it joins or while it loads (an import error, a shard
that does not load, a main module that cannot be re-imported) ends start-up at once with its
rank, exit code and last lines of output, and one that neither joins nor dies ends it at the
deadline (``INFER_TP_STARTUP_TIMEOUT`` seconds; default 120 + 60 per GB of checkpoint). Steps:
the model's collectives run in a group whose timeout is ``INFER_TP_STEP_TIMEOUT`` seconds
(default 300), so a rank that stalls, or ranks that disagree on a step, raise within it; only
the workers' wait for the next step (a group of its own, gloo) may last as long as the engine
idles. Each worker's output goes to a file the driver forwards to its own stderr line by line
(and quotes from when the rank fails).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import socket
import sys
import tempfile
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
from infer.distributed.spawn import spawnable_main
from infer.model.parallel import TensorParallel, set_tensor_parallel
from infer.runner.backend import backend_class

logger = logging.getLogger("infer.distributed")

# Idle workers wait in a broadcast for the next step; the engine may idle for days.
IDLE_TIMEOUT = datetime.timedelta(days=30)
STARTUP_TIMEOUT_ENV = "INFER_TP_STARTUP_TIMEOUT"
STEP_TIMEOUT_ENV = "INFER_TP_STEP_TIMEOUT"
FAULT_ENV = "INFER_TP_FAULT"
"""Test hook: ``RANK:PHASE`` makes that worker misbehave at ``start`` (exit before joining),
``load`` (exit after loading), ``hang`` (never report ready) or ``skip-step`` (skip its first
batch's forward pass: its collectives never come, a mismatched step)."""
STORE_KEY = "infer/{}/{}"  # store keys: infer/joined/<rank>, infer/ready/<rank>


def step_timeout() -> datetime.timedelta:
    """How long one of the model's collectives may wait for the other ranks."""
    return datetime.timedelta(seconds=float(os.environ.get(STEP_TIMEOUT_ENV, "300")))


def startup_timeout(model_path: Path) -> float:
    """Seconds a rank may take to join and load: ``INFER_TP_STARTUP_TIMEOUT``, else 120 s + 60 s
    per GB of the checkpoint's weight files (a GGUF file's folder: the file; its 4-bit weights
    unpack to about four times its bytes)."""
    from infer.model.gguf_folder import gguf_source

    if os.environ.get(STARTUP_TIMEOUT_ENV):
        return float(os.environ[STARTUP_TIMEOUT_ENV])
    gguf_file = gguf_source(model_path)
    if gguf_file is not None:
        return 120.0 + 4 * 60.0 * gguf_file.stat().st_size / 1e9
    size = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    return 120.0 + 60.0 * size / 1e9


def fault(rank: int) -> str | None:
    """The test hook's phase for ``rank`` (see :data:`FAULT_ENV`), or None."""
    value = os.environ.get(FAULT_ENV, "")
    who, _, phase = value.partition(":")
    return phase if who == str(rank) else None


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker needs to build its slice of the model (pickled to the new process)."""

    rank: int
    size: int
    store_port: int
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
    log_path: str  # the worker's stdout and stderr go here (the driver forwards them)


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
        self.procs: list = []
        self.failure: str | None = None
        self._closed = False
        self._ready = False
        self._group = False
        self._threads_before = torch.get_num_threads()
        device_kind = backend_class(device)
        backend = device_kind.collectives
        timeout = step_timeout()
        self._startup_timeout = startup_timeout(model_path)
        self._deadline = time.monotonic() + self._startup_timeout
        self._logs = Path(tempfile.mkdtemp(prefix="infer-tp-"))
        self._forwarder = _LogForwarder()
        try:
            port = _free_port()
            self.store = dist.TCPStore(
                "127.0.0.1", port, size, is_master=True, timeout=timeout,
                wait_for_workers=False,
            )  # fmt: skip
            self._spawn(size, port, device_kind, model_path, dtype, device, quantization,
                        quantize_lm_head, seed)  # fmt: skip
            self._await_all("joined", "join the process group")
            # The driver's own share of the cores: its thread count, not its affinity (the HTTP
            # server may share this process). Restored by close().
            torch.set_num_threads(self._num_threads)
            dist.init_process_group(
                backend, store=self.store, rank=0, world_size=size, timeout=timeout
            )
            self._group = True
            # Step batches are Python objects sent over gloo (even when the model uses NCCL),
            # in a group of their own: waiting for the next step may last as long as the engine
            # idles, while the model's collectives time out.
            self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        except BaseException:
            self._abort()
            raise
        set_tensor_parallel(TensorParallel(rank=0, size=size, group=dist.group.WORLD))
        self._watchdog = threading.Thread(target=self._watch, name="infer-tp-watchdog", daemon=True)
        self._watchdog.start()
        logger.info(
            "tensor parallel: %d ranks over %s, %d threads each, worker pids %s; step timeout "
            "%.0fs, start-up deadline %.0fs",
            size,
            backend,
            self._num_threads,
            ", ".join(str(p.pid) for p in self.procs),
            timeout.total_seconds(),
            self._startup_timeout,
        )

    def _spawn(self, size, port, device_kind, model_path, dtype, device, quantization,
               quantize_lm_head, seed) -> None:  # fmt: skip
        from infer.distributed.worker import worker_main

        groups = core_groups(size)
        self._num_threads = max(min(torch.get_num_threads(), len(groups[0])), 1)
        ctx = mp.get_context("spawn")
        for rank in range(1, size):
            log_path = self._logs / f"rank{rank}.log"
            log_path.touch()
            self._forwarder.add(log_path)
            args = WorkerArgs(
                rank=rank,
                size=size,
                store_port=port,
                backend=device_kind.collectives,
                model_path=model_path,
                dtype=dtype,
                device=str(device_kind.rank_device(device, rank)),
                quantization=quantization,
                quantize_lm_head=quantize_lm_head,
                seed=seed,
                num_threads=self._num_threads,
                cores=groups[rank] if device_kind.pins_cores else None,
                log_level=logging.getLogger().level,
                log_path=str(log_path),
            )
            proc = ctx.Process(
                target=worker_main, args=(args,), name=f"infer-tp-{rank}", daemon=True
            )
            with spawnable_main():
                proc.start()
            self.procs.append(proc)
        self._forwarder.start()

    def _await_all(self, what: str, doing: str) -> None:
        """Wait until every worker has set ``infer/<what>/<rank>``; a worker that exits first,
        or the start-up deadline, ends the wait with an error naming the rank."""
        pending = set(range(1, self.size))
        while pending:
            for rank in sorted(pending):
                if self.store.check([STORE_KEY.format(what, rank)]):
                    pending.discard(rank)
                    continue
                proc = self.procs[rank - 1]
                if not proc.is_alive():
                    proc.join(1)
                    raise RuntimeError(
                        f"tensor parallel rank {rank} exited (code {proc.exitcode}) before it "
                        f"could {doing}{self._tail(rank)}"
                    )
            if pending and time.monotonic() > self._deadline:
                ranks = ", ".join(map(str, sorted(pending)))
                raise RuntimeError(
                    f"tensor parallel rank(s) {ranks} did not {doing} within "
                    f"{self._startup_timeout:.0f}s (set {STARTUP_TIMEOUT_ENV} for a longer "
                    f"start-up){self._tail(min(pending))}"
                )
            if pending:
                time.sleep(0.02)

    def _tail(self, rank: int, lines: int = 12) -> str:
        """The rank's last lines of output, quoted for an error message."""
        try:
            text = (self._logs / f"rank{rank}.log").read_text(errors="replace")
        except OSError:
            return ""
        last = [ln for ln in text.splitlines() if ln.strip()][-lines:]
        return (": its last output:\n  " + "\n  ".join(last)) if last else " (it printed nothing)"

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
        logger.error("%s: the engine stops at its next step%s", self.failure, self._tail(rank))

    def broadcast(self, obj: Any) -> None:
        """Send ``obj`` (a StepBatch, a RunnerSetup, or None: stop) to every worker. The first one
        (the KV set-up) waits for every worker to have loaded its slice, under the start-up
        deadline."""
        if not self._ready:
            self._await_all("ready", "load its slice of the model")
            self._ready = True
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
        if self.failure is None and self._ready:
            with contextlib.suppress(RuntimeError):
                dist.broadcast_object_list([None], src=0, group=self.control)
            for proc in self.procs:
                proc.join(10)
        self._abort()

    def _abort(self) -> None:
        """Kill and reap every worker still running, leave the group, restore this process."""
        self._closed = True
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(10)
        self._forwarder.stop()
        try:
            if self._group:
                dist.destroy_process_group()
        finally:
            self._group = False
            set_tensor_parallel(TensorParallel())
            torch.set_num_threads(self._threads_before)
            shutil.rmtree(self._logs, ignore_errors=True)


class _LogForwarder:
    """Copies what the workers write to their log files onto this process's stderr, line by
    line, from a thread (a worker's output must not be lost, nor interleave mid-line)."""

    def __init__(self) -> None:
        self._files: list[Path] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, path: Path) -> None:
        self._files.append(path)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="infer-tp-logs", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        handles = [open(p, errors="replace") for p in self._files]  # noqa: SIM115
        partial = ["" for _ in handles]
        try:
            while True:
                stopping = self._stop.is_set()
                for i, f in enumerate(handles):
                    chunk = f.read()
                    if not chunk:
                        continue
                    *lines, partial[i] = (partial[i] + chunk).split("\n")
                    for line in lines:
                        sys.stderr.write(line + "\n")
                    sys.stderr.flush()
                if stopping:
                    return
                self._stop.wait(0.1)
        finally:
            for f in handles:
                f.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

"""A tensor-parallel worker process (ranks 1..N-1): its slice of the model, run in lockstep
with the driver (see :mod:`infer.distributed.executor`)."""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from infer.core.messages import RunnerSetup
from infer.distributed.executor import (
    IDLE_TIMEOUT,
    STORE_KEY,
    WorkerArgs,
    fault,
    step_timeout,
)
from infer.distributed.spawn import leave_shutdown_to_parent
from infer.model.parallel import TensorParallel, set_tensor_parallel

logger = logging.getLogger("infer.distributed")


def _redirect_output(path: str) -> None:
    """This process's stdout and stderr (Python's and any library's) to ``path``, which the
    driver forwards to its own stderr and quotes when this rank fails."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def worker_main(args: WorkerArgs) -> None:
    """Join the group, build this rank's slice, then run every batch the driver broadcasts
    until it sends None. Any error ends the process: the driver's next collective then fails
    at once instead of waiting on a rank that is out of step."""
    _redirect_output(args.log_path)
    leave_shutdown_to_parent()  # the driver decides when to stop
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.cores:
        os.sched_setaffinity(0, args.cores)
    torch.set_num_threads(args.num_threads)
    try:
        _serve(args)
    except BaseException:
        logger.exception("tensor parallel worker rank %d failed", args.rank)
        os._exit(1)
    os._exit(0)


def _serve(args: WorkerArgs) -> None:
    from infer.runner.backend import WeightsConfig, device_backend

    phase = fault(args.rank)
    timeout = step_timeout()
    store = dist.TCPStore("127.0.0.1", args.store_port, args.size, is_master=False,
                          timeout=timeout)  # fmt: skip
    if phase == "start":
        raise RuntimeError(f"{FAULT_NOTE}: exit before joining")
    store.set(STORE_KEY.format("joined", args.rank), "1")
    dist.init_process_group(
        args.backend, store=store, rank=args.rank, world_size=args.size, timeout=timeout
    )
    # The driver's step batches arrive in a group of their own, without a deadline (idle).
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    set_tensor_parallel(TensorParallel(rank=args.rank, size=args.size, group=dist.group.WORLD))
    # The same backend steps as the driver's (LLMEngine._setup), on this rank's device.
    backend = device_backend(args.device, args.seed, make_current=True)
    backend.load_model(
        WeightsConfig(args.model_path, args.dtype, args.quantization, args.quantize_lm_head)
    )

    if phase == "load":
        raise RuntimeError(f"{FAULT_NOTE}: exit after loading")
    if phase == "hang":
        while True:  # never reports ready
            time.sleep(1)
    store.set(STORE_KEY.format("ready", args.rank), "1")

    def receive():
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        return box[0]

    setup: RunnerSetup = receive()
    runner = backend.build_runner(setup)
    skip = phase == "skip-step"
    while (batch := receive()) is not None:
        if skip:  # the test hook: this rank's collectives for this step never come
            skip = False
            continue
        runner.run(batch)
    dist.destroy_process_group()


FAULT_NOTE = "INFER_TP_FAULT test hook"

"""A tensor-parallel worker process (ranks 1..N-1): its slice of the model, run in lockstep
with the driver (see :mod:`infer.distributed.executor`)."""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from infer.distributed.executor import (
    IDLE_TIMEOUT,
    STORE_KEY,
    KVSetup,
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
    from infer.model.loader import load_model
    from infer.runner.attention import KVCache
    from infer.runner.prepack import prepack_linears
    from infer.runner.quant import quantize_linears
    from infer.runner.runner import ModelRunner

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
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    model = load_model(args.model_path, args.dtype, device)
    if args.quantization:
        quantize_linears(model, args.quantization, lm_head=args.quantize_lm_head)
    else:
        prepack_linears(model)

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

    setup: KVSetup = receive()
    spec = model.spec
    kv_cache = KVCache(
        spec.num_layers,
        setup.num_blocks,
        setup.block_size,
        spec.num_kv_heads // args.size,
        spec.head_dim,
        args.dtype,
        device,
        kv_dtype=setup.kv_cache_dtype,
    )
    runner = ModelRunner(
        model,
        kv_cache,
        device,
        args.seed,
        num_swap_blocks=setup.num_swap_blocks,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        attention_backend=setup.attention_backend,
        max_model_len=setup.max_model_len,
    )
    skip = phase == "skip-step"
    while (batch := receive()) is not None:
        if skip:  # the test hook: this rank's collectives for this step never come
            skip = False
            continue
        runner.run(batch)
    dist.destroy_process_group()


FAULT_NOTE = "INFER_TP_FAULT test hook"

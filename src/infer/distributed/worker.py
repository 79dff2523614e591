"""A tensor-parallel worker process (ranks 1..N-1): its slice of the model, run in lockstep
with the driver (see :mod:`infer.distributed.executor`)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal

import torch
import torch.distributed as dist

from infer.distributed.executor import IDLE_TIMEOUT, KVSetup, WorkerArgs
from infer.model.parallel import TensorParallel, set_tensor_parallel

logger = logging.getLogger("infer.distributed")


def _die_with_parent() -> None:
    """Linux: SIGKILL when the driver dies, so a killed engine leaves no worker behind."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_main(args: WorkerArgs) -> None:
    """Join the group, build this rank's slice, then run every batch the driver broadcasts
    until it sends None. Any error ends the process: the driver's next collective then fails
    at once instead of waiting on a rank that is out of step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when to stop
    _die_with_parent()
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

    dist.init_process_group(
        args.backend,
        init_method=args.init_method,
        rank=args.rank,
        world_size=args.size,
        timeout=IDLE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo") if args.backend != "gloo" else None
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
        attention_backend=setup.attention_backend,
    )
    while (batch := receive()) is not None:
        runner.run(batch)
    dist.destroy_process_group()

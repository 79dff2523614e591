"""``infer bench tensor-parallel``: what splitting the model over N processes costs and buys here.

Two measurements, on this machine:

- offline throughput of the same batch at ``--tensor-parallel-size`` 1, 2, ... (the ~110M Llama
  by default; ``LLM.generate``, greedy, ``--concurrency`` prompts of ``--input-len`` random
  tokens, ``--output-len`` tokens each, the median of ``--runs``), with the mean step time;
- the collective itself: one all-reduce of a ``[tokens, hidden]`` bf16 activation between two
  gloo processes, per token count (a decode step of the model does ``2 * layers + 1`` of them).

Writes ``tensor_parallel.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from infer.bench.cli import add_common
from infer.bench.report import md_table, save_report

ALL_REDUCE_ITERS = 300

NEEDS_BENCH_EXTRA = False
"""It runs without the ``bench`` extra (``infer bench`` checks for it otherwise)."""


def _all_reduce_rank(rank: int, port: int, hidden: int, rows: list[int], out) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    result = {}
    for n in rows:
        x = torch.ones(n, hidden, dtype=torch.bfloat16)
        for _ in range(20):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(ALL_REDUCE_ITERS):
            dist.all_reduce(x)
        result[n] = 1e6 * (time.perf_counter() - t0) / ALL_REDUCE_ITERS
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def measure_all_reduce(hidden: int, rows: list[int]) -> dict[int, float]:
    """Microseconds per gloo all-reduce of ``[n, hidden]`` bf16 between two processes."""
    import torch.multiprocessing as mp

    from infer.distributed.executor import _free_port

    ctx = mp.get_context("spawn")
    port, out = _free_port(), ctx.Queue()
    procs = [
        ctx.Process(target=_all_reduce_rank, args=(r, port, hidden, rows, out)) for r in range(2)
    ]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def measure_throughput(args: argparse.Namespace, model: Path, size: int) -> dict:
    from infer import LLM, SamplingParams
    from infer.bench.offline import timed_generate

    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    with LLM(
        str(model),
        dtype=args.dtype,
        tensor_parallel_size=size,
        max_num_seqs=args.concurrency,
        max_model_len=args.input_len + args.output_len + 16,
    ) as llm:
        vocab = min(llm.engine.spec.vocab_size, len(llm.tokenizer))
        rng = random.Random(0)  # the same prompts at every size
        prompts = [
            [rng.randrange(min(100, vocab // 2), vocab) for _ in range(args.input_len)]
            for _ in range(args.concurrency)
        ]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
        rates, step_ms = [], []
        for _ in range(args.runs):
            st = llm.engine.step_times
            steps0, forward0 = st.steps, st.forward
            tokens, seconds = timed_generate(llm, prompts, params)
            rates.append(tokens / seconds)
            step_ms.append(1000 * (st.forward - forward0) / max(st.steps - steps0, 1))
        return {
            "tensor_parallel_size": size,
            "tok_s": statistics.median(rates),
            "tok_s_runs": rates,
            "forward_ms_per_step": statistics.median(step_ms),
        }


def run(args: argparse.Namespace) -> int:
    from infer.model.loader import load_model_spec
    from infer.testing.bench_models import llama_100m

    model = llama_100m(args.model)
    spec = load_model_spec(model)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = [1, 16, 64, 512]
    print(f"all-reduce, 2 gloo processes, [n, {spec.hidden_size}] bf16 ...", flush=True)
    all_reduce = measure_all_reduce(spec.hidden_size, rows)
    throughput = []
    for size in sizes:
        print(f"tensor_parallel_size {size} ...", flush=True)
        throughput.append(measure_throughput(args, model, size))
    result = {
        "model": str(model),
        "layers": spec.num_layers,
        "hidden": spec.hidden_size,
        "dtype": args.dtype,
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "runs": args.runs,
        "all_reduce_us": all_reduce,
        "throughput": throughput,
    }
    save_report(result, render(result), args.out, "tensor_parallel")
    return 0


def render(r: dict) -> str:
    """``tensor_parallel.md``."""
    lines = [
        "# Tensor parallelism on this machine",
        "",
        f"Model: {r['layers']} layers, hidden {r['hidden']}, {r['dtype']}. Offline "
        f"`LLM.generate`, {r['concurrency']} prompts x {r['input_len']} random tokens in, "
        f"{r['output_len']} out (greedy, ignore_eos); median of {r['runs']} runs.",
        "",
    ]
    rows = [[t["tensor_parallel_size"], f"{t['tok_s']:.0f}", ", ".join(f"{x:.0f}" for x in
             t["tok_s_runs"]), f"{t['forward_ms_per_step']:.1f}"] for t in r["throughput"]]  # fmt: skip
    lines += md_table("tensor_parallel_size | output tok/s (median) | runs | forward ms / step",
                      rows, "rrlr")  # fmt: skip
    per_step = 2 * r["layers"] + 1
    lines += [
        "",
        f"One gloo all-reduce of `[n, {r['hidden']}]` bf16 between two processes "
        f"({ALL_REDUCE_ITERS} calls, after a warm-up); a step of this model does "
        f"{per_step} of them (two per layer, one for the embedding):",
        "",
    ]
    rows = [[n, f"{us:.0f}", f"{us * per_step / 1000:.2f}"] for n, us in r["all_reduce_us"].items()]
    lines += md_table("rows n | us per all-reduce | x per step = ms", rows, "rrr")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer bench tensor-parallel",
        description="throughput at tensor_parallel_size 1, 2, ... and all-reduce cost",
    )
    p.add_argument("--model", default=None, help="checkpoint (default: the ~110M Llama)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sizes", default="1,2", help="comma-separated tensor parallel sizes")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    add_common(p, out="tensor_parallel")  # the committed report: --out benchmarks/reports
    return p


if __name__ == "__main__":
    from infer.bench.cli import main as infer_main

    sys.exit(infer_main(["bench", "tensor-parallel", *sys.argv[1:]]))

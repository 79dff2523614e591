"""The engine's host work per decode step at a large batch, with a model too small to matter.

    python benchmarks/host_step.py [--batch 256] [--steps 96] [--runs 5] [--stream-interval 1]
                                   [--out bench-results/host]

On a GPU a step of 256 decoding requests is host-bound: the device finishes its part (~2 ms for
a 1B model) before the host has scheduled the step, filled its inputs, applied the sampled
tokens and made the outputs (detokenization included). That host work is the same Python on
any machine, so it is measured here, on the CPU, with a one-layer, 64-wide Llama (the 32,000-token
BPE tokenizer of the bench models): ``batch`` requests of 128 prompt tokens admitted together,
then ``steps`` decode steps of all of them, each part of each step timed by the engine's own
counters (``engine.step_times``), the median step of each run, the median over runs.

Parts: ``schedule`` (the scheduler's plan, blocks included), ``prepare`` (the runner's inputs),
``update`` (the sampled tokens applied, stop checks, the outputs made: detokenization, logprobs)
and, for reference only, ``forward`` and ``sample`` (the CPU computing what a GPU would).
``--stream-interval N``: the engine makes a request's output every N tokens (``update`` then
holds what ``--stream-interval`` saves the engine).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

PARTS = ("schedule", "prepare", "update", "forward", "sample")
MODEL_DIR = Path.home() / ".cache/infer/bench/llama-host-step"


def measure(engine, batch: int, steps: int, seed: int) -> dict[str, float]:
    """Median ms of each part over the pure decode steps of one run."""
    from infer.bench.offline import greedy, prompt_vocab, random_prompts

    prompts = random_prompts(prompt_vocab(engine), batch, 128, seed)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{seed}-{i}", prompt, greedy(steps + 8))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # the prefills
    per_step: dict[str, list[float]] = {p: [] for p in PARTS}
    for _ in range(steps):
        before = copy.copy(engine.step_times)
        engine.step()
        for p in PARTS:
            per_step[p].append(1000 * (getattr(engine.step_times, p) - getattr(before, p)))
    while engine.has_unfinished_requests():
        engine.step()
    return {p: statistics.median(v) for p, v in per_step.items()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--out", default="bench-results/host")
    args = p.parse_args(argv)

    from infer.bench.offline import make_engine
    from infer.bench.report import cpu_model
    from infer.testing.bench_models import build_random_llama

    model = build_random_llama(
        MODEL_DIR, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    engine = make_engine(model, dtype="bfloat16", max_num_seqs=args.batch,
                         max_num_batched_tokens=max(8192, args.batch), kv_cache_memory=1 << 30,
                         stream_interval=args.stream_interval)  # fmt: skip
    measure(engine, args.batch, 8, seed=0)  # warm-up
    runs = [measure(engine, args.batch, args.steps, seed=r + 1) for r in range(args.runs)]
    result = {
        "cpu": cpu_model(),
        "batch": args.batch,
        "stream_interval": args.stream_interval,
        "steps": args.steps,
        "runs": runs,
        "median_ms": {k: statistics.median(r[k] for r in runs) for k in PARTS},
    }
    med = result["median_ms"]
    host = med["schedule"] + med["prepare"] + med["update"]
    print(f"{result['cpu']}: batch {args.batch}, stream interval {args.stream_interval}, "
          "median ms per decode step: "
          + ", ".join(f"{k} {med[k]:.3f}" for k in PARTS) + f"; host (schedule + prepare + "
          f"update) {host:.3f} ms = {1000 * args.batch / host:,.0f} tok/s if nothing else ran")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_step.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

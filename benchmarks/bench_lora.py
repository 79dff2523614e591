"""What serving LoRA adapters costs: ``infer bench lora``.

    infer bench lora [--adapters 8] [--rank 16] [--runs 3] [--out bench-results/lora]

(``python benchmarks/bench_lora.py`` runs the same.) Offline engine, no HTTP, bf16, the ~110M
Llama of ``infer bench engine``, every number from one run of this command on one machine:

- **base**: the model without ``--enable-lora``;
- **lora, base requests**: ``--enable-lora --max-loras N`` with N adapters loaded, every request
  on the base model (what enabling LoRA costs requests that use none);
- **lora, N adapters**: the same engine, requests spread evenly over the N adapters (rank
  ``--rank``, PEFT adapters on all seven projections of every layer, made here with PEFT).

Each is 64-token prompts, 64 greedy output tokens, 16 requests kept in flight (a new one joins
as one finishes), 64 requests a run; the cases take turns (A B C A B C ...) and the median of
``--runs`` is kept, with the decode step of 16 sequences (median over 32 steps) beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from infer.bench.cli import add_common
from infer.bench.offline import decode_step_ms as offline_decode_step_ms
from infer.bench.offline import (
    greedy,
    make_engine,
    output_tok_s,
    prompt_vocab,
    random_prompts,
    serve_closed_loop,
)
from infer.bench.report import machine_line, md_table, offline_machine, save_report
from infer.core.lora_request import LoRARequest
from infer.engine.engine import LLMEngine
from infer.testing.bench_models import LLAMA_100M_DIR, llama_100m

CONCURRENCY, NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 16, 64, 64, 64


def build_adapters(model: Path, count: int, rank: int) -> list[LoRARequest]:
    """``count`` random PEFT adapters of ``model`` (all projections), built once."""
    from infer.testing.lora import build_lora_adapter

    root = LLAMA_100M_DIR.parent / f"lora-{model.name}-r{rank}"
    return [
        LoRARequest(f"adapter{i}", i + 1, str(build_lora_adapter(
            model, root / f"adapter{i}", rank=rank, alpha=2.0 * rank, seed=i, std=0.02)))
        for i in range(count)
    ]  # fmt: skip


def _requests(engine: LLMEngine, tag: str, adapters: list[str | None], seed: int) -> list:
    prompts = random_prompts(prompt_vocab(engine), NUM_REQUESTS, PROMPT_LEN, seed)
    params = greedy(OUTPUT_LEN)
    return [(f"{tag}-{i}", prompt, params, {"lora_request": adapters[i % len(adapters)]})
            for i, prompt in enumerate(prompts)]  # fmt: skip


def decode_step_ms(engine: LLMEngine, adapters: list[str | None], steps: int = 32) -> float:
    """Median decode step of 16 sequences at a 64..96-token context."""
    params = greedy(steps + 8)
    requests = [(f"step-{i}", list(range(10, 10 + PROMPT_LEN)), params,
                 {"lora_request": adapters[i % len(adapters)]}) for i in range(CONCURRENCY)]  # fmt: skip
    return offline_decode_step_ms(engine, requests, steps, warm_steps=3, abort=True)


def run(args: argparse.Namespace) -> int:
    model = llama_100m(args.model)
    adapters = build_adapters(model, args.adapters, args.rank)
    common = dict(model=model, dtype="bfloat16", max_num_seqs=CONCURRENCY,
                  max_num_batched_tokens=4096)  # fmt: skip
    base = make_engine(**common)
    lora = make_engine(**common, enable_lora=True, max_loras=args.adapters,
                       max_lora_rank=args.rank, lora_modules=adapters)  # fmt: skip
    names = [a.lora_name for a in adapters]
    cases: dict[str, tuple[LLMEngine, list[str | None]]] = {
        "base": (base, [None]),
        "lora_base_requests": (lora, [None]),
        "lora_adapters": (lora, list(names)),
    }
    rows: dict[str, dict] = {c: {"tok_s_runs": [], "step_ms_runs": []} for c in cases}
    for engine, picks in cases.values():  # warm-up: kernels, allocator, every adapter once
        serve_closed_loop(engine, _requests(engine, "warm", picks, 99)[:CONCURRENCY], CONCURRENCY)
    for r in range(args.runs):
        for case, (engine, picks) in cases.items():  # turns: A B C A B C ...
            tok_s, _ = output_tok_s(engine, _requests(engine, f"{case}{r}", picks, r), CONCURRENCY)
            rows[case]["tok_s_runs"].append(tok_s)
            rows[case]["step_ms_runs"].append(decode_step_ms(engine, picks))
            print(f"run {r} {case}: {rows[case]['tok_s_runs'][-1]:.1f} tok/s, decode step "
                  f"{rows[case]['step_ms_runs'][-1]:.2f} ms", flush=True)  # fmt: skip
    for row in rows.values():
        row["tok_s"] = statistics.median(row["tok_s_runs"])
        row["step_ms"] = statistics.median(row["step_ms_runs"])
        ratios = [a / b for a, b in zip(row["tok_s_runs"], rows["base"]["tok_s_runs"],
                                        strict=True)]  # fmt: skip
        row["vs_base"] = statistics.median(ratios)
    report = {
        "machine": offline_machine(),
        "model": str(model), "adapters": args.adapters, "rank": args.rank, "runs": args.runs,
        "fast_decoder": lora.runner.fast_decoder is not None,
        "adapter_mib": sum(lora.lora.host[n].nbytes for n in names if n in lora.lora.host)
        / 2**20 / 2,  # bf16 in the slots (the host copies are float32)
        "cases": rows,
    }  # fmt: skip
    save_report(report, render(report), args.out, "lora")
    return 0


LABELS = {
    "base": "base model, no --enable-lora",
    "lora_base_requests": "--enable-lora, every request on the base model",
    "lora_adapters": "--enable-lora, requests spread evenly over the adapters",
}


def render(r: dict) -> str:
    """The markdown report."""
    m = r["machine"]
    lines = [
        "# LoRA adapters: output tok/s against the base model",
        "",
        machine_line(m)
        + f" bf16, offline "
        f"engine, {r['model']}; {r['adapters']} PEFT adapters of rank {r['rank']} on all seven "
        f"projections ({r['adapter_mib']:.1f} MiB of bf16 weights in the slots), "
        f"--max-loras {r['adapters']}. {PROMPT_LEN}-token prompts, {OUTPUT_LEN} greedy output "
        f"tokens, {CONCURRENCY} requests in flight, {NUM_REQUESTS} a run; median of "
        f"{r['runs']} runs taken in turns (ratio: per run against the base run of the same "
        "turn, then the median). Decode step: 16 sequences, median of 32 steps.",
        "",
        *md_table("case | output tok/s | vs base | decode step, 16 seqs (ms)", [
            [LABELS.get(case, case), f"{row['tok_s']:.1f}", f"{row['vs_base']:.2f}x",
             f"{row['step_ms']:.2f}"] for case, row in r["cases"].items()], "lrrr"),
    ]  # fmt: skip
    lines += ["", "Per run (tok/s): " + "; ".join(
        f"{c} " + ", ".join(f"{t:.1f}" for t in row["tok_s_runs"])
        for c, row in r["cases"].items())]  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer bench lora",
        description="LoRA adapters: output tok/s with requests spread over adapters vs base",
    )
    add_common(p, model=True, runs=3, out="lora")
    p.add_argument("--adapters", type=int, default=8, help="adapters (all resident)")
    p.add_argument("--rank", type=int, default=16)
    return p


if __name__ == "__main__":
    from infer.bench.cli import main as infer_main

    sys.exit(infer_main(["bench", "lora", *sys.argv[1:]]))

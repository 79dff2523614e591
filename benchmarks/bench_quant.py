"""What quantization buys and costs: ``infer bench quant``.

    infer bench quant [--model DIR] [--runs 3] [--kv-memory 256MiB] [--out bench-results/quant]

(``python benchmarks/bench_quant.py`` runs the same.) Offline engine, no HTTP; every number
below comes from one run of this command on one machine:

1. **Decode speed**, the ~110M bf16 Llama of ``infer bench engine`` (or ``--model``), bf16 weights
   vs ``--quantization int8``: the batch-1 decode step (median over 64 steps at a 64-token
   context, ``--runs`` times) and output tok/s at C = 16 and 64 (64-token prompts, 64 greedy
   output tokens, C requests kept in flight, median of ``--runs``).
2. **Accuracy**, the built-in ``small`` model in bf16 on its own held-out text (the windows its
   training reports a held-out loss on): perplexity with bf16 weights and KV, int8 weights,
   int8 KV, both, and fp8 KV. Each window is one prefill that reads its keys and values back
   from the cache, so a quantized cache costs here what it costs a decode.
3. **Long context at a fixed KV memory** (``--kv-memory``), the ~110M Llama: how many
   1024-in / 128-out requests fit at once with a bf16 vs an int8 cache (read from the engine's
   capacity), and the output tok/s of serving twice that many with that concurrency.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

from infer.bench.cli import add_common
from infer.bench.offline import (
    held_out_windows,
    make_engine,
    perplexity,
    random_decode_step_ms,
    run_load,
)
from infer.bench.report import machine_line, md_table, offline_machine, save_report
from infer.engine.engine import LLMEngine
from infer.testing.bench_models import llama_100m

ACCURACY_CASES = [  # (label, weights, kv cache dtype)
    ("bf16", None, "auto"),
    ("int8 weights", "int8", "auto"),
    ("int8 KV", None, "int8"),
    ("int8 weights + int8 KV", "int8", "int8"),
    ("fp8 KV", None, "fp8"),
    ("w8a8", "w8a8", "auto"),  # where the CPU has AVX-512 VNNI
]


def _weight_methods() -> list[str | None]:
    """bf16, int8 and, where the CPU takes it, w8a8."""
    from infer.runner.quant import w8a8_available

    return [None, "int8"] + (["w8a8"] if w8a8_available(torch.device("cpu")) else [])


def _engine(model: Path, quantization: str | None = None, **options) -> LLMEngine:
    return make_engine(model, dtype="bfloat16", max_num_batched_tokens=4096,
                       quantization=quantization, **options)  # fmt: skip


def speed(model: Path, runs: int) -> dict:
    out = {}
    for quant in _weight_methods():
        engine = _engine(model, quant, max_num_seqs=64, max_model_len=1024)
        run_load(engine, 4, 4, 64, 8, seed=99)  # warm-up
        b1 = [random_decode_step_ms(engine, 1, 64, 64) for _ in range(runs)]
        row: dict = {"weights_bytes": engine.weights_bytes, "decode_b1_ms_runs": b1,
                     "decode_b1_ms": statistics.median(b1)}  # fmt: skip
        for c in (16, 64):
            tps = [run_load(engine, c, 2 * c, 64, 64, seed=r)["output_tok_s"] for r in range(runs)]
            row[f"tok_s_c{c}_runs"] = tps
            row[f"tok_s_c{c}"] = statistics.median(tps)
        out[quant or "bf16"] = row
        print(f"{quant or 'bf16'}: {row}", flush=True)
        del engine
    return out


def accuracy() -> dict:
    from infer.engine.model_source import resolve_model_path

    model_dir = resolve_model_path("small")
    windows = held_out_windows(model_dir)
    rows = {}
    for label, quant, kv in ACCURACY_CASES:
        if quant not in _weight_methods():
            continue
        rows[label] = {"weights": quant or "bf16", "kv": kv, "perplexity": perplexity(
            model_dir, windows, quant, kv)}  # fmt: skip
        print(f"small {label}: perplexity {rows[label]['perplexity']:.3f}", flush=True)
    base = rows["bf16"]["perplexity"]
    for row in rows.values():
        row["vs_bf16"] = row["perplexity"] / base - 1
    return {"model": str(model_dir), "windows": len(windows), "tokens_per_window":
            windows.shape[1] - 1, "rows": rows}  # fmt: skip


def long_context(model: Path, kv_memory: str, runs: int) -> dict:
    out = {}
    for kv in ("auto", "int8"):
        engine = _engine(model, None, max_num_seqs=256, max_model_len=2048,
                         kv_cache_memory=kv_memory, kv_cache_dtype=kv)  # fmt: skip
        blocks_per_request = math.ceil((1024 + 128) / engine.capacity.block_size)
        fits = engine.capacity.num_blocks // blocks_per_request
        tps = [run_load(engine, fits, 2 * fits, 1024, 128, seed=r)["output_tok_s"]
               for r in range(runs)]  # fmt: skip
        out["bf16" if kv == "auto" else kv] = {
            "kv_tokens": engine.capacity.num_tokens, "bytes_per_token":
            engine.capacity.bytes_per_token, "concurrent_requests": fits,
            "tok_s_runs": tps, "tok_s": statistics.median(tps),
        }  # fmt: skip
        print(f"long context, {kv} KV: {out['bf16' if kv == 'auto' else kv]}", flush=True)
        del engine
    return out


def run(args: argparse.Namespace) -> int:
    model = llama_100m(args.model)
    report = {
        "machine": offline_machine(),
        "model": str(model), "runs": args.runs, "kv_memory": args.kv_memory,
    }  # fmt: skip
    report["speed"] = speed(model, args.runs)
    report["accuracy"] = accuracy()
    report["long_context"] = long_context(model, args.kv_memory, args.runs)
    save_report(report, render(report), args.out, "quant")
    return 0


def render(r: dict) -> str:
    sp, acc, lc = r["speed"], r["accuracy"], r["long_context"]
    b, q = sp["bf16"], sp["int8"]
    speed = [[name, f"{row['weights_bytes'] / 2**20:.0f}", f"{row['decode_b1_ms']:.2f}",
              f"{row['tok_s_c16']:.1f}", f"{row['tok_s_c64']:.1f}"] for name, row in sp.items()]  # fmt: skip
    ppl = [[row["weights"], row["kv"] if row["kv"] != "auto" else "bf16", f"{row['perplexity']:.3f}",
            f"{100 * row['vs_bf16']:+.2f}%"] for row in acc["rows"].values()]  # fmt: skip
    fits = [[name, row["bytes_per_token"], row["kv_tokens"], row["concurrent_requests"],
             f"{row['tok_s']:.1f}"] for name, row in lc.items()]  # fmt: skip
    lines = [
        "# Quantization: speed, accuracy, capacity",
        "",
        machine_line(r["machine"])
        + f" Model for speed and capacity: `{r['model']}` (bf16). Medians "
        f"of {r['runs']} runs.",
        "",
        "## Decode speed: bf16 vs int8 weights (and w8a8: int8 activations too)",
        "",
        *md_table(
            "weights | weights MiB | batch-1 decode step ms | tok/s C=16 | tok/s C=64",
            speed,
            "lrrrr",
        ),
        "",
        f"int8 / bf16: batch-1 decode {b['decode_b1_ms'] / q['decode_b1_ms']:.2f}x faster "
        f"(target >= 1.6x); C=16 {q['tok_s_c16'] / b['tok_s_c16']:.2f}x, "
        f"C=64 {q['tok_s_c64'] / b['tok_s_c64']:.2f}x.",
        *(
            [
                f"w8a8 / bf16: batch-1 decode {b['decode_b1_ms'] / w['decode_b1_ms']:.2f}x faster; "
                f"C=16 {w['tok_s_c16'] / b['tok_s_c16']:.2f}x, C=64 {w['tok_s_c64'] / b['tok_s_c64']:.2f}x."
            ]
            if (w := sp.get("w8a8"))
            else []
        ),  # fmt: skip
        "",
        f"## Held-out perplexity of `small` (bf16; {acc['windows']} windows of "
        f"{acc['tokens_per_window']} tokens)",
        "",
        *md_table("weights | KV cache | perplexity | vs bf16", ppl, "llrr"),
        "",
        f"## Long context at a fixed KV memory ({r['kv_memory']}; 1024 in / 128 out)",
        "",
        *md_table(
            "KV cache | bytes/token | KV tokens | requests that fit | output tok/s", fits, "lrrrr"
        ),
    ]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer bench quant",
        description="int8 weights / int8 and fp8 KV: decode speed, perplexity, capacity",
    )
    add_common(p, model=True, runs=3, out="quant")
    p.add_argument("--kv-memory", default="256MiB", help="KV memory of the long-context part")
    return p


if __name__ == "__main__":
    from infer.bench.cli import main as infer_main

    sys.exit(infer_main(["bench", "quant", *sys.argv[1:]]))

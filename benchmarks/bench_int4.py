"""What 4-bit weights buy and cost: ``infer bench int4``.

    infer bench int4 [--model DIR] [--methods bf16,int8,int4,w4a8] [--runs 3]
                     [--out bench-results/int4]

(``python benchmarks/bench_int4.py`` runs the same.) Offline engine, no HTTP; every number
comes from one run of this command on one machine:

1. **Batch-1 decode against the memory's read rate**, a random-weight Llama of Llama 3.2 1B's
   shape with a 32,000 vocabulary (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192,
   tied embeddings: 1.04B parameters; built once, or ``--model``): for each weight format,
   the median decode step at a 64-token context, and the bytes a decode step reads (every
   layer's weights as held, the vocabulary projection, not the embedding table: one row of it
   is read). The read rate is measured just before each format's run (a streaming read of a
   buffer the size of the int4 model's weights, best of 10): these VMs' bandwidth drifts, so
   each format is held against the rate of its own moment, and the formats take turns.
2. **Output tok/s at C = 16** (64-token prompts, 64 greedy output tokens, 32 requests).
3. **Accuracy**: held-out perplexity of the built-in ``small`` model with bf16, int8 and
   4-bit weights in groups of 32 / 64 / 128, asymmetric and symmetric, and w4a8.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from infer.bench.cli import add_common
from infer.bench.engine import read_rate
from infer.bench.offline import (
    decode_read_bytes,
    held_out_windows,
    make_engine,
    patched_environ,
    perplexity,
    random_decode_step_ms,
    run_load,
)
from infer.bench.report import machine_line, md_table, offline_machine, save_report
from infer.engine.engine import LLMEngine
from infer.testing.bench_models import build_random_llama

LLAMA_1B_DIR = Path.home() / ".cache/infer/bench/llama-1b"
ACCURACY_CASES = [  # (label, method, group, symmetric)
    ("bf16", None, None, False),
    ("int8", "int8", None, False),
    ("int4 g32", "int4", 32, False),
    ("int4 g64", "int4", 64, False),
    ("int4 g128", "int4", 128, False),
    ("int4 g32 symmetric", "int4", 32, True),
    ("int4 g64 symmetric", "int4", 64, True),
    ("int4 g128 symmetric", "int4", 128, True),
    ("w4a8 g32", "w4a8", 32, False),
]


def build_llama_1b(out: Path = LLAMA_1B_DIR) -> Path:
    """Random-init Llama of Llama 3.2 1B's shape, vocab 32000 (built once)."""
    return build_random_llama(
        out, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, initializer_range=0.02,
    )  # fmt: skip


def _engine(model: Path, method: str | None) -> LLMEngine:
    return make_engine(model, dtype="bfloat16", quantization=method, max_num_seqs=32,
                       max_model_len=512, kv_cache_memory="512MiB")  # fmt: skip


def speed(model: Path, methods: list[str], runs: int) -> dict:
    engines = {m: _engine(model, None if m == "bf16" else m) for m in methods}
    rows: dict[str, dict] = {}
    for m, engine in engines.items():
        run_load(engine, 2, 2, 16, 8, seed=99)  # warm-up
        rows[m] = {"weights_bytes": engine.weights_bytes, "read_bytes": decode_read_bytes(engine),
                   "step_ms_runs": [], "read_GBps_runs": [], "tok_s_c16_runs": []}  # fmt: skip
    probe = min(r["read_bytes"] for r in rows.values())
    for r in range(runs):
        for m, engine in engines.items():  # formats take turns: A B C A B C ...
            rows[m]["read_GBps_runs"].append(read_rate(probe) / 1e9)
            rows[m]["step_ms_runs"].append(random_decode_step_ms(engine, 1, 64, 32))
            rows[m]["tok_s_c16_runs"].append(
                run_load(engine, 16, 32, 64, 64, seed=r)["output_tok_s"]
            )
            print(f"run {r} {m}: step {rows[m]['step_ms_runs'][-1]:.2f} ms, read "
                  f"{rows[m]['read_GBps_runs'][-1]:.1f} GB/s, C=16 "
                  f"{rows[m]['tok_s_c16_runs'][-1]:.1f} tok/s", flush=True)  # fmt: skip
    for row in rows.values():
        row["step_ms"] = statistics.median(row["step_ms_runs"])
        row["read_GBps"] = statistics.median(row["read_GBps_runs"])
        row["tok_s_c16"] = statistics.median(row["tok_s_c16_runs"])
        # per run: the step against the read time of its bytes at that moment's rate
        ratios = [s / (row["read_bytes"] / (g * 1e9) * 1000)
                  for s, g in zip(row["step_ms_runs"], row["read_GBps_runs"], strict=True)]  # fmt: skip
        row["vs_read_time_runs"] = ratios
        row["vs_read_time"] = statistics.median(ratios)
    return rows


def accuracy() -> dict:
    from infer.engine.model_source import resolve_model_path

    model_dir = resolve_model_path("small")
    windows = held_out_windows(model_dir)
    rows = {}
    for label, method, group, symmetric in ACCURACY_CASES:
        env = {} if group is None else {"INFER_INT4_GROUP_SIZE": str(group),
                                        "INFER_INT4_SYMMETRIC": "1" if symmetric else "0"}  # fmt: skip
        try:
            with patched_environ(env):
                rows[label] = {"perplexity": perplexity(model_dir, windows, method, "auto")}
        except ValueError as e:  # w4a8 without VNNI
            print(f"small {label}: skipped ({e})", flush=True)
            continue
        print(f"small {label}: perplexity {rows[label]['perplexity']:.3f}", flush=True)
    base = rows["bf16"]["perplexity"]
    for row in rows.values():
        row["vs_bf16"] = row["perplexity"] / base - 1
    return {"windows": len(windows), "tokens_per_window": windows.shape[1] - 1, "rows": rows}


def run(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else build_llama_1b()
    report = {
        "machine": offline_machine(),
        "model": str(model), "runs": args.runs,
    }  # fmt: skip
    if not args.skip_speed:
        report["speed"] = speed(model, args.methods.split(","), args.runs)
    if not args.skip_accuracy:
        report["accuracy"] = accuracy()
    save_report(report, render(report), args.out, "int4")
    return 0


def render(r: dict) -> str:
    """The markdown report."""
    lines = [
        "# 4-bit weights: decode against the memory's read rate, and accuracy",
        "",
        machine_line(r["machine"]) + f" Model: `{r['model']}` (bf16 checkpoint). Medians of "
        f"{r['runs']} runs; formats take turns, each run's read rate measured just before it.",
        "",
    ]
    if sp := r.get("speed"):
        lines += [
            "## Batch-1 decode step vs the time to read its bytes",
            "",
        ]
        rows = [
            [name, f"{row['weights_bytes'] / 2**20:.0f}", f"{row['read_bytes'] / 2**20:.0f}",
             f"{row['read_GBps']:.1f}", f"{row['step_ms']:.2f}",
             f"{row['read_bytes'] / (row['read_GBps'] * 1e9) * 1000:.2f}",
             f"{row['vs_read_time']:.2f}x", f"{row['tok_s_c16']:.1f}"]
            for name, row in sp.items()
        ]  # fmt: skip
        lines += md_table("weights | held MiB | read per step MiB | read rate GB/s | step ms "
                          "| read time ms | step / read time | tok/s C=16", rows, "lrrrrrrr")  # fmt: skip
        if "int4" in sp:
            ratio = sp["int4"]["vs_read_time"]
            lines += ["", f"int4 batch-1 step / read time: {ratio:.2f}x (target <= 1.3x: "
                      f"{'MET' if ratio <= 1.3 else 'MISSED'})."]  # fmt: skip
            if "bf16" in sp:
                b, q = sp["bf16"], sp["int4"]
                lines.append(
                    f"int4 / bf16: batch-1 step {b['step_ms'] / q['step_ms']:.2f}x faster, "
                    f"C=16 {q['tok_s_c16'] / b['tok_s_c16']:.2f}x."
                )
        lines.append("")
    if acc := r.get("accuracy"):
        lines += [
            f"## Held-out perplexity of `small` ({acc['windows']} windows of "
            f"{acc['tokens_per_window']} tokens; bf16 activations and KV)",
            "",
            *md_table("weights | perplexity | vs bf16", [
                [label, f"{row['perplexity']:.3f}", f"{100 * row['vs_bf16']:+.2f}%"]
                for label, row in acc["rows"].items()], "lrr"),
            "",
        ]  # fmt: skip
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer bench int4",
        description="4-bit weights: batch-1 decode vs the memory's read rate, perplexity",
    )
    p.add_argument("--model", default=None, help="a bf16 checkpoint (default: a ~1B Llama)")
    p.add_argument("--methods", default="bf16,int8,int4,w4a8", help="weight formats, in turns")
    add_common(p, runs=3, out="int4")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    return p


if __name__ == "__main__":
    from infer.bench.cli import main as infer_main

    sys.exit(infer_main(["bench", "int4", *sys.argv[1:]]))

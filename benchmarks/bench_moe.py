"""A mixture of experts' batch-1 decode against a dense model of its active bytes:
``infer bench moe``.

    infer bench moe [--runs 5] [--paths fast,modules,dense] [--out bench-results/moe]

(``python benchmarks/bench_moe.py`` runs the same.) Offline engine, no HTTP, bf16, every number
from one run of this command on one machine:

- **moe**: a random-weight Qwen3-MoE (hidden 1024, 12 layers, 16 query / 4 KV heads of 64, 64
  experts of width 384, top 8, renormalised, 32,000 vocabulary, tied embeddings: 0.97B
  parameters, ~0.18B read per token), as served: the fused C++ decode loop with the C++ expert
  layer (csrc/moe.cpp).
- **modules**: the same model and engine options with ``INFER_FAST_DECODE=0`` and
  ``INFER_MOE_KERNEL=0``: the module code with the torch expert layer (a Python loop over each
  layer's active experts; the same packed expert kernels), i.e. what ran before the C++ layer.
- **dense**: a random Qwen3 of the same attention whose MLP (3072 wide = 8 x 384) holds the
  bytes a token's 8 experts hold, on the same fused decode loop.

Each is the median decode step at a 64-token context (batch 1, and 16 sequences), the models
taking turns run after run (A B C A B C ...), with the bytes one decode step reads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from infer.bench.cli import add_common
from infer.bench.offline import make_engine, patched_environ, random_decode_step_ms
from infer.bench.report import machine_line, md_table, offline_machine, save_report
from infer.engine.engine import LLMEngine

BENCH_DIR = Path.home() / ".cache/infer/bench"
SHAPE = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64)  # fmt: skip
EXPERTS, TOP_K, EXPERT_WIDTH = 64, 8, 384
PATH_ENV = {  # what each path sets while its engine is built and first run
    "fast": {},
    "modules": {"INFER_FAST_DECODE": "0", "INFER_MOE_KERNEL": "0"},
    "dense": {},
}


def _build(out: Path, arch: str, **fields) -> Path:
    """A random-init bf16 checkpoint of ``arch`` (Qwen3MoeForCausalLM / Qwen3ForCausalLM) with
    a 32,000-token BPE tokenizer trained here, saved once into ``out``."""
    if (out / "config.json").exists():
        return out
    import transformers

    from infer.data.train_tokenizer import train_bpe_tokenizer

    tmp = out.with_name(out.name + ".tmp")
    tok = train_bpe_tokenizer(tmp, vocab_size=32000)
    torch.manual_seed(0)
    config_cls = transformers.Qwen3MoeConfig if "Moe" in arch else transformers.Qwen3Config
    cfg = config_cls(
        vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, initializer_range=0.02,
        **SHAPE, **fields,
    )  # fmt: skip
    cfg.architectures = [arch]
    model = getattr(transformers, arch)(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def build_qwen3_moe(out: Path = BENCH_DIR / "qwen3-moe-1b") -> Path:
    """The random Qwen3-MoE above (built once)."""
    return _build(out, "Qwen3MoeForCausalLM", num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                  moe_intermediate_size=EXPERT_WIDTH, intermediate_size=EXPERT_WIDTH * TOP_K,
                  norm_topk_prob=True)  # fmt: skip


def build_dense_twin(out: Path = BENCH_DIR / "qwen3-moe-1b-dense-twin") -> Path:
    """The dense Qwen3 whose MLP holds a token's active expert bytes (built once)."""
    return _build(out, "Qwen3ForCausalLM", intermediate_size=EXPERT_WIDTH * TOP_K)


def step_read_bytes(engine: LLMEngine) -> int:
    """Bytes one batch-1 decode step reads: every weight as held, less the embedding table
    (one row read) and less the routed experts a token does not choose (k of E read)."""
    from infer.bench.offline import decode_read_bytes
    from infer.model.moe import SparseMoE
    from infer.runner.cpu.prepack import model_weight_bytes

    total = decode_read_bytes(engine)
    for m in engine.runner.model.modules():
        if isinstance(m, SparseMoE):
            routed = sum(model_weight_bytes(e) for e in m.experts)
            total -= routed - routed * m.top_k // m.num_experts
    return total


def _engine(model: Path, env: dict[str, str]) -> LLMEngine:
    with patched_environ(env):
        engine = make_engine(model, dtype="bfloat16", max_num_seqs=16, max_model_len=512,
                             kv_cache_memory="512MiB")  # fmt: skip
        random_decode_step_ms(engine, 1, 16, 4)  # warm-up: the expert layers are built on first use
    return engine


def speed(moe: Path, dense: Path, paths: list[str], runs: int) -> dict:
    engines = {p: _engine(dense if p == "dense" else moe, PATH_ENV[p]) for p in paths}
    rows: dict[str, dict] = {}
    for p, engine in engines.items():
        rows[p] = {"fast_decoder": engine.runner.fast_decoder is not None,
                   "weights_bytes": engine.weights_bytes, "read_bytes": step_read_bytes(engine),
                   "step_ms_runs": [], "step16_ms_runs": []}  # fmt: skip
    for r in range(runs):
        for p, engine in engines.items():  # turns: A B C A B C ...
            rows[p]["step_ms_runs"].append(random_decode_step_ms(engine, 1, 64, 32))
            rows[p]["step16_ms_runs"].append(random_decode_step_ms(engine, 16, 64, 16))
            print(f"run {r} {p}: batch 1 {rows[p]['step_ms_runs'][-1]:.2f} ms, batch 16 "
                  f"{rows[p]['step16_ms_runs'][-1]:.2f} ms", flush=True)  # fmt: skip
    for row in rows.values():
        row["step_ms"] = statistics.median(row["step_ms_runs"])
        row["step16_ms"] = statistics.median(row["step16_ms_runs"])
    if "dense" in rows:
        runs_dense = rows["dense"]["step_ms_runs"]
        for row in rows.values():
            # per run: the step against the dense step of the same turn
            ratios = [a / b for a, b in zip(row["step_ms_runs"], runs_dense, strict=True)]
            row["vs_dense_runs"] = ratios
            row["vs_dense"] = statistics.median(ratios)
            row["vs_dense16"] = row["step16_ms"] / rows["dense"]["step16_ms"]
    return rows


def run(args: argparse.Namespace) -> int:
    moe = Path(args.model) if args.model else build_qwen3_moe()
    dense = Path(args.dense_model) if args.dense_model else build_dense_twin()
    report = {
        "machine": offline_machine(),
        "model": str(moe), "dense_model": str(dense), "runs": args.runs,
        "speed": speed(moe, dense, args.paths.split(","), args.runs),
    }  # fmt: skip
    save_report(report, render(report), args.out, "moe")
    return 0


LABELS = {
    "fast": "Qwen3-MoE, fused C++ loop + C++ expert layer (as served)",
    "modules": "Qwen3-MoE, module code + torch expert loop (before)",
    "dense": "dense Qwen3 of the active bytes, fused C++ loop",
}


def render(r: dict) -> str:
    """The markdown report."""
    m = r["machine"]
    rows = [[LABELS.get(p, p), f"{row['weights_bytes'] / 2**20:.0f}", f"{row['read_bytes'] / 2**20:.0f}",
             f"{row['step_ms']:.2f}", f"{row.get('vs_dense', float('nan')):.2f}x",
             f"{row['step16_ms']:.2f}", f"{row.get('vs_dense16', float('nan')):.2f}x"]
            for p, row in r["speed"].items()]  # fmt: skip
    lines = [
        "# Mixture of experts: batch-1 decode against a dense model of the active bytes",
        "",
        machine_line(m)
        + f" bf16, offline "
        f"engine, decode step at a 64-token context, median of {r['runs']} runs taken in "
        "turns (ratio: per run against the dense step of the same turn, then the median).",
        "",
        *md_table("model / path | weights (MiB) | read per step (MiB) | batch 1 (ms) | vs dense "
                  "| batch 16 (ms) | vs dense", rows, "lrrrrrr"),
    ]  # fmt: skip
    lines += ["", "Per run (batch 1, ms): " + "; ".join(
        f"{p} " + ", ".join(f"{t:.2f}" for t in row["step_ms_runs"])
        for p, row in r["speed"].items())]  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer bench moe",
        description="mixture of experts: batch-1 decode vs a dense model of the active bytes",
    )
    p.add_argument("--model", default=None, help="a bf16 Qwen3-MoE (default: a random ~1B one)")
    p.add_argument("--dense-model", default=None, help="its dense twin (default: built)")
    p.add_argument("--paths", default="fast,modules,dense", help="what to time, in turns")
    add_common(p, runs=5, out="moe")
    return p


if __name__ == "__main__":
    from infer.bench.cli import main as infer_main

    sys.exit(infer_main(["bench", "moe", *sys.argv[1:]]))

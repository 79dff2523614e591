"""Prefix caching in wall-clock time on the ~100M Llama (offline engine).

    infer bench prefix [--runs 5] [--out bench-results/prefix]

(``python benchmarks/bench_prefix.py`` runs the same.)

1. Shared system prompt: a 1024-token system prompt + a short unique suffix per request, one
   request at a time. Cold TTFT: prefix caching off. Warm TTFT: caching on, after one request
   has filled the cache. Target: warm / cold <= 0.2.
2. Low-reuse control: unique random prompts (no shared prefix), 16 in flight: output tok/s with
   caching on vs off, alternated run by run. Target: the cache costs <= 3% throughput.
Medians over ``--runs``; both engines are loaded once and measured side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from infer.bench.engine import llama_100m, run_load
from infer.config import EngineConfig
from infer.core.sampling_params import SamplingParams
from infer.engine.engine import LLMEngine


def make_engine(model: Path, dtype: str, prefix: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig.from_kwargs(
            model=str(model),
            dtype=dtype,
            max_model_len=2048,
            max_num_seqs=32,
            max_num_batched_tokens=2048,
            enable_prefix_caching=prefix,
            kv_cache_memory=1 << 30,
        )
    )


def ttft_one(engine: LLMEngine, rid: str, ids: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    ttft, cached = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - t0
                cached = out.num_cached_tokens
    return ttft, cached


def run(args: argparse.Namespace) -> int:
    """``infer bench prefix``: writes ``prefix.json`` and ``prefix.md``."""
    model = llama_100m(args.model)
    gen = torch.Generator().manual_seed(0)
    vocab = 8000
    system = torch.randint(3, vocab, (args.system_tokens,), generator=gen).tolist()

    def suffix() -> list[int]:
        return torch.randint(3, vocab, (16,), generator=gen).tolist()

    cold_engine = make_engine(model, args.dtype, prefix=False)
    warm_engine = make_engine(model, args.dtype, prefix=True)
    for e in (cold_engine, warm_engine):  # warm-up (and fill the warm engine's cache)
        ttft_one(e, "warmup", system + suffix())

    cold, warm, cached = [], [], []
    for r in range(args.runs):
        cold.append(ttft_one(cold_engine, f"c{r}", system + suffix())[0])
        t, c = ttft_one(warm_engine, f"w{r}", system + suffix())
        warm.append(t)
        cached.append(c)
    ratio = statistics.median(warm) / statistics.median(cold)
    print(
        f"cold TTFT {1000 * statistics.median(cold):.0f} ms, warm {1000 * statistics.median(warm):.0f} ms, "
        f"ratio {ratio:.3f}, cached tokens {cached[0]}",
        flush=True,
    )

    off, on = [], []
    for r in range(args.runs):
        # The same 32 unique 128-token prompts (seed r) for both engines; alternate which goes
        # first so drift on a shared machine hits both alike.
        order = [(cold_engine, off), (warm_engine, on)]
        for engine, results in order if r % 2 == 0 else order[::-1]:
            results.append(run_load(engine, 16, 32, 128, 32, seed=1000 + r)["output_tok_s"])
    loss = 1 - statistics.median(on) / statistics.median(off)
    print(
        f"low reuse: off {statistics.median(off):.1f} tok/s, on {statistics.median(on):.1f} tok/s, "
        f"loss {100 * loss:.1f}%",
        flush=True,
    )

    report = {
        "model": str(model),
        "dtype": args.dtype,
        "runs": args.runs,
        "system_tokens": args.system_tokens,
        "cold_ttft_s": cold,
        "warm_ttft_s": warm,
        "warm_cached_tokens": cached,
        "warm_over_cold": ratio,
        "low_reuse_tok_s_off": off,
        "low_reuse_tok_s_on": on,
        "low_reuse_throughput_loss": loss,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix.json").write_text(json.dumps(report, indent=2))
    md = [
        "# Prefix caching in wall-clock time (~100M Llama, offline engine)",
        "",
        f"{args.dtype}; median of {args.runs} runs; cold and warm engines loaded side by side.",
        "",
        "| measurement | cache off | cache on | ratio | target |",
        "|---|---:|---:|---:|---|",
        f"| TTFT, {args.system_tokens}-token shared system prompt + 16 unique tokens (ms) "
        f"| {1000 * statistics.median(cold):.0f} | {1000 * statistics.median(warm):.0f} | {ratio:.3f} | <= 0.2 |",
        f"| low-reuse control, 16 in flight, output tok/s | {statistics.median(off):.1f} "
        f"| {statistics.median(on):.1f} | {statistics.median(on) / statistics.median(off):.3f} | >= 0.97 |",
        "",
        f"Warm requests found {cached[0]} of {args.system_tokens + 16} prompt tokens in the cache.",
    ]
    (out / "prefix.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0

"""Decode step time vs context length, and the share of it spent in attention.

    infer bench decode-curve [--model DIR] [--batch 16] [--contexts 128,256,...,4096]
                             [--steps 8] [--repeats 3] [--out bench-results/decode_curve]

In-process, on the ~110M Llama of ``infer bench engine`` (or ``--model``): one ``LLMEngine``
(``max_model_len`` 4352, a KV pool holding every sequence at full length, a token budget that
prefills a whole prompt in one step). For each context L, ``--batch`` requests with random
L-token prompts are prefilled; then only decode steps remain (every request one token per
step) and ``engine.step()`` is timed, wall clock, step by step: that is the engine's real
decode step, scheduling, batch preparation, forward, sampling and output processing included.

Attention share: the timed steps alternate, ``--steps`` at a time, between the real model and
the same model with the runner's attention backend wrapped in the null one
(``runner/attention/null.py``: each layer's attention returns its query; QKV and output
projections, RoPE and the fused KV store, MLP, norms, LM head, sampling and the engine around
them unchanged). Both run the model's modules (``INFER_FAST_DECODE=0``): the fast forward path
calls the attention kernel itself, where no backend could replace it; so steps here are the
module path's, ~3 ms slower at batch 1. Attention time = median real step -
median no-op step; share = that / median real step. Alternating in short blocks keeps a load
that comes and goes on a shared machine from biasing one side. The prompts are shortened by half
the decode steps so that the timed steps' context is centred on L.

Models whose ``max_position_embeddings`` is below ``--max-model-len`` (the ~110M Llama says
2048) are run from a copy of the folder in ``--out`` whose ``config.json`` says
``--max-model-len`` (weights and tokenizer are symlinks). With default RoPE nothing else
depends on that field; the weights were never trained on such contexts anyway (random init).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

DEFAULT_CONTEXTS = "128,256,512,1024,2048,4096"


def with_context(model: Path, max_model_len: int, out: Path) -> tuple[Path, bool]:
    """``model``, or a copy under ``out`` whose config allows ``max_model_len`` positions.

    Returns the folder and whether it is a derived copy.
    """
    config = json.loads((model / "config.json").read_text())
    if config.get("max_position_embeddings", 0) >= max_model_len:
        return model, False
    derived = out / f"{model.name}-ctx{max_model_len}"
    derived.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        link = derived / f.name
        if f.name == "config.json":
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f.resolve())
    config["max_position_embeddings"] = max_model_len
    (derived / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return derived, True


WARMUP_STEPS = 2
PREFILL_SLACK = 64  # extra max_tokens for requests that decode while others still prefill


def decode_steps(steps: int, repeats: int) -> int:
    """Decode steps after prefill: warm-up, then ``repeats`` x (real block + no-op block)."""
    return WARMUP_STEPS + 2 * repeats * steps


def longest_overshoot(steps: int, repeats: int) -> int:
    """Tokens a sequence reaches beyond its nominal context (prompts are centred, +2 spare)."""
    total = decode_steps(steps, repeats)
    return total - total // 2 + 2


def measure_context(engine, context: int, batch: int, steps: int, repeats: int, seed: int) -> dict:
    """Prefill ``batch`` prompts, then time decode steps, real and with attention a no-op."""
    from infer.bench.offline import greedy, prompt_vocab, random_prompts
    from infer.runner.attention.null import NullAttention

    warm = WARMUP_STEPS
    total_decode = decode_steps(steps, repeats)
    prompt_len = max(context - total_decode // 2, 1)
    # NOTE: generous max_tokens: requests that finish prefill early decode during the others'
    # prefill steps, and must not run out before the timed steps end (they are aborted after).
    params = greedy(total_decode + PREFILL_SLACK)
    ids = [f"ctx{context}-{i}" for i in range(batch)]
    prompts = random_prompts(prompt_vocab(engine), batch, prompt_len, seed)
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)

    started: set[str] = set()
    t0 = time.perf_counter()
    while len(started) < batch:  # prefill: until every request has its first token
        for out in engine.step():
            if out.new_token_ids:
                started.add(out.request_id)
    prefill_s = time.perf_counter() - t0

    runner = engine.runner
    real = runner.attention

    def timed_step() -> tuple[float, float]:
        st = engine.step_times
        f0 = st.forward
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        produced = sum(len(o.new_token_ids) for o in outs)
        if produced != batch:
            raise RuntimeError(f"a decode step produced {produced} tokens, expected {batch}")
        return dt, st.forward - f0

    for _ in range(warm):
        timed_step()
    real_steps, noop_steps, real_fwd, noop_fwd = [], [], [], []
    try:
        for _ in range(repeats):
            for _ in range(steps):
                dt, fwd = timed_step()
                real_steps.append(dt)
                real_fwd.append(fwd)
            runner.attention = NullAttention(real)
            try:
                for _ in range(steps):
                    dt, fwd = timed_step()
                    noop_steps.append(dt)
                    noop_fwd.append(fwd)
            finally:
                runner.attention = real
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()

    step = statistics.median(real_steps)
    noop = statistics.median(noop_steps)
    attn = step - noop
    return {
        "context": context,
        "prompt_len": prompt_len,
        "timed_context_range": [prompt_len + warm + 1, prompt_len + total_decode],
        "batch": batch,
        "prefill_s": prefill_s,
        "step_ms": 1000 * step,
        "step_ms_p10_p90": [1000 * _q(real_steps, 0.1), 1000 * _q(real_steps, 0.9)],
        "forward_ms": 1000 * statistics.median(real_fwd),
        "noop_attention_step_ms": 1000 * noop,
        "noop_attention_forward_ms": 1000 * statistics.median(noop_fwd),
        "attention_ms": 1000 * attn,
        "attention_share": attn / step,
        "tok_s": batch / step,
        "steps_timed": len(real_steps),
    }


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(int(q * len(s)), len(s) - 1)]


def run(args: argparse.Namespace) -> int:
    """``infer bench decode-curve``: writes ``decode_curve.json`` and ``decode_curve.md``."""
    import torch

    from infer.bench.offline import make_engine
    from infer.bench.report import cpu_model, now_iso
    from infer.bench.vs_vllm import OtherLoad, wait_quiet
    from infer.runner.cpu.kernels import cpu_kernels
    from infer.runner.runner import FAST_DECODE_ENV
    from infer.testing.bench_models import llama_100m

    contexts = [int(c) for c in args.contexts.split(",") if c]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = llama_100m(args.model).resolve()
    need = max(contexts) + longest_overshoot(args.steps, args.repeats)
    if need > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len} < the longest context {need}")
    folder, derived = with_context(model, args.max_model_len, out)
    block = 16
    blocks_per_seq = -(-args.max_model_len // block)
    os.environ[FAST_DECODE_ENV] = "0"  # the null backend must be able to replace attention
    engine = make_engine(
        folder,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_model_len,
        block_size=block,
        num_kv_blocks=args.batch * blocks_per_seq,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
    )
    report: dict = {
        "schema": "infer.bench.decode_curve/1",
        "created": now_iso(),
        "model": str(model),
        "model_folder_used": str(folder),
        "derived_config": derived,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "batch": args.batch,
        "max_model_len": args.max_model_len,
        "kv_blocks": engine.capacity.num_blocks,
        "kv_bytes": engine.capacity.total_bytes,
        "steps_per_block": args.steps,
        "repeats": args.repeats,
        "cpu_decode_kernel": cpu_kernels() is not None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "load_before": list(os.getloadavg()),
        "rows": [],
    }
    print(
        f"decode-curve: {folder} ({args.dtype}), batch {args.batch}, KV "
        f"{engine.capacity.total_bytes / 2**30:.2f} GiB, contexts {contexts}",
        flush=True,
    )
    for i, ctx in enumerate(contexts):
        quiet = wait_quiet(args.wait_quiet)
        load = list(os.getloadavg())
        other = OtherLoad(None)
        row = measure_context(engine, ctx, args.batch, args.steps, args.repeats, seed=args.seed + i)
        row |= {"load_before": load, "other_cpu_cores": other.cores(), "quiet_wait": quiet}
        report["rows"].append(row)
        print(
            f"context {ctx}: {row['step_ms']:.1f} ms/step ({row['tok_s']:.0f} tok/s), attention "
            f"{row['attention_ms']:.1f} ms = {100 * row['attention_share']:.0f}% "
            f"(no-op step {row['noop_attention_step_ms']:.1f} ms), load {load[0]:.2f}, "
            f"other CPU {row['other_cpu_cores']:.2f} cores",
            flush=True,
        )
    (out / "decode_curve.json").write_text(json.dumps(report, indent=1) + "\n")
    md = render(report)
    (out / "decode_curve.md").write_text(md)
    print("\n" + md)
    return 0


def render(r: dict) -> str:
    """The markdown report."""
    from infer.bench.report import md_table
    from infer.bench.vs_vllm import QUIET_CORES

    lines = [
        "# Decode step time vs context length",
        "",
        f"{r['created']}. `{r['model']}` ({r['dtype']}; KV cache "
        f"{r.get('kv_cache_dtype', 'auto')}, weights {r.get('quantization') or 'unquantized'}), "
        f"{r['batch']} sequences decoding "
        f"together, `LLMEngine` in-process (max_model_len {r['max_model_len']}, "
        f"{r['kv_blocks']} KV blocks = {r['kv_bytes'] / 2**30:.2f} GiB), torch {r['torch']} "
        f"with {r['torch_threads']} threads, C++ decode kernel: "
        f"{'yes' if r['cpu_decode_kernel'] else 'no (torch path)'}.",
        "",
        "Step = wall time of `engine.step()` with only decodes scheduled (median of "
        f"{r['repeats']} x {r['steps_per_block']} steps). Attention = median step minus median "
        "step with attention a no-op (the null attention backend: each layer's attention "
        "returns its query), "
        "the two alternating in blocks of "
        f"{r['steps_per_block']} steps.",
        "",
        *md_table("context | step ms | p10-p90 ms | forward ms | step ms, attention no-op "
                  "| attention ms | attention share | tok/s | load (1 min) | other CPU (cores)", [
            [x["context"], f"{x['step_ms']:.1f}", "{:.1f}-{:.1f}".format(*x["step_ms_p10_p90"]),
             f"{x['forward_ms']:.1f}", f"{x['noop_attention_step_ms']:.1f}",
             f"{x['attention_ms']:.1f}", f"{100 * x['attention_share']:.0f}%", f"{x['tok_s']:.0f}",
             f"{x['load_before'][0]:.2f}",
             f"{x['other_cpu_cores']:.2f}{' ⚠' if x['other_cpu_cores'] > QUIET_CORES else ''}"]
            for x in r["rows"]], "rrlrrrrrrr"),
        "",
        "Load: `os.getloadavg()` before each context; other CPU: cores used by other processes "
        f"during its measurement (`/proc/stat` minus this process); ⚠ above {QUIET_CORES}: "
        "figures from a busy machine.",
    ]  # fmt: skip
    if r["derived_config"]:
        lines += [
            "",
            f"The model's config allows fewer positions than {r['max_model_len']}: run from "
            f"`{r['model_folder_used']}` (same weights, `max_position_embeddings` raised).",
        ]
    return "\n".join(lines) + "\n"

"""What speculative decoding buys and costs: ``infer bench spec``.

    infer bench spec [--runs 3] [--k 4] [--out bench-results/spec]

(``python benchmarks/bench_spec.py`` runs the same.) Offline engine, no HTTP, the built-in
``small`` model as the target (bf16) and ``small-draft`` (built on first use, same tokenizer) as
the draft. EOS ignored, 512-token prompts, 256 output tokens. Three workloads:

- **code** (input-grounded, greedy): a chunk of a Python standard-library source file, then
  the same chunk again, cut short, as in "repeat / edit this code" requests.
- **prose** (greedy): held-out documentation text to continue.
- **prose-sampled** (temperature 1.0, seeded): the same prompts sampled, where n-gram
  proposals rarely match: what speculation costs when it does not help.

A model as small as ``small`` does not copy its prompt faithfully; greedy, it soon repeats
itself, and n-gram proposals then match its own repetitions as much as the prompt.

For each workload and concurrency C (C requests kept in flight, 4 x C requests or at least 4)
it reports output tok/s with speculation off, with n-gram proposals and with the draft model,
the median of ``--runs`` runs, and the acceptance (accepted / proposed tokens) and mean
acceptance length (tokens per verified proposal run, the sampled one included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from infer.bench.cli import add_common
from infer.bench.offline import make_engine, serve_closed_loop
from infer.bench.report import machine_line, md_table, num, offline_machine, save_report
from infer.core.sampling_params import SamplingParams
from infer.engine.engine import LLMEngine

PROMPT_LEN = 512
OUTPUT_LEN = 256


def code_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` prompts of PROMPT_LEN tokens: a source chunk, then its start again::

        "# file.py\\n" + chunk (400 tokens) + "\\n\\n# The same code again:\\n" + chunk[:m]

    with ``m`` filling the prompt to PROMPT_LEN; the chunk has 400 - m >= OUTPUT_LEN tokens
    left to repeat.
    """
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if p.stat().st_size > 20_000)
    sources = [
        (path.name, tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False))
        for path in files
    ]
    sep = tokenizer.encode("\n\n# The same code again:\n", add_special_tokens=False)
    prompts: list[list[int]] = []
    for part in (1, 2):  # a chunk a third of the way into each file, then two thirds
        for name, ids in sources:
            head = tokenizer.encode(f"# {name}\n", add_special_tokens=False)
            start = part * len(ids) // 3
            chunk = ids[start : start + 400]
            if len(chunk) < 400:
                continue
            m = PROMPT_LEN - len(head) - len(chunk) - len(sep)
            prompts.append(head + chunk + sep + chunk[:m])
            if len(prompts) == n:
                return prompts
    return prompts


def prose_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` PROMPT_LEN-token windows of the held-out documentation text."""
    from infer.builtin.textdata import split_docs
    from infer.data.corpus import load_corpus

    _, val_docs = split_docs(load_corpus())
    ids = tokenizer.encode("\n\n".join(val_docs), add_special_tokens=False)
    return [ids[i * PROMPT_LEN : (i + 1) * PROMPT_LEN] for i in range(n)]


def engine_for(spec: dict | None, concurrency: int) -> LLMEngine:
    return make_engine("small", dtype="bfloat16", max_num_seqs=concurrency,
                       max_num_batched_tokens=max(2048, concurrency * 8),
                       speculative_config=spec)  # fmt: skip


def run_batch(
    engine: LLMEngine, prompts: list[list[int]], concurrency: int, temperature: float = 0.0
) -> dict:
    """Serve every prompt with ``concurrency`` in flight; tok/s and acceptance of this run."""
    s0 = engine.get_stats()
    run = time.perf_counter_ns()
    requests = [
        (
            f"b{run}-{i}",
            prompt,
            SamplingParams(max_tokens=OUTPUT_LEN, temperature=temperature, seed=i, ignore_eos=True),
        )  # fmt: skip
        for i, prompt in enumerate(prompts)
    ]
    done, wall = serve_closed_loop(engine, requests, concurrency)
    tokens = sum(out.num_output_tokens for out in done)
    s1 = engine.get_stats()
    drafts = s1.spec_decode_num_drafts_total - s0.spec_decode_num_drafts_total
    proposed = s1.spec_decode_num_draft_tokens_total - s0.spec_decode_num_draft_tokens_total
    accepted = s1.spec_decode_num_accepted_tokens_total - s0.spec_decode_num_accepted_tokens_total
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "drafts": drafts,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def measure(
    configs: dict, prompts: list[list[int]], concurrency: int, runs: int, temperature: float
) -> dict:
    """Every config at one concurrency, runs interleaved (off, ngram, draft, off, ...) so slow
    spells of a shared machine fall on all of them alike."""
    engines = {name: engine_for(spec, concurrency) for name, spec in configs.items()}
    for engine in engines.values():  # warm-up: kernels, allocator, draft cache
        run_batch(engine, prompts[:concurrency], concurrency, temperature)
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(runs):
        for name, engine in engines.items():
            results[name].append(run_batch(engine, prompts, concurrency, temperature))
    out = {}
    for name, rows in results.items():
        tok_s = [r["tok_s"] for r in rows]
        best = rows[tok_s.index(statistics.median(tok_s))] if runs % 2 else rows[0]
        out[name] = {
            "tok_s_runs": tok_s,
            "tok_s": statistics.median(tok_s),
            "acceptance_rate": best["acceptance_rate"],
            "mean_acceptance_length": best["mean_acceptance_length"],
        }
    base = out["off"]["tok_s"]
    for row in out.values():
        row["speedup"] = row["tok_s"] / base
    return out


def run(args: argparse.Namespace) -> int:
    from infer.engine.model_source import resolve_model_path

    k = args.k
    draft_path = str(resolve_model_path("small-draft"))
    configs = {
        "off": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },  # fmt: skip
        "draft": {"model": draft_path, "num_speculative_tokens": k},
    }
    probe = engine_for(None, 1)
    tokenizer = probe.tokenizer
    del probe
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workloads = {  # name: (prompts, temperature, concurrencies)
        "code": (code_prompts, 0.0, concurrencies),
        "prose": (prose_prompts, 0.0, [c for c in concurrencies if c <= 8]),
        "prose-sampled": (prose_prompts, 1.0, [c for c in concurrencies if c <= 8]),
    }
    report: dict = {
        "machine": offline_machine(),
        "target": "small (bf16)", "draft": "small-draft (bf16)", "k": k, "runs": args.runs,
        "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "configs": configs, "results": {},
    }  # fmt: skip
    for workload, (make, temperature, cs) in workloads.items():
        for c in cs:
            prompts = make(tokenizer, max(4, 4 * c) if c < 16 else 2 * c)
            row = measure(configs, prompts, c, args.runs, temperature)
            report["results"][f"{workload}/c{c}"] = row
            print(workload, c, json.dumps(row), flush=True)
    save_report(report, render(report), args.out, "spec")
    return 0


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def render(r: dict) -> str:
    """The markdown report."""
    rows = []
    for key, row in r["results"].items():
        workload, c = key.split("/c")
        off, ng, dr = row["off"], row["ngram"], row["draft"]
        rows.append([workload, c, f"{off['tok_s']:.1f}", f"{ng['tok_s']:.1f}", f"{ng['speedup']:.2f}x",
                     _pct(ng["acceptance_rate"]), num(ng["mean_acceptance_length"], ".2f"),
                     f"{dr['tok_s']:.1f}", f"{dr['speedup']:.2f}x", _pct(dr["acceptance_rate"]),
                     num(dr["mean_acceptance_length"], ".2f")])  # fmt: skip
    lines = [
        "# Speculative decoding: n-gram and draft-model proposals",
        "",
        machine_line(r["machine"])
        + f" Target `{r['target']}`, draft `{r['draft']}`, "
        f"{r['k']} proposed tokens per step, {r['prompt_len']} in / {r['output_len']} out, "
        "EOS ignored, offline engine; greedy except prose-sampled (temperature 1.0, seeded). "
        f"Output tok/s: median of {r['runs']} interleaved runs. Acceptance: accepted / "
        "proposed tokens; mean length: tokens per verified proposal run (the sampled one "
        "included).",
        "",
        *md_table("workload | C | off tok/s | n-gram tok/s | n-gram speedup | n-gram acceptance "
                  "| n-gram mean length | draft tok/s | draft speedup | draft acceptance "
                  "| draft mean length", rows, "l" + "r" * 10),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer bench spec",
        description="speculative decoding: n-gram and draft-model proposals vs plain decoding",
    )
    add_common(p, runs=3, concurrency="1,8,16,64", out="spec")
    p.add_argument("--k", type=int, default=4, help="proposed tokens per step")
    return p


if __name__ == "__main__":
    from infer.bench.cli import main as infer_main

    sys.exit(infer_main(["bench", "spec", *sys.argv[1:]]))

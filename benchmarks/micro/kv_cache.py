"""KV cache vs recomputing the whole sequence every step (the micro-benchmark's kv-cache cases).

Five named cases (prompt length, generated tokens) and a generation-length sweep at prompt 8.
One request at a time; ``no_cache`` is the engine with ``use_kv_cache=False``.
"""

from __future__ import annotations

import random

from benchmarks.micro.common import (
    MicroRequest,
    corpus_words,
    make_engine,
    median_run,
    prompt_ids,
    run_engine,
    warm_up,
)
from infer.bench.report import fmt, markdown_table

CASES = (
    ("small_smoke_test", 8, 16),
    ("medium_generation", 16, 32),
    ("longer_generation", 16, 48),
    ("heavier_prompt", 32, 32),
    ("near_context_limit", 8, 56),
)
SWEEP_PROMPT = 8
SWEEP = (8, 16, 32, 48, 56)
METHODS = {"no_cache": {"use_kv_cache": False}, "kv_cache": {"use_kv_cache": True}}


def run(model: str, repeats: int = 3, seed: int = 0) -> dict:
    words = corpus_words()
    engines = {m: make_engine(model, max_num_seqs=1, **opts) for m, opts in METHODS.items()}
    for e in engines.values():
        warm_up(e, e.spec.vocab_size)
    tok = next(iter(engines.values())).tokenizer

    def measure(prompt_len: int, gen: int, rng: random.Random) -> dict:
        req = [MicroRequest(prompt_ids(tok, prompt_len, rng, words), gen)]
        out = {}
        for m, e in engines.items():
            r = median_run([run_engine(e, req) for _ in range(repeats)])
            out[m] = r.summary()
        return out

    rng = random.Random(seed)
    cases = [
        {"case": name, "prompt_len": p, "N": n, "methods": measure(p, n, rng)}
        for name, p, n in CASES
    ]
    sweep = [
        {
            "case": f"sweep_{n}",
            "prompt_len": SWEEP_PROMPT,
            "N": n,
            "methods": measure(SWEEP_PROMPT, n, rng),
        }
        for n in SWEEP
    ]
    result = {"suite": "kv-cache", "cases": cases, "sweep": sweep}
    result["markdown"] = markdown(result)
    return result


def _speed(c: dict) -> tuple[str, str, str, str]:
    nc, kv = c["methods"]["no_cache"], c["methods"]["kv_cache"]
    speedup = kv["tokens_per_s"] / nc["tokens_per_s"]
    reduction = 1 - kv["wall_time_s"] / nc["wall_time_s"]
    return (
        fmt(nc["tokens_per_s"], 2),
        fmt(kv["tokens_per_s"], 2),
        f"{speedup:.2f}x",
        f"{reduction * 100:.1f}%",
    )


def markdown(result: dict) -> str:
    head = ["No Cache Tok/s", "KV Cache Tok/s", "Speedup", "Wall Time Reduction"]
    main = markdown_table(
        ["Case", "Prompt Len", "Generated Tokens", *head],
        [[c["case"], str(c["prompt_len"]), str(c["N"]), *_speed(c)] for c in result["cases"]],
    )
    sweep = markdown_table(
        ["Generated Tokens", *head], [[str(c["N"]), *_speed(c)] for c in result["sweep"]]
    )
    ttft_rows = []
    for c in result["cases"]:
        a, b = c["methods"]["no_cache"]["ttft_ms"], c["methods"]["kv_cache"]["ttft_ms"]
        change = (
            f"KV cache {'slower' if b > a else 'faster'} by {abs(b - a):.2f} ms"
            if a is not None and b is not None
            else "—"
        )
        ttft_rows.append([c["case"], f"{fmt(a, 2)} ms", f"{fmt(b, 2)} ms", change])
    ttft = markdown_table(["Case", "No Cache TTFT", "KV Cache TTFT", "Change"], ttft_rows)
    raw = []
    for c in result["cases"]:
        for m, s in c["methods"].items():
            raw.append(
                [
                    c["case"],
                    m,
                    str(s["tokens"]),
                    fmt(s["wall_time_s"], 4),
                    fmt(s["tokens_per_s"], 2),
                    fmt(s["ttft_ms"], 2),
                    fmt(s["max_gap_ms"], 2),
                ]
            )
    raw_t = markdown_table(
        ["Case", "method", "tokens", "wall_time_s", "tokens_per_s", "ttft_ms", "max_gap_ms"], raw
    )
    return "\n\n".join(
        [
            "## KV cache vs no cache",
            main,
            f"### Generation-length sweep (prompt {SWEEP_PROMPT})",
            sweep,
            "### TTFT",
            ttft,
            "### Raw runs (median of repeats)",
            raw_t,
        ]
    )


def chart(result: dict) -> tuple[list[str], dict[str, list[float]], str, str]:
    """Bars for the report PNG: tokens/s per case, no cache vs KV cache."""
    cases = result["cases"]
    runs = {m: [c["methods"][m]["tokens_per_s"] for c in cases] for m in METHODS}
    return [c["case"] for c in cases], runs, "KV cache vs no cache", "generated tokens / s"

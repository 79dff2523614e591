"""Continuous batching vs serving one request at a time (the micro-benchmark's batching cases).

Every case submits all its requests at once. ``sequential`` is the engine with
``max_num_seqs=1``; ``batched`` lets up to the case's max batch decode together (continuous
batching). The last column checks that every configured request completed.
"""

from __future__ import annotations

from benchmarks.micro.common import MicroRequest, prompt_ids, prompt_source, run_case
from infer.bench.report import fmt, markdown_table

# (name, requests configured, max batch, prompt length, generated tokens); context is 64.
CASES = (
    ("small_smoke_test", 8, 4, 8, 16),
    ("more_requests_small_batch", 16, 4, 8, 16),
    ("more_requests_larger_batch", 16, 8, 8, 16),
    ("longer_generations", 16, 8, 8, 40),
    ("heavier_prompt", 16, 8, 32, 16),
    ("stress_batch_capacity", 32, 8, 8, 16),
)


def run(model: str, repeats: int = 3, seed: int = 0) -> dict:
    tok, rng, words = prompt_source(model, seed)
    cases = []
    for name, n, batch, plen, gen in CASES:
        reqs = [MicroRequest(prompt_ids(tok, plen, rng, words), gen) for _ in range(n)]
        seq = run_case(model, {"max_num_seqs": 1}, reqs, repeats, name=f"{name}-sequential")
        bat = run_case(model, {"max_num_seqs": batch, "batching_mode": "continuous"}, reqs,
                       repeats, name=f"{name}-batched")  # fmt: skip
        cases.append(
            {
                "case": name,
                "requests": n,
                "max_batch": batch,
                "prompt_len": plen,
                "generated": gen,
                "sequential": seq.summary(),
                "batched": bat.summary(),
            }
        )
    result = {"suite": "batching", "cases": cases}
    result["markdown"] = markdown(result)
    return result


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if not a or b is None else f"{b / a:.2f}x"


def markdown(result: dict) -> str:
    rows = []
    for c in result["cases"]:
        s, b = c["sequential"], c["batched"]
        rows.append(
            [
                c["case"],
                str(c["requests"]),
                str(c["max_batch"]),
                fmt(s["tokens_per_s"], 2),
                fmt(b["tokens_per_s"], 2),
                _ratio(s["tokens_per_s"], b["tokens_per_s"]),
                _ratio(s["avg_latency_ms"], b["avg_latency_ms"]),
                _ratio(s["ttft_ms"], b["ttft_ms"]),
                f"{b['completed']}/{b['configured']}",
            ]
        )
    header = [
        "Case",
        "Requests Configured",
        "Max Batch",
        "Seq Tok/s",
        "Batched Tok/s",
        "Speedup",
        "Avg Lat Ratio",
        "Avg TTFT Ratio",
        "Batched Completion",
    ]
    return "## Continuous batching vs sequential\n\n" + markdown_table(header, rows)


def chart(result: dict) -> tuple[list[str], dict[str, list[float]], str, str]:
    """Bars for the report PNG: tokens/s per case, sequential vs batched."""
    cases = result["cases"]
    runs = {k: [c[k]["tokens_per_s"] for c in cases] for k in ("sequential", "batched")}
    return [c["case"] for c in cases], runs, "Continuous batching vs sequential", "tokens / s"

"""FCFS vs priority scheduling (with preemption) under a KV-token budget.

Each case fixes a max batch, token budget, prefill chunk and KV tokens (see ``CASES``);
``equal_priority_control`` reuses the small-batch parameters with every priority equal. In each
case low-priority work arrives first and high-priority requests a few steps later. A lower
number is more important. KV tokens become blocks of 4.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.micro.common import MicroRequest, prompt_ids, prompt_source, ratio_cell, run_case
from infer.bench.report import fmt, markdown_table

BLOCK = 4


@dataclass(frozen=True)
class SchedCase:
    name: str
    max_batch: int
    budget: int
    chunk: int
    kv_tokens: int
    low: int  # low-priority requests at step 0
    high: tuple[int, ...]  # arrival step of each high-priority request
    prompt: int
    gen: int
    low_gen: int | None = None
    equal: bool = False


CASES = (
    SchedCase("priority_inversion_serial", 1, 12, 10, 40, 1, (3,), 8, 8, low_gen=24),
    SchedCase("priority_mix_small_batch", 4, 16, 8, 64, 6, (2, 3), 6, 10),
    SchedCase("memory_pressure_preemption", 3, 12, 8, 32, 4, (3, 4), 6, 10),
    SchedCase("equal_priority_control", 4, 16, 8, 64, 6, (2, 3), 6, 10, equal=True),
)


def requests_for(c: SchedCase, tok, rng: random.Random, words) -> list[MicroRequest]:
    low_p, high_p = (0, 0) if c.equal else (1, 0)
    reqs = [
        MicroRequest(prompt_ids(tok, c.prompt, rng, words), c.low_gen or c.gen, 0, low_p, tag="low")
        for _ in range(c.low)
    ]
    reqs += [
        MicroRequest(prompt_ids(tok, c.prompt, rng, words), c.gen, step, high_p, tag="high")
        for step in c.high
    ]
    return reqs


def run(model: str, repeats: int = 3, seed: int = 0) -> dict:
    tok, rng, words = prompt_source(model, seed)
    cases = []
    for c in CASES:
        reqs = requests_for(c, tok, rng, words)
        base = {
            "max_num_seqs": c.max_batch,
            "max_num_batched_tokens": c.budget,
            "prefill_chunk_size": c.chunk,
            "block_size": BLOCK,
            "num_kv_blocks": c.kv_tokens // BLOCK,
        }
        out = {"case": c.name, "params": base}
        for policy in ("fcfs", "priority"):
            out[policy] = _summary(
                run_case(
                    model,
                    base | {"scheduling_policy": policy},
                    reqs,
                    repeats,
                    name=f"{c.name}-{policy}",
                )  # fmt: skip
            )
        cases.append(out)
    result = {"suite": "scheduling", "cases": cases, "swap": swap_vs_recompute(repeats, seed)}
    result["markdown"] = markdown(result)
    return result


SWAP_CASE = "swap_vs_recompute_long_context"


def swap_vs_recompute(repeats: int = 3, seed: int = 0) -> dict | None:
    """Memory pressure where the victims hold long contexts: preempt by swap vs recompute.

    Runs on the built-in ``small`` model (context 1024): four low-priority requests with
    600-token prompts start first; two high-priority ones arrive later and, the KV pool being
    too small for all six, preempt low-priority requests holding ~600+ tokens each. None if
    the small model is not built (it is never built from here).
    """
    from infer.builtin.cache import builtin_dir, is_complete

    model = builtin_dir("small")
    if not is_complete(model):
        return None
    tok, rng, words = prompt_source(model, seed)
    reqs = [MicroRequest(prompt_ids(tok, 600, rng, words), 48, 0, 1, tag="low") for _ in range(4)]
    reqs += [MicroRequest(prompt_ids(tok, 600, rng, words), 48, s, 0, tag="high") for s in (8, 10)]
    base = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 1024,
        "prefill_chunk_size": 512,
        "block_size": 16,
        "num_kv_blocks": 2688 // 16,  # four 600+48-token requests, not six
        "scheduling_policy": "priority",
    }
    out: dict = {"case": SWAP_CASE, "model": str(model), "params": base}
    for mode in ("recompute", "swap"):
        run = run_case(str(model), base | {"preemption_mode": mode}, reqs, repeats,
                       name=f"{SWAP_CASE}-{mode}")  # fmt: skip
        out[mode] = _summary(run)
    return out


def _summary(r) -> dict:
    """A case run's summary plus the latencies by priority class and the preemption counters."""
    s = r.summary()
    s["high_latency_ms"] = r.avg_latency_ms("high")
    s["low_latency_ms"] = r.avg_latency_ms("low")
    s["preemptions"] = r.stats.get("num_preemptions_total", 0)
    s["recomputed_tokens"] = r.stats.get("recomputed_tokens_total", 0)
    s["swapped_blocks"] = r.stats.get("swapped_out_blocks_total", 0)
    return s


def markdown(result: dict) -> str:
    rows, detail = [], []
    for c in result["cases"]:
        f, p = c["fcfs"], c["priority"]
        rows.append(
            [
                c["case"],
                fmt(f["tokens_per_s"], 2),
                fmt(p["tokens_per_s"], 2),
                ratio_cell(f["tokens_per_s"], p["tokens_per_s"]),
                f"{fmt(f['high_latency_ms'], 2)} ms",
                f"{fmt(p['high_latency_ms'], 2)} ms",
                ratio_cell(f["high_latency_ms"], p["high_latency_ms"]),
                str(p["preemptions"]),
                f"{p['completed']}/{p['configured']}",
            ]
        )
        prm = c["params"]
        detail += [
            f"#### {c['case']}",
            f"max_batch_size={prm['max_num_seqs']} token_budget={prm['max_num_batched_tokens']} "
            f"prefill_chunk_size={prm['prefill_chunk_size']} "
            f"max_kv_tokens={prm['num_kv_blocks'] * prm['block_size']}",
            markdown_table(
                ["Metric", "FCFS", "Priority"],
                [
                    ["Throughput (tok/s)", fmt(f["tokens_per_s"], 2), fmt(p["tokens_per_s"], 2)],
                    ["Avg TTFT (ms)", fmt(f["ttft_ms"], 2), fmt(p["ttft_ms"], 2)],
                    ["Avg latency (ms)", fmt(f["avg_latency_ms"], 2), fmt(p["avg_latency_ms"], 2)],
                    [
                        "High-priority latency (ms)",
                        fmt(f["high_latency_ms"], 2),
                        fmt(p["high_latency_ms"], 2),
                    ],
                    [
                        "Low-priority latency (ms)",
                        fmt(f["low_latency_ms"], 2),
                        fmt(p["low_latency_ms"], 2),
                    ],
                    ["Preemptions", str(f["preemptions"]), str(p["preemptions"])],
                ],
            ),
        ]
    header = [
        "Case",
        "FCFS Tok/s",
        "Priority Tok/s",
        "Throughput Ratio",
        "FCFS High-Priority Latency",
        "Priority High-Priority Latency",
        "High-Priority Latency Ratio",
        "Preemptions",
        "Completion",
    ]
    parts = ["## FCFS vs priority scheduling", markdown_table(header, rows), *detail]
    sw = result.get("swap")
    if sw:
        rc, sp = sw["recompute"], sw["swap"]
        parts += [
            f"## Swap vs recompute under memory pressure ({SWAP_CASE})",
            f"Built-in small model, priority policy, params {sw['params']}.",
            markdown_table(
                ["Metric", "Recompute", "Swap"],
                [
                    ["Throughput (tok/s)", fmt(rc["tokens_per_s"], 2), fmt(sp["tokens_per_s"], 2)],
                    [
                        "Avg latency (ms)",
                        fmt(rc["avg_latency_ms"], 2),
                        fmt(sp["avg_latency_ms"], 2),
                    ],
                    [
                        "High-priority latency (ms)",
                        fmt(rc["high_latency_ms"], 2),
                        fmt(sp["high_latency_ms"], 2),
                    ],
                    [
                        "Low-priority latency (ms)",
                        fmt(rc["low_latency_ms"], 2),
                        fmt(sp["low_latency_ms"], 2),
                    ],
                    ["Preemptions", str(rc["preemptions"]), str(sp["preemptions"])],
                    [
                        "Recomputed tokens",
                        str(rc["recomputed_tokens"]),
                        str(sp["recomputed_tokens"]),
                    ],
                    ["Swapped-out blocks", str(rc["swapped_blocks"]), str(sp["swapped_blocks"])],
                    [
                        "Completion",
                        f"{rc['completed']}/{rc['configured']}",
                        f"{sp['completed']}/{sp['configured']}",
                    ],
                ],
            ),
        ]
    return "\n\n".join(parts)


def chart(result: dict) -> tuple[list[str], dict[str, list[float]], str, str]:
    """Bars for the report PNG: high-priority latency per case, FCFS vs priority."""
    cases = result["cases"]
    runs = {k: [c[k]["high_latency_ms"] or 0.0 for c in cases] for k in ("fcfs", "priority")}
    return [c["case"] for c in cases], runs, "High-priority latency", "latency (ms)"

"""Chunked prefill vs whole-prompt prefill (the micro-benchmark's chunked-prefill cases).

Each case starts a few short-prompt "decode" streams, then long prompts arrive at fixed engine
steps while those streams are decoding. ``normal`` prefills each prompt in one forward pass
(a token budget larger than any prompt); ``chunked`` splits prompts into ``chunk`` tokens under a
per-step ``budget``. The two knob cases vary the chunk (``smaller_chunks_smoother_decode``:
chunk 4 / budget 16, ``larger_chunks_less_overhead``: chunk 16 / budget 32); the other cases use
chunk 8 / budget 16. Gaps are measured on the decode
streams, which are what a long prefill interrupts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.micro.common import MicroRequest, prompt_ids, prompt_source, ratio_cell, run_case
from infer.bench.report import fmt, markdown_table


@dataclass(frozen=True)
class ChunkCase:
    name: str
    chunk: int
    budget: int
    decode_streams: int
    decode_gen: int
    long_prompts: tuple[int, ...]  # arrival step of each long prompt
    long_len: int = 40
    long_gen: int = 8
    decode_prompt: int = 4


CASES = (
    ChunkCase("small_smoke_test", 8, 16, 2, 24, (4, 8)),
    ChunkCase("more_long_prompts", 8, 16, 2, 32, (4, 6, 8, 10), long_len=48),
    ChunkCase("smaller_chunks_smoother_decode", 4, 16, 3, 32, (4, 8, 12)),
    ChunkCase("larger_chunks_less_overhead", 16, 32, 3, 32, (4, 8, 12)),
    ChunkCase("decode_heavy_pressure", 8, 16, 6, 40, (5, 10, 15)),
    ChunkCase("late_long_prompt_interruptions", 8, 16, 4, 48, (20, 26, 32)),
)
NORMAL_BUDGET = 2048  # larger than any prompt: one forward per prompt


def requests_for(case: ChunkCase, tok, rng: random.Random, words) -> list[MicroRequest]:
    reqs = [
        MicroRequest(prompt_ids(tok, case.decode_prompt, rng, words), case.decode_gen, tag="decode")
        for _ in range(case.decode_streams)
    ]
    reqs += [
        MicroRequest(prompt_ids(tok, case.long_len, rng, words), case.long_gen, step, tag="long")
        for step in case.long_prompts
    ]
    return reqs


def run(model: str, repeats: int = 3, seed: int = 0) -> dict:
    tok, rng, words = prompt_source(model, seed)
    cases = []
    for c in CASES:
        reqs = requests_for(c, tok, rng, words)
        seqs = len(reqs)
        normal = run_case(model, {"max_num_seqs": seqs, "max_num_batched_tokens": NORMAL_BUDGET},
                          reqs, repeats, name=f"{c.name}-normal")  # fmt: skip
        chunked = run_case(
            model,
            {
                "max_num_seqs": seqs,
                "max_num_batched_tokens": c.budget,
                "prefill_chunk_size": c.chunk,
            },
            reqs,
            repeats,
            name=f"{c.name}-chunked",
        )
        out = {"case": c.name, "chunk": c.chunk, "budget": c.budget}
        for label, r in (("normal", normal), ("chunked", chunked)):
            s = r.summary()
            s["decode_max_gap_ms"] = r.max_gap_ms("decode")
            s["decode_avg_gap_ms"] = r.avg_gap_ms("decode")
            s["long_ttft_ms"] = r.avg_ttft_ms("long")
            out[label] = s
        cases.append(out)
    result = {"suite": "chunked-prefill", "cases": cases}
    result["markdown"] = markdown(result)
    return result


def markdown(result: dict) -> str:
    thr, gaps, knobs = [], [], []
    for c in result["cases"]:
        n, k = c["normal"], c["chunked"]
        thr.append(
            [
                c["case"],
                fmt(n["tokens_per_s"], 2),
                fmt(k["tokens_per_s"], 2),
                ratio_cell(n["tokens_per_s"], k["tokens_per_s"]),
                f"{fmt(n['ttft_ms'], 2)} ms",
                f"{fmt(k['ttft_ms'], 2)} ms",
                f"{k['completed']}/{k['configured']}",
            ]
        )
        a, b = n["decode_max_gap_ms"], k["decode_max_gap_ms"]
        verdict = "—" if a is None or b is None else ("Smoother" if b < a else "Chunked worse")
        gaps.append(
            [
                c["case"],
                f"{fmt(a, 2)} ms",
                f"{fmt(b, 2)} ms",
                ratio_cell(a, b),
                f"{fmt(n['decode_avg_gap_ms'], 2)} ms",
                f"{fmt(k['decode_avg_gap_ms'], 2)} ms",
                verdict,
            ]
        )
        knobs.append(
            [
                c["case"],
                str(c["chunk"]),
                str(c["budget"]),
                fmt(k["tokens_per_s"], 2),
                f"{fmt(k['ttft_ms'], 2)} ms",
                f"{fmt(b, 2)} ms",
            ]
        )
    t1 = markdown_table(
        [
            "Case",
            "Normal Gen Tok/s",
            "Chunked Gen Tok/s",
            "Ratio",
            "Normal Avg TTFT",
            "Chunked Avg TTFT",
            "Chunked Completion",
        ],
        thr,
    )
    t2 = markdown_table(
        [
            "Case",
            "Normal Max Gap",
            "Chunked Max Gap",
            "Ratio",
            "Normal Avg Gap",
            "Chunked Avg Gap",
            "Interpretation",
        ],
        gaps,
    )
    t3 = markdown_table(
        [
            "Case",
            "Chunk Size",
            "Token Budget",
            "Chunked Gen Tok/s",
            "Chunked Avg TTFT",
            "Chunked Max Gap",
        ],
        knobs,
    )
    return "\n\n".join(
        [
            "## Chunked prefill vs normal prefill",
            t1,
            "### Decode smoothness (gaps of the decode streams)",
            t2,
            "### Chunk size is a knob",
            t3,
        ]
    )


def chart(result: dict) -> tuple[list[str], dict[str, list[float]], str, str]:
    """Bars for the report PNG: worst decode gap per case, normal vs chunked prefill."""
    cases = result["cases"]
    runs = {k: [c[k]["decode_max_gap_ms"] or 0.0 for c in cases] for k in ("normal", "chunked")}
    return [c["case"] for c in cases], runs, "Worst decode gap", "max gap (ms)"

"""Block-hashed prefix caching, five cases, cache on vs off.

Requests run one after another (each arrives when the previous finished), so a request can
reuse the blocks its predecessors left. Each case has fixed token totals: a shared prefix
(per group, groups interleaved round-robin) plus a unique suffix; blocks of 4 tokens.
``eviction_pressure`` caps the pool at 8 blocks with 6 groups, so every prefix is evicted before
it comes round again; the other cases get a pool of 256 blocks, enough to keep every prefix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.micro.common import MicroRequest, prompt_ids, prompt_source, ratio_cell, run_case
from infer.bench.report import fmt, markdown_table

BLOCK = 4
GEN = 8
POOL_BLOCKS = 256  # 1024 tokens: no eviction unless a case sets max_cache_blocks


@dataclass(frozen=True)
class PrefixCase:
    name: str
    requests: int
    groups: int  # 0: every prompt unique (no shared prefix)
    prefix: int
    suffix: int
    max_cache_blocks: int | None = None


CASES = (
    PrefixCase("shared_prefix_basic", 8, 1, 16, 8),
    PrefixCase("high_reuse_many_requests", 24, 1, 24, 4),
    PrefixCase("multi_prefix_groups", 24, 4, 16, 8),
    PrefixCase("low_reuse_control", 8, 0, 0, 24),
    PrefixCase("eviction_pressure", 24, 6, 16, 8, max_cache_blocks=8),
)


def requests_for(c: PrefixCase, tok, rng: random.Random, words) -> list[MicroRequest]:
    prefixes = [prompt_ids(tok, c.prefix, rng, words) for _ in range(c.groups)]
    reqs = []
    for i in range(c.requests):
        head = prefixes[i % c.groups] if c.groups else ()
        ids = head + prompt_ids(tok, c.suffix, rng, words)
        reqs.append(MicroRequest(ids, GEN, after_previous=True, tag=f"g{i % max(c.groups, 1)}"))
    return reqs


def run(model: str, repeats: int = 3, seed: int = 0) -> dict:
    tok, rng, words = prompt_source(model, seed)
    cases = []
    for c in CASES:
        reqs = requests_for(c, tok, rng, words)
        base = {
            "block_size": BLOCK,
            "kv_cache_backend": "paged",
            "max_num_seqs": 1,
            # room for every group's prefix unless the case caps the cache on purpose
            "num_kv_blocks": c.max_cache_blocks or POOL_BLOCKS,
        }
        out = {
            "case": c.name,
            "requests": c.requests,
            "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
        }
        for label, on in (("no_cache", False), ("prefix_cache", True)):
            r = run_case(model, base | {"enable_prefix_caching": on}, reqs, repeats,
                         name=f"{c.name}-{label}")  # fmt: skip
            s = r.summary()
            s["cached_tokens"] = sum(rec.num_cached_tokens for rec in r.records)
            q = r.stats.get("prefix_cache_queries_total", 0)
            s["hit_rate"] = r.stats.get("prefix_cache_hits_total", 0) / q if q else 0.0
            s["evictions"] = r.stats.get("prefix_cache_evictions_total", 0)
            out[label] = s
        cases.append(out)
    result = {"suite": "prefix-cache", "cases": cases}
    result["markdown"] = markdown(result)
    return result


def markdown(result: dict) -> str:
    main, speed, ttft = [], [], []
    for c in result["cases"]:
        n, p = c["no_cache"], c["prefix_cache"]
        total, cached = c["prompt_tokens"], p["cached_tokens"]
        main.append(
            [
                c["case"],
                str(c["requests"]),
                str(total),
                str(cached),
                str(total - cached),
                f"{cached / total * 100:.1f}%",
                f"{p['hit_rate'] * 100:.1f}%",
                ratio_cell(n["tokens_per_s"], p["tokens_per_s"]),
                str(p["evictions"]),
                f"{p['completed']}/{p['configured']}",
            ]
        )
        speed.append(
            [
                c["case"],
                fmt(n["tokens_per_s"], 2),
                fmt(p["tokens_per_s"], 2),
                ratio_cell(n["tokens_per_s"], p["tokens_per_s"]),
            ]
        )
        ttft.append(
            [
                c["case"],
                f"{fmt(n['ttft_ms'], 2)} ms",
                f"{fmt(p['ttft_ms'], 2)} ms",
                ratio_cell(n["ttft_ms"], p["ttft_ms"]),
            ]
        )
    t1 = markdown_table(
        [
            "Case",
            "Requests",
            "Prompt Tokens",
            "Cached Tokens",
            "Actual Prefill",
            "Prefill Reduction",
            "Hit Rate",
            "Throughput Ratio",
            "Evictions",
            "Completion",
        ],
        main,
    )
    t2 = markdown_table(["Case", "No Cache Gen Tok/s", "Prefix Cache Gen Tok/s", "Ratio"], speed)
    t3 = markdown_table(["Case", "No Cache Avg TTFT", "Prefix Cache Avg TTFT", "Ratio"], ttft)
    return "\n\n".join(["## Prefix caching", t1, "### Wall clock", t2, "### TTFT", t3])


def chart(result: dict) -> tuple[list[str], dict[str, list[float]], str, str]:
    """Bars for the report PNG: actual prefill tokens per case, cache off vs on."""
    cases = result["cases"]
    runs = {
        "no_cache": [float(c["prompt_tokens"]) for c in cases],
        "prefix_cache": [
            float(c["prompt_tokens"] - c["prefix_cache"]["cached_tokens"]) for c in cases
        ],
    }
    return [c["case"] for c in cases], runs, "Prefill tokens actually computed", "tokens"

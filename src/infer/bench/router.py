"""Routing policies through two replicas on Ray Serve (needs the ray and bench extras).

    infer bench router [--model DIR] [--runs 3] [--out bench-results/router]

For each policy (prefix-aware, round-robin, least-loaded) start ``infer serve
--data-parallel-size 2 --enable-prefix-caching --router-policy P``, then run the shared-prefix
workload (:class:`infer.cluster.workload.SharedPrefixWorkload`: 8 sessions with a prefix of
their own take turns, 16 requests each) ``--runs`` times with ``--concurrency`` requests in
flight, the caches reset before each run. Reported per policy: TTFT p50 (median over runs of
each run's p50, measured at the client from the streamed first token), the prefix cache hit
rate (the replicas' summed ``vllm:prefix_cache_hits / queries``), each replica's share of the
requests, and the router's own cost per request (request arrival in the router to the replica
call: read the body, tokenize, hash, choose; from ``/router/stats``).

Each replica's KV pool (``--num-kv-blocks``) defaults to half the prefixes plus room for the
requests in flight: the prefixes fit the two caches together, not one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from infer.bench.online import free_port, launch_server, stop_server
from infer.bench.report import md_table, save_report

POLICIES = ("prefix", "round-robin", "least-loaded")


def add_parser(sub: Any) -> None:
    """Register ``infer bench router``."""
    p = sub.add_parser("router", help="replica routing policies on Ray Serve: TTFT, hit rate")
    p.add_argument("--model", default=None,
                   help="model folder (default: a random-init ~100M Llama, built once)")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--suffix-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="per replica (see above)")
    p.add_argument("--overhead-requests", type=int, default=200,
                   help="sequential 1-token requests timed through the router and through a "
                   "single server (0: skip)")  # fmt: skip
    p.add_argument("--out", default="bench-results/router", help="report folder")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from infer.bench import require_ray_and_bench_extras

    require_ray_and_bench_extras("infer bench router")
    return run(args)


def _start(model: Path, policy: str | None, args: argparse.Namespace, blocks: int, log: Path):
    """``infer serve`` with two replicas under ``policy``, or one plain server (``None``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "infer.server", "--model", str(model), "--served-model-name",
           "m", "--port", str(port), "--dtype", args.dtype, "--enable-prefix-caching",
           "--num-kv-blocks", str(blocks), "--block-size", str(args.block_size),
           "--torch-threads", "1", "--no-dashboard"]  # fmt: skip
    if policy is not None:
        cmd += ["--data-parallel-size", "2", "--router-policy", policy]
    return launch_server(cmd, port, log, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         grace_s=120)  # fmt: skip


def _counters(url: str) -> dict[str, float]:
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(("vllm:prefix_cache_", "infer:router_requests_total")):
            key, value = line.rsplit(" ", 1)
            name = key.split("{")[0]
            if name.startswith("infer:router"):
                name = key[key.index('replica="') + 9 :].split('"')[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def _one_run(url: str, requests: list[list[int]], concurrency: int,
                   max_tokens: int) -> list[float]:  # fmt: skip
    """The TTFT of every request (seconds), ``concurrency`` at a time in workload order
    (the online driver's closed loop); any failed request fails the run."""
    from infer.bench.online import closed_loop

    records, _ = await closed_loop(url + "/v1", requests, concurrency, max_tokens)
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0]}")
    return [r.ttft_s for r in sorted(records, key=lambda r: r.index)]


# The overhead phase's prompt: text, so the router's tokenization and hashing are in its cost.
OVERHEAD_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 32


def _sequential_latencies(url: str, n: int) -> list[float]:
    """Client-side latency of ``n`` one-at-a-time requests for 2 tokens of a ~2,000-character
    text prompt (2, not 1: a request that ends in its prefill step leaves no blocks in the
    prefix cache, and this is about the path's cost, not the prefill's)."""
    import httpx

    body = {"model": "m", "prompt": OVERHEAD_PROMPT, "max_tokens": 2, "ignore_eos": True}
    out = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(n + 10):  # the first 10 warm the path up
            t0 = time.perf_counter()
            c.post("/v1/completions", json=body).raise_for_status()
            if i >= 10:
                out.append(time.perf_counter() - t0)
    return out


def overhead(model: Path, args: argparse.Namespace, blocks: int, out: Path) -> dict[str, Any]:
    """What the router path adds per request: the same sequential 2-token requests through two
    replicas (prefix policy) and through one plain server; and the router's own routing time,
    with nothing else running."""
    import httpx

    proc, url = _start(model, "prefix", args, blocks, out / "server-overhead-replicas.log")
    try:
        routed = _sequential_latencies(url, args.overhead_requests)
        stats = httpx.get(url + "/router/stats", timeout=30).json()
    finally:
        stop_server(proc, grace_s=120)
    proc, url = _start(model, None, args, blocks, out / "server-overhead-single.log")
    try:
        direct = _sequential_latencies(url, args.overhead_requests)
    finally:
        stop_server(proc, grace_s=120)
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1e3  # noqa: E731
    return {
        "requests": args.overhead_requests,
        "routed_ms": {"p50": q(routed, 50), "p99": q(routed, 99)},
        "direct_ms": {"p50": q(direct, 50), "p99": q(direct, 99)},
        "prompt_chars": len(OVERHEAD_PROMPT),
        "routing_idle_ms": {k: stats["routing_seconds"][k] * 1e3 for k in ("p50", "p99", "mean")},
        "decision_idle_ms": {k: stats["decision_seconds"][k] * 1e3 for k in ("p50", "p99", "mean")},
    }


def run(args: argparse.Namespace) -> int:
    """``infer bench router``: writes ``router.json`` and ``router.md`` under ``--out``."""
    import httpx

    from infer.cluster.workload import SharedPrefixWorkload
    from infer.testing.bench_models import llama_100m

    model = Path(args.model) if args.model else llama_100m(None)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    workload = SharedPrefixWorkload(prefix_tokens=args.prefix_tokens,
                                    suffix_tokens=args.suffix_tokens, vocab_size=vocab)  # fmt: skip
    prefix_blocks = args.prefix_tokens // args.block_size
    per_request = -(-(args.suffix_tokens + args.max_tokens) // args.block_size) + 1
    blocks = args.num_kv_blocks or (
        workload.num_prefixes // 2 * prefix_blocks + args.concurrency * per_request * 2
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "config": {
            **{k: v for k, v in vars(args).items() if k != "func"},
            "model": str(model),
            "num_kv_blocks_per_replica": blocks,
            "requests_per_run": len(workload.requests()),
            "cpus": os.cpu_count(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
        "policies": {},
    }
    for policy in args.policies.split(","):
        proc, url = _start(model, policy, args, blocks, out / f"server-{policy}.log")
        try:
            # warm-up: compile kernels, first-request costs (not measured)
            asyncio.run(_one_run(url, [r for _, r in workload.requests()[:4]], 2, 2))
            p50s, rates, shares = [], [], []
            for i in range(args.runs):
                w = SharedPrefixWorkload(prefix_tokens=args.prefix_tokens,
                                         suffix_tokens=args.suffix_tokens, vocab_size=vocab,
                                         seed=i + 1)  # fmt: skip
                httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()
                before = _counters(url)
                ttfts = asyncio.run(_one_run(url, [r for _, r in w.requests()],
                                             args.concurrency, args.max_tokens))  # fmt: skip
                after = _counters(url)
                d = {k: after[k] - before.get(k, 0.0) for k in after}
                p50s.append(statistics.median(ttfts))
                rates.append(d["vllm:prefix_cache_hits_total"]
                             / d["vllm:prefix_cache_queries_total"])  # fmt: skip
                sent = [d.get(f"replica-{j}", 0.0) for j in range(2)]
                shares.append(max(sent) / sum(sent))
                print(f"{policy} run {i}: TTFT p50 {p50s[-1] * 1e3:.1f} ms, hit rate "
                      f"{rates[-1]:.3f}, busiest replica {shares[-1]:.0%}", flush=True)  # fmt: skip
            stats = httpx.get(url + "/router/stats", timeout=30).json()
            results["policies"][policy] = {
                "ttft_p50_ms": statistics.median(p50s) * 1e3,
                "ttft_p50_runs_ms": [x * 1e3 for x in p50s],
                "hit_rate": statistics.median(rates),
                "hit_rate_runs": rates,
                "busiest_replica_share": max(shares),
                "routing_ms": {k: (v * 1e3 if v is not None else None)
                               for k, v in stats["routing_seconds"].items() if k != "count"},
                "decision_ms": {k: (v * 1e3 if v is not None else None)
                                for k, v in stats["decision_seconds"].items() if k != "count"},
                "routing_samples": stats["routing_seconds"]["count"],
            }  # fmt: skip
        finally:
            stop_server(proc, grace_s=120)
    if args.overhead_requests > 0:
        results["overhead"] = overhead(model, args, blocks, out)
    save_report(results, render(results), out, "router")
    return 0


def render(results: dict[str, Any]) -> str:
    """The markdown report."""
    c = results["config"]
    lines = [
        "# Replicas on Ray Serve: routing policies",
        "",
        (f"{c['date']}. " if c.get("date") else "")
        + f"Generated by `infer bench router` on {c['cpus']} CPU cores: 2 replicas of `{Path(c['model']).name}` "
        f"({c['dtype']}, 1 torch thread each), {c['num_kv_blocks_per_replica']} KV blocks of "
        f"{c['block_size']} tokens per replica. Workload: 8 prefixes of {c['prefix_tokens']} "
        f"tokens x 16 requests ({c['requests_per_run']} per run, sessions taking turns in a "
        f"random order per round), a {c['suffix_tokens']}-token suffix each, {c['max_tokens']} "
        f"output tokens, {c['concurrency']} in flight; caches reset before each of "
        f"{c['runs']} runs.",
        "",
    ]
    rows = []
    for name, p in results["policies"].items():
        r = p["routing_ms"]
        runs = ", ".join(f"{x:.0f}" for x in p["ttft_p50_runs_ms"])
        rows.append([name, f"{p['ttft_p50_ms']:.1f}", runs, f"{p['hit_rate']:.3f}",
                     f"{p['busiest_replica_share']:.0%}",
                     f"{r['p50']:.2f} / {r['p99']:.2f} / {r['mean']:.2f}",
                     f"{p['decision_ms']['p50']:.3f}"])  # fmt: skip
    lines += md_table("policy | TTFT p50 (ms, median of runs) | runs | hit rate | busiest replica "
                      "| router cost p50 / p99 / mean (ms) | of which deciding, p50 (ms)", rows)  # fmt: skip
    o = results.get("overhead")
    if o:
        r, d = o["routed_ms"], o["direct_ms"]
        i, k = o["routing_idle_ms"], o["decision_idle_ms"]
        paths = md_table("path | latency p50 (ms) | p99 (ms)", [
            ["client -> Serve proxy -> router -> replica (2 replicas)", f"{r['p50']:.2f}",
             f"{r['p99']:.2f}"],
            ["client -> one plain `infer serve`", f"{d['p50']:.2f}", f"{d['p99']:.2f}"]])  # fmt: skip
        lines += [
            "",
            f"Per-request cost of the router path ({o['requests']} sequential requests for two "
            f"tokens of a {o['prompt_chars']}-character text prompt, nothing else running):",
            "",
            *paths,
            "",
            "The router's own work per request (arrival in the router to the replica call) "
            f"with nothing else running: p50 {i['p50']:.3f} ms, p99 {i['p99']:.3f} ms, mean "
            f"{i['mean']:.3f} ms; of which deciding (tokenize, hash the blocks, choose): p50 "
            f"{k['p50']:.3f} ms, p99 {k['p99']:.3f} ms. The rest of the router path's extra "
            "latency is Ray Serve's: the proxy, and one more process hop each way.",
        ]
    return "\n".join(lines) + "\n"

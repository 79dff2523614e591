"""``infer bench gpu``'s HTTP section: one of the offline engine's loads sent to ``infer serve``.

The same prompts (token ids, :func:`infer.bench.gpu.prompts_for`), the same engine settings and
the same closed loop as the offline cell it is compared with — ``C`` streamed completions in
flight, greedy, ``ignore_eos`` — so the ratio of the two is what the HTTP server, its engine
process and the client's streams cost::

    offline : serve_closed_loop(engine)            -> output tok/s
    http    : C clients -> infer serve (engine process) -> output tok/s (usage counts)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WARMUP_TOKENS = 4


def server_command(model: Path, args: argparse.Namespace, port: int) -> list[str]:
    """``infer serve`` with the offline ``graphs`` engine's settings (see ``make_engine``)."""
    cmd = [sys.executable, "-m", "infer.server", "--model", str(model), "--served-model-name",
           "m", "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
           "--dtype", "bfloat16", "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-model-len", str(args.max_model_len), "--seed", str(args.seed),
           "--no-dashboard", "--no-access-log"]  # fmt: skip
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", args.kv_cache_memory]
    return cmd


async def closed_loop(
    url: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> dict[str, Any]:
    """``concurrency`` streams at a time over ``prompts``; output tokens from each stream's usage."""
    import httpx

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for ids in prompts:
        queue.put_nowait(ids)
    body = {"model": "m", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    ttfts: list[float] = []
    gaps: list[float] = []
    tokens = [0]
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                ids = queue.get_nowait()
                t0 = last = time.perf_counter()
                first = True
                async with client.stream("POST", "/v1/completions",
                                         json={**body, "prompt": ids}) as r:  # fmt: skip
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()!r}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            tokens[0] += event["usage"]["completion_tokens"]
                        if not event.get("choices"):
                            continue
                        now = time.perf_counter()
                        (ttfts if first else gaps).append((now - (t0 if first else last)) * 1000)
                        first, last = False, now

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t
    return {
        "requests": len(prompts),
        "output_tokens": tokens[0],
        "wall_s": wall,
        "output_tok_s": tokens[0] / wall,
        "ttft_ms_p50": statistics.median(ttfts) if ttfts else None,
        "itl_ms_p50": statistics.median(gaps) if gaps else None,
    }


def http_section(
    model: Path,
    args: argparse.Namespace,
    load: tuple[int, int, int],
    vocab: int,
    offline: dict | None,
    out: Path,
    log: Callable[[str], None],
    res: dict,
) -> dict:
    """Start ``infer serve``, warm it, run ``load`` (prompt len, output len, C) over HTTP with
    the offline cell's prompts, stop it; ``res`` gets the figures and the ratio to ``offline``
    (that cell's row from the same run, if it ran)."""
    from infer.bench.gpu import load_key, prompts_for
    from infer.bench.online import free_port, launch_server, stop_server

    prompt_len, output_len, c = load
    n = max(args.requests_per_c * c, 2 if c == 1 else c)
    res.update(load=load_key(prompt_len, output_len, c), concurrency=c)
    port = free_port()
    t = time.perf_counter()
    proc, url = launch_server(server_command(model, args, port), port, out / "http_server.log")
    try:
        res["server_start_s"] = time.perf_counter() - t
        log(f"http: infer serve up in {res['server_start_s']:.1f}s")
        warm = prompts_for(vocab, c, prompt_len, seed=97)
        asyncio.run(closed_loop(url, warm, c, WARMUP_TOKENS))
        row = asyncio.run(closed_loop(url, prompts_for(vocab, n, prompt_len, args.seed), c,
                                      output_len))  # fmt: skip
    finally:
        stop_server(proc)
    res.update(row)
    want = n * output_len
    if row["output_tokens"] != want:
        raise RuntimeError(f"{row['output_tokens']} output tokens over HTTP, expected {want}")
    offline_toks = (offline or {}).get("output_tok_s")
    res["offline_tok_s"] = offline_toks
    res["ratio"] = row["output_tok_s"] / offline_toks if offline_toks else None
    log(
        f"http {res['load']}: {row['output_tok_s']:,.0f} tok/s, TTFT p50 "
        f"{row['ttft_ms_p50']:.0f} ms, ITL p50 {row['itl_ms_p50']:.2f} ms"
        + (f"; offline {offline_toks:,.0f} tok/s = {res['ratio']:.2f}x" if offline_toks else "")
    )
    return res

"""What the Responses and Messages APIs cost over the chat route they run on.

    python benchmarks/bench_api_fronts.py [--model FOLDER] [--rounds 5] [--out DIR]

One ``infer serve`` (the tests' tiny Llama unless ``--model``: its steps are short, so the
HTTP side, where the three routes differ, is most of the time), and for each round the same
closed loop on each route in turn: 64 streamed requests, 16 in flight, 64 greedy tokens each
(``ignore_eos``), the same one-message conversation. Output tokens per second of the client,
medians over the rounds after the first (a warm-up), each route's ratio to the chat route:
what turning the reply into output items or content blocks, and their events, costs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

from infer.bench.online import free_port, serving
from infer.bench.report import markdown_table, offline_machine, save_report

CONCURRENCY, REQUESTS, TOKENS = 16, 64, 64
QUESTION = "What is the weather in Paris?"
ROUTES = {
    "chat": ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": TOKENS}),
    "responses": ("/v1/responses", {"input": QUESTION, "max_output_tokens": TOKENS}),
    "messages": ("/v1/messages",
                 {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": TOKENS}),
}  # fmt: skip


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> None:
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for _ in r.aiter_lines():
            pass


async def closed_loop(base: str, route: str) -> float:
    """Output tokens per second of :data:`REQUESTS` streamed requests on ``route``."""
    path, fields = ROUTES[route]
    body = {"model": "tiny", "stream": True, "ignore_eos": True, "temperature": 0, **fields}
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=300) as client:

        async def request() -> None:
            async with gate:
                await _one(client, base + path, body)

        start = time.perf_counter()
        await asyncio.gather(*[request() for _ in range(REQUESTS)])
        return REQUESTS * TOKENS / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (default: the tests' tiny Llama)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench-results/api-fronts")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from infer.testing.checkpoints import build_all

        model = str(build_all()["llama"])
    port = free_port()
    cmd = [sys.executable, "-m", "infer.server", "--model", model, "--port", str(port),
           "--served-model-name", "tiny", "--max-num-seqs", "32", "--no-access-log"]  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates: dict[str, list[float]] = {route: [] for route in ROUTES}
    with serving(cmd, None, out / "server.log", port) as (_, url, _):
        for r in range(args.rounds):
            for route in ROUTES:
                rate = asyncio.run(closed_loop(url, route))
                print(f"round {r} {route}: {rate:.0f} tok/s", flush=True)
                if r:  # (the first round warms up)
                    rates[route].append(rate)
    chat = statistics.median(rates["chat"])
    rows = [[route, f"{statistics.median(v):.0f}", f"{statistics.median(v) / chat:.3f}",
             " / ".join(f"{x:.0f}" for x in v)] for route, v in rates.items()]  # fmt: skip
    machine = offline_machine()
    markdown = "\n".join([
        "# The Responses and Messages APIs against the chat route",
        "",
        f"Machine: {machine['cpu']}, {machine['threads']} threads. Model: {model}. "
        f"{REQUESTS} streamed requests a round, {CONCURRENCY} in flight, {TOKENS} tokens each; "
        f"medians of rounds 2-{args.rounds}.",
        "",
        markdown_table(["route", "output tok/s", "vs chat", "rounds"], rows),
        "",
    ])  # fmt: skip
    report = {"machine": machine, "model": model, "rates": rates}
    save_report(report, markdown, out, "api_fronts")


if __name__ == "__main__":
    main()

"""infer serve vs llama.cpp's llama-server embedding with one GGUF BERT file, over HTTP.

    python benchmarks/peers/embed_vs_llama_server.py --gguf BERT.gguf \\
        --llama-server .../llama.cpp/build/bin/llama-server [--texts 32] [--words 60] \\
        [--requests 4] [--rounds 2] [--out report.md]

The two servers take turns (llama.cpp, infer, llama.cpp, infer, ...), each started fresh, one
warm-up request, then ``--requests`` requests of ``--texts`` texts each (``--words`` words of
Python's own documentation, different every request) sent to ``/v1/embeddings`` one after
another; then ``--texts x --requests`` requests of one text each, 16 at a time (many clients).
Reported: texts embedded per second (medians over the rounds) and the smallest cosine
similarity between the two servers' vectors of the same text. llama-server runs with
``--embedding -np 16 -t 2 -tb 2`` and a batch that holds every sequence; infer serve with its
defaults. The client is this script (httpx): a request is one POST, timed end to end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rerank_vs_llama_server import URLS, documents, server_commands, take_turns  # noqa: E402


def embed(url: str, texts: list[str]) -> list[list[float]]:
    r = httpx.post(url + "/v1/embeddings", json={"input": texts, "model": "m"}, timeout=600)
    r.raise_for_status()
    return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]


def measure(url: str, args: argparse.Namespace) -> dict:
    batches = [documents(args.texts, args.words, i) for i in range(args.requests)]
    embed(url, documents(args.texts, args.words, 999))
    t0 = time.perf_counter()
    vectors = [embed(url, texts) for texts in batches]
    batched = time.perf_counter() - t0
    singles = [t for i in range(args.requests) for t in documents(args.texts, args.words, 100 + i)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda text: embed(url, [text]), singles))
    many = time.perf_counter() - t0
    n = args.requests * args.texts
    return {"batched_texts_s": n / batched, "c16_texts_s": len(singles) / many,
            "vectors": vectors}  # fmt: skip


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--llama-server", required=True)
    p.add_argument("--texts", type=int, default=32)
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("embed_vs_llama_server.md"))
    p.add_argument("--infer-args", default="", help="more flags for infer serve")
    args = p.parse_args()
    servers = server_commands(args, ["--embedding", "-np", "16", "-c", "16384", "-b", "16384",
                                     "-ub", "16384"], ["--served-model-name", "m"])  # fmt: skip
    results = take_turns(servers, URLS, args.rounds, args.out.with_suffix(".logs"),
                         lambda url: measure(url, args))  # fmt: skip
    a, b = (torch.tensor(results[n][0]["vectors"]).flatten(0, 1) for n in servers)
    cosine = torch.nn.functional.cosine_similarity(a, b).min().item()
    lines = [
        f"Machine: {os.uname().machine}, {os.cpu_count()} CPUs. File `{Path(args.gguf).name}`; "
        f"texts of {args.words} words: {args.requests} requests of {args.texts} texts one after "
        f"another, then {args.requests * args.texts} requests of one text, 16 at a time; "
        f"{args.rounds} rounds, the servers taking turns.",
        "",
        "| server | texts / s, batched requests | texts / s, 16 clients |",
        "|---|---:|---:|",
    ]
    for name, runs in results.items():
        lines.append(f"| {name} | {statistics.median(r['batched_texts_s'] for r in runs):.1f} | "
                     f"{statistics.median(r['c16_texts_s'] for r in runs):.1f} |")  # fmt: skip
    lines += ["", f"Smallest cosine similarity between the two servers' vectors: {cosine:.5f}."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

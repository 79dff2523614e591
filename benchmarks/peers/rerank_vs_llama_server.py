"""infer serve vs llama.cpp's llama-server reranking with one GGUF reranker file, over HTTP.

    python benchmarks/peers/rerank_vs_llama_server.py --gguf RERANKER.gguf \\
        --llama-server .../llama.cpp/build/bin/llama-server [--docs 16] [--words 80] \\
        [--requests 3] [--rounds 2] [--out report.md]

The two servers take turns (llama.cpp, infer, llama.cpp, infer, ...), each started fresh, one
warm-up request, then ``--requests`` requests of one query against ``--docs`` documents
(``--words`` words of Python's own documentation each, different every request) sent to
``/v1/rerank`` one after another; then twice as many other requests four at a time. Reported: documents
scored per second (medians over the rounds) and the largest difference between the two
servers' relevance scores for the same (query, document). llama-server runs with
``--reranking -np 8 -t 2 -tb 2`` and a batch that holds a whole pair; infer serve with its
defaults. The client is this script (httpx): a rerank request is one POST, timed end to end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def documents(n: int, words: int, seed: int) -> list[str]:
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics)).split()
    start = (seed * 7919) % (len(text) - n * words)
    return [" ".join(text[start + i * words : start + (i + 1) * words]) for i in range(n)]


QUERIES = ["how does a for loop iterate over a sequence", "what does the with statement do",
           "how are exceptions raised and handled", "what is a class definition"]  # fmt: skip


def start(cmd: list[str], url: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited; see {log}")
        time.sleep(0.5)
    raise SystemExit(f"{cmd[0]} did not come up; see {log}")


def take_turns(servers: dict[str, list[str]], urls: dict[str, str], rounds: int, logs: Path,
               measure: Callable[[str], dict]) -> dict[str, list[dict]]:  # fmt: skip
    """Each round, each server in turn started fresh (its log in ``logs``), ``measure``d at
    its URL and stopped; the measurements by server, in round order."""
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name in servers}
    for rnd in range(1, rounds + 1):
        for name, cmd in servers.items():
            proc = start(cmd, urls[name], logs / f"{name.split()[0]}-r{rnd}.log")
            try:
                results[name].append(measure(urls[name]))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            shown = {k: round(v, 2) for k, v in results[name][-1].items()
                     if isinstance(v, float)}  # fmt: skip
            print(name, rnd, shown, flush=True)
    return results


LLAMA, INFER = "llama.cpp (llama-server)", "infer serve"
URLS = {LLAMA: "http://127.0.0.1:8310", INFER: "http://127.0.0.1:8410"}


def server_commands(args: argparse.Namespace, llama_flags: list[str],
                    infer_flags: list[str]) -> dict[str, list[str]]:  # fmt: skip
    """llama-server and infer serve on ``args.gguf`` at :data:`URLS`, with their own flags
    (and ``args.infer_args`` for infer)."""
    return {
        LLAMA: [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", "8310",
                "-t", "2", "-tb", "2", *llama_flags],
        INFER: [sys.executable, "-m", "infer.cli", "serve", "--model", args.gguf, "--host",
                "127.0.0.1", "--port", "8410", *infer_flags, *args.infer_args.split()],
    }  # fmt: skip


def rerank(url: str, query: str, docs: list[str]) -> list[float]:
    r = httpx.post(url + "/v1/rerank", json={"query": query, "documents": docs}, timeout=600)
    r.raise_for_status()
    scores = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    return [scores[i] for i in range(len(docs))]


def measure(url: str, args: argparse.Namespace) -> dict:
    work = [(QUERIES[i % len(QUERIES)], documents(args.docs, args.words, i))
            for i in range(args.requests)]  # fmt: skip
    rerank(url, "warm up", documents(args.docs, args.words, 999))
    t0 = time.perf_counter()
    scores = [rerank(url, q, d) for q, d in work]
    sequential = time.perf_counter() - t0
    more = [(QUERIES[i % len(QUERIES)], documents(args.docs, args.words, 100 + i))
            for i in range(2 * args.requests)]  # fmt: skip
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda w: rerank(url, *w), more))
    concurrent_s = time.perf_counter() - t0
    docs = args.requests * args.docs
    return {"seq_docs_s": docs / sequential, "c4_docs_s": 2 * docs / concurrent_s,
            "scores": scores}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--llama-server", required=True)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--words", type=int, default=80)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("rerank_vs_llama_server.md"))
    p.add_argument("--infer-args", default="", help="more flags for infer serve, e.g. "
                   "'--no-enable-prefix-caching' (what prefix caching buys)")  # fmt: skip
    args = p.parse_args()
    servers = server_commands(args, ["--reranking", "-np", "8", "-c", "16384", "-b", "4096",
                                     "-ub", "4096"], [])  # fmt: skip
    results = take_turns(servers, URLS, args.rounds, args.out.with_suffix(".logs"),
                         lambda url: measure(url, args))  # fmt: skip
    a, b = (results[n][0]["scores"] for n in servers)
    diff = max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    lines = [
        f"Machine: {os.uname().machine}, {os.cpu_count()} CPUs. File `{Path(args.gguf).name}`; one "
        f"query against {args.docs} documents of {args.words} words a request, {args.requests} "
        f"requests one after another, then {2 * args.requests} four at a time; "
        f"{args.rounds} rounds, the servers taking turns.",
        "",
        "| server | documents / s, one request at a time | documents / s, 4 at a time |",
        "|---|---:|---:|",
    ]
    for name, runs in results.items():
        lines.append(f"| {name} | {statistics.median(r['seq_docs_s'] for r in runs):.1f} | "
                     f"{statistics.median(r['c4_docs_s'] for r in runs):.1f} |")  # fmt: skip
    lines += ["", f"Largest difference between the two servers' relevance scores: {diff:.4f}."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""``infer bench overload``: how fast an overloaded server says no.

Starts ``infer serve`` with a small bound (``--max-num-seqs 4 --max-queued-requests 8`` by
default) and fires ``--requests`` requests at once from ``--processes`` client processes (each writes raw
HTTP/1.1 on connections it opened beforehand, all released at the same instant), so the client
is not the bottleneck. Reports how many got 429 (and whether each carried ``Retry-After``), the 429s'
latency percentiles as the clients measured them, and whether every accepted request completed
with its full token count. Rounds repeat and the median round is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

MAX_TOKENS = 16


async def _http_post(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, dict[str, str], bytes]:
    """One request on a kept-alive connection, with as little client work as possible (raw
    HTTP/1.1 over asyncio streams: an HTTP library's own overhead would be what is measured)."""
    writer.write(request)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {
        k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
    }
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


async def _fire(url: str, n: int, start_at: float) -> list[dict]:
    host, port = url.split("//")[1].split(":")
    payload = json.dumps({"model": "m", "prompt": "Hello there", "max_tokens": MAX_TOKENS,
                          "ignore_eos": True, "temperature": 0}).encode()  # fmt: skip
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    # Open the connections first, so the burst measures the server, not TCP handshakes.
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(n)]

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> dict:
        t0 = time.perf_counter()
        status, headers, body = await _http_post(reader, writer, request)
        ms = 1000 * (time.perf_counter() - t0)
        tokens = json.loads(body)["usage"]["completion_tokens"] if status == 200 else None
        writer.close()
        return {"status": status, "ms": ms, "retry_after": headers.get("retry-after"),
                "tokens": tokens}  # fmt: skip

    await asyncio.sleep(max(0.0, start_at - time.time()))
    return await asyncio.gather(*(one(r, w) for r, w in conns))


NEEDS_BENCH_EXTRA = False
"""It runs without the ``bench`` extra (``infer bench`` checks for it otherwise)."""


def _client(url: str, n: int, start_at: float, out: mp.Queue) -> None:
    out.put(asyncio.run(_fire(url, n, start_at)))


def burst(url: str, num_requests: int, processes: int) -> list[dict]:
    """``num_requests`` requests released at one instant from ``processes`` processes."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    start_at = time.time() + 3.0  # every process is up and connected by then
    shares = [num_requests // processes + (i < num_requests % processes) for i in range(processes)]
    procs = [ctx.Process(target=_client, args=(url, k, start_at, out)) for k in shares]
    for p in procs:
        p.start()
    results = [r for _ in procs for r in out.get(timeout=300)]
    for p in procs:
        p.join()
    return results


def summarize(results: list[dict]) -> dict:
    from infer.bench.metrics import percentile

    def pct(values: list[float], p: float) -> float | None:
        return percentile(values, p) if values else None

    refused = [r for r in results if r["status"] == 429]
    accepted = [r for r in results if r["status"] == 200]
    ms = [r["ms"] for r in refused]
    return {
        "requests": len(results),
        "accepted": len(accepted),
        "refused_429": len(refused),
        "other": sorted({r["status"] for r in results} - {200, 429}),
        "all_429_have_retry_after": all(r["retry_after"] for r in refused),
        "accepted_full_tokens": all(r["tokens"] == MAX_TOKENS for r in accepted),
        "refused_ms": {
            "p50": pct(ms, 50),
            "p90": pct(ms, 90),
            "p99": pct(ms, 99),
            "max": max(ms) if ms else None,
        },  # fmt: skip
        "accepted_ms_p50": pct([r["ms"] for r in accepted], 50),
    }


def run(args: argparse.Namespace) -> int:
    from infer.bench.online import serving

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    else:
        from infer.testing.checkpoints import build_tiny_checkpoint, default_root

        model = build_tiny_checkpoint("llama", default_root())
    cmd = [sys.executable, "-m", "infer.server", "--model", str(model), "--port", str(args.port),
           "--served-model-name", "m", "--max-num-seqs", str(args.max_num_seqs),
           "--max-queued-requests", str(args.max_queued_requests), "--no-access-log"]  # fmt: skip
    rounds = []
    with serving(cmd, dict(os.environ), out / "overload-server.log", args.port) as (_, url, _):
        for i in range(args.rounds):
            s = summarize(burst(url, args.requests, args.processes))
            print(f"round {i + 1}: {json.dumps(s)}", flush=True)
            rounds.append(s)
            time.sleep(2)
    rounds.sort(key=lambda s: s["refused_ms"]["p99"] or 0)
    median = rounds[len(rounds) // 2]
    p99s = [s["refused_ms"]["p99"] for s in rounds if s["refused_ms"]["p99"] is not None]
    from infer.bench.report import collect_environment, now_iso, save_report

    report = {
        "schema": "infer.bench.overload/1",
        "created": now_iso(),
        "model": str(model),
        "settings": {
            k: getattr(args, k)
            for k in ("requests", "processes", "rounds", "max_num_seqs", "max_queued_requests")
        },  # fmt: skip
        "rounds": rounds,
        "median_round": median,
        "refused_p99_ms_per_round": p99s,
        "target_p99_ms": 50.0,
        "pass": bool(p99s) and statistics.median(p99s) < 50.0,
        "environment": collect_environment(),
    }
    save_report(report, render(report), out, "overload")
    return 0


def render(report: dict) -> str:
    """The markdown report."""
    from infer.bench.report import md_table

    m, s = report["median_round"], report["settings"]
    p99s = ", ".join(f"{x:.0f}" for x in report["refused_p99_ms_per_round"])
    ms = m["refused_ms"]
    table = md_table(
        "accepted | 429 | other | Retry-After on every 429 | accepted got all tokens "
        "| 429 p50 ms | 429 p90 ms | 429 p99 ms | 429 max ms",
        [[m["accepted"], m["refused_429"], m["other"] or "-", m["all_429_have_retry_after"],
          m["accepted_full_tokens"], *(f"{ms[k]:.1f}" for k in ("p50", "p90", "p99", "max"))]],
    )  # fmt: skip
    return (
        "# Overload: how fast a full server says no\n\n"
        f"{report['created']}. `infer serve --max-num-seqs {s['max_num_seqs']} "
        f"--max-queued-requests {s['max_queued_requests']}` on the tiny test Llama; "
        f"{s['requests']} requests released at one instant from {s['processes']} client "
        f"processes (connections opened beforehand), {s['rounds']} rounds, median round by "
        "429 p99. Generated by `infer bench overload`.\n\n"
        + "\n".join(table)
        + f"\n\n429 p99 per round (ms): {p99s}. Target: p99 < 50 ms — "
        f"**{'PASS' if report['pass'] else 'MISS'}** (median over rounds).\n"
    )


def build_parser() -> argparse.ArgumentParser:
    from infer.bench.cli import add_common

    p = argparse.ArgumentParser(
        prog="infer bench overload", description="429 latency of a full server under a burst"
    )
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny test Llama)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-queued-requests", type=int, default=8)
    p.add_argument("--port", type=int, default=8301)
    add_common(p, out="overload")  # the committed report: --out benchmarks/reports
    return p


if __name__ == "__main__":
    from infer.bench.cli import main as infer_main

    sys.exit(infer_main(["bench", "overload", *sys.argv[1:]]))

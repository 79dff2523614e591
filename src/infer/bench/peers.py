"""infer vs peers over HTTP, side by side in one run, on the same model folder and prompts.

    infer bench peers [--model DIR] [--peers infer,vllm] [--concurrency 1,16,64] [--runs 3]
                      [--dtype bfloat16] [--out bench-results/peers]

(``python benchmarks/bench_peers.py`` runs the same.)

Each server is started in turn on the same machine (only one runs at a time), warmed up with
two requests, then driven closed-loop: C streaming requests in flight, 2*C (min 8) requests
per run, each a 64-token prompt (token ids) and 64 greedy output tokens with ignore_eos.
Reported per server and concurrency: output tok/s (median over runs), TTFT and ITL percentiles.

Peers (each installed in its own virtual environment, outside this repository):
- ``infer``: ``python -m infer.server`` of this installation.
- ``vllm``: vLLM's CPU build in the virtual environment ``$VLLM_VENV`` (default
  ``~/peers/vllm``, its ``bin/vllm``), its OpenMP threads bound to cores 0-1.
- ``llamacpp`` (``infer bench vs-vllm`` only): llama.cpp's own ``llama-server`` on a GGUF file
  (``$LLAMACPP_BIN``, or ``llama-server`` on ``PATH``), one slot per sequence, every core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from infer.bench.client import RequestRecord, new_client, stream_request
from infer.bench.metrics import percentile
from infer.bench.offline import random_prompts
from infer.bench.online import serving
from infer.bench.report import save_report
from infer.testing.bench_models import llama_100m

VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
}
"""Environment of vLLM's CPU build (server and ``vllm bench`` client): offline, 2 GiB of KV
(infer's CPU default too), OpenMP threads on cores 0-1."""


def vllm_venv() -> Path:
    """The virtual environment of vLLM's CPU build: ``$VLLM_VENV``, default ``~/peers/vllm``."""
    return Path(os.environ.get("VLLM_VENV", Path.home() / "peers" / "vllm"))


def llamacpp_bin() -> str:
    """llama.cpp's ``llama-server``: ``$LLAMACPP_BIN``, else the one on ``PATH``."""
    return os.environ.get("LLAMACPP_BIN") or shutil.which("llama-server") or "llama-server"


def llamacpp_version(binary: str | Path, timeout_s: float = 60) -> str | None:
    """What ``llama-server --version`` prints (its build number and commit, the compiler), or
    None where it cannot run."""
    try:
        r = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.SubprocessError):
        return None
    text = "\n".join(x.strip() for x in (r.stdout, r.stderr) if x.strip())
    return text or None


def server_command(
    peer: str,
    model: Path,
    port: int,
    dtype: str,
    max_seqs: int,
    extra: str = "",
    *,
    max_model_len: int = 1024,
    served_name: str = "m",
    llamacpp_binary: str | Path | None = None,
    threads: int | None = None,
) -> tuple[list[str], dict]:
    """The command line and environment that start ``peer`` on ``model``.

    ``infer`` and ``vllm`` serve a model folder in ``dtype``. ``llamacpp`` serves a GGUF file
    (``model``; its tensors' types are the file's, ``dtype`` does not apply) with ``llama-server``
    (``llamacpp_binary``, default :func:`llamacpp_bin`): ``max_seqs`` parallel slots sharing a
    context of ``max_seqs * max_model_len`` tokens (``max_model_len`` per slot), ``threads``
    (default: every core) for decoding and for prompts alike.
    """
    env = dict(os.environ)
    # infer and vLLM take the same serving flags, by the same names.
    serving_flags = ["--port", str(port), "--dtype", dtype, "--max-num-seqs", str(max_seqs),
                     "--max-model-len", str(max_model_len), "--served-model-name", served_name]  # fmt: skip
    if peer == "infer":
        cmd = [sys.executable, "-m", "infer.server", "--model", str(model), *serving_flags,
               "--no-access-log", *shlex.split(extra)]  # fmt: skip
        return cmd, env
    if peer == "vllm":
        env.update(VLLM_ENV)
        cmd = [str(vllm_venv() / "bin" / "vllm"), "serve", str(model), "--host", "127.0.0.1",
               *serving_flags, *shlex.split(extra)]  # fmt: skip
        return cmd, env
    if peer == "llamacpp":
        n = str(threads or os.cpu_count() or 1)
        cmd = [
            str(llamacpp_binary or llamacpp_bin()),
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            str(max_seqs),
            "-c",
            str(max_seqs * max_model_len),
            "-t",
            n,
            "-tb",
            n,
            "--alias",
            served_name,
            *shlex.split(extra),
        ]
        return cmd, env
    raise SystemExit(f"unknown peer {peer!r} (known: infer, vllm, llamacpp)")


async def closed_loop(
    base: str, prompts: list[list[int]], concurrency: int, out_len: int
) -> tuple[list[RequestRecord], float]:
    queue = list(enumerate(prompts))
    records: list[RequestRecord] = []
    async with new_client() as client:

        async def worker() -> None:
            while queue:
                i, ids = queue.pop(0)
                rec = RequestRecord(
                    index=i, prompt_len_target=len(ids), max_tokens=out_len, scheduled_s=0.0
                )
                payload = {
                    "model": "m",
                    "prompt": ids,
                    "max_tokens": out_len,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                records.append(await stream_request(client, base, payload, rec))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - t0


def summarize(records: list[RequestRecord], wall: float) -> dict:
    ok = [r for r in records if r.success]
    ttft = [1000 * r.ttft_s for r in ok]
    itl = [1000 * x for r in ok for x in r.itls_s]
    return {
        "completed": len(ok),
        "configured": len(records),
        "output_tok_s": sum(r.output_tokens or 0 for r in ok) / wall,
        "ttft_ms": {f"p{p}": percentile(ttft, p) for p in (50, 95, 99)},
        "itl_ms": {f"p{p}": percentile(itl, p) for p in (50, 95, 99)},
        "errors": sorted({r.error for r in records if r.error})[:3],
    }


def bench_peer(peer: str, args: argparse.Namespace, model: Path, port: int) -> dict:
    """Start ``peer``, warm it up, measure every concurrency ``args.runs`` times (the median
    run is kept), stop it (always)."""
    extra = args.infer_args if peer == "infer" else ""
    cmd, env = server_command(peer, model, port, args.dtype, max(args.concurrency), extra)
    with serving(cmd, env, Path(args.out) / f"{peer}-server.log", port) as (_, url, startup):
        print(f"{peer}: healthy after {startup:.0f} s", flush=True)
        gen = torch.Generator().manual_seed(42)

        def prompts(n: int) -> list[list[int]]:
            return random_prompts(8000, n, args.prompt_len, gen)

        asyncio.run(closed_loop(url + "/v1", prompts(2), 2, 8))  # warm-up
        rows = {}
        for c in args.concurrency:
            runs = []
            for _ in range(args.runs):
                records, wall = asyncio.run(
                    closed_loop(url + "/v1", prompts(max(2 * c, 8)), c, args.output_len)
                )
                runs.append(summarize(records, wall))
            runs.sort(key=lambda r: r["output_tok_s"])
            row = runs[len(runs) // 2]
            row["output_tok_s_runs"] = [r["output_tok_s"] for r in runs]
            rows[str(c)] = row
            print(
                f"{peer} c={c}: {row['output_tok_s']:.1f} tok/s {[round(r) for r in row['output_tok_s_runs']]} "
                f"TTFT p50 {row['ttft_ms']['p50']:.0f} ms ITL p50 {row['itl_ms']['p50']:.1f} ms "
                f"({row['completed']}/{row['configured']})",
                flush=True,
            )
        return {"startup_s": startup, "load": rows}


def run(args: argparse.Namespace) -> int:
    """``infer bench peers``: each peer in turn; writes ``peers.json`` and ``peers.md``."""
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model = llama_100m(args.model)
    results = {}
    for peer in args.peers.split(","):
        try:
            results[peer] = bench_peer(peer, args, model, args.port)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
            print(f"{peer}: FAILED: {e}", flush=True)
            results[peer] = {"error": str(e)}
    report = {
        "model": str(model),
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "runs": args.runs,
        "results": results,
    }
    save_report(report, render(report, args.concurrency), args.out, "peers")
    return 1 if any("error" in r for r in results.values()) else 0


def render(report: dict, concurrency: list[int]) -> str:
    res = report["results"]
    lines = [
        "# infer vs peers over HTTP (same machine, same run, same prompts)",
        "",
        f"Model {Path(report['model']).name}, {report['dtype']}; {report['prompt_len']}-token prompts, "
        f"{report['output_len']} greedy output tokens, ignore_eos; closed loop, median of {report['runs']} runs.",
        "",
        "| server | concurrency | output tok/s | runs | TTFT p50 / p95 ms | ITL p50 / p95 ms | done |",
        "|---|---:|---:|---|---|---|---|",
    ]
    for peer, r in res.items():
        if "error" in r:
            lines.append(f"| {peer} | - | failed: {r['error'][:80]} | | | | |")
            continue
        for c in concurrency:
            row = r["load"][str(c)]
            lines.append(
                f"| {peer} | {c} | {row['output_tok_s']:.1f} | {', '.join(f'{x:.0f}' for x in row['output_tok_s_runs'])} "
                f"| {row['ttft_ms']['p50']:.0f} / {row['ttft_ms']['p95']:.0f} | {row['itl_ms']['p50']:.1f} / {row['itl_ms']['p95']:.1f} "
                f"| {row['completed']}/{row['configured']} |"
            )
    if (
        "infer" in res
        and "vllm" in res
        and "error" not in res["infer"]
        and "error" not in res["vllm"]
    ):
        lines += ["", "| concurrency | infer / vLLM |", "|---:|---:|"]
        for c in concurrency:
            a = res["infer"]["load"][str(c)]["output_tok_s"]
            b = res["vllm"]["load"][str(c)]["output_tok_s"]
            lines.append(f"| {c} | {a / b:.2f}x |")
    return "\n".join(lines) + "\n"

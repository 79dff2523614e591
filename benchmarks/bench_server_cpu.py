"""The API server's own work: CPU per streamed token and per request, arm against arm.

Starts ``infer serve`` on a tiny random Llama (hidden 64, one layer, float32: the engine's step
is short, so the server's share shows) once per arm and round, drives it from a client process
of its own (the online driver's closed loop, infer's own client: ``C`` streamed completions of
128-token token-id prompts in flight) and reads the API server processes' CPU seconds from
``/proc`` over the load (summed over them with ``--api-server-count``). CPU seconds, not wall
time: the figure holds on a small shared box where the server, its engine process and the
client share the cores. Arms alternate round by round; each arm is a name, the source folder
it runs from (``PYTHONPATH``, so two commits can be compared side by side) and server flags::

    python benchmarks/bench_server_cpu.py --arm start=/tmp/base/src \
        --arm head=src --arm "interval 8=src:--stream-interval 8" --rounds 3

Two loads: ``tokens`` (C=64, 256 requests x 128 tokens: CPU per streamed token) and
``requests`` (C=32, 1,024 one-token requests: CPU per request). Writes a JSON and a markdown
report under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
from pathlib import Path

LOADS = {  # name: (concurrency, requests, output tokens)
    "tokens": (64, 256, 128),
    "requests": (32, 1024, 1),
}
PROMPT_LEN = 128


def _client(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """The load, in this (client) process, through the online driver's closed loop (infer's
    own client): events and tokens seen, wall seconds."""
    from infer.bench.client import api_base
    from infer.bench.online import closed_loop

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(PROMPT_LEN)] for _ in range(requests)]
    records, wall = asyncio.run(closed_loop(api_base(url), prompts, concurrency, max_tokens))
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {failed[0]}")
    return {"events": sum(len(r.chunk_times_s) for r in records),
            "tokens": sum(r.output_tokens or 0 for r in records), "wall_s": wall}  # fmt: skip


def _run_arm(model: Path, src: str, flags: list[str], load: str, log: Path) -> dict:
    from infer.bench.online import free_port, process_cpu_s, serving
    from infer.bench.pyspy import api_server_pids

    concurrency, requests, max_tokens = LOADS[load]
    port = free_port()
    cmd = [sys.executable, "-m", "infer.server", "--model", str(model), "--dtype", "float32",
           "--served-model-name", "m", "--port", str(port), "--no-access-log",
           "--no-dashboard", "--max-num-seqs", "64", *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    with serving(cmd, env, log, port) as (proc, url, _):
        # warm: the first requests compile and allocate
        warm = [sys.executable, "-c", f"from benchmarks.bench_server_cpu import _client; "
                f"_client({url!r}, 4, 8, 8)"]  # fmt: skip
        subprocess.run(warm, check=True, cwd=Path(__file__).parent.parent)
        servers = api_server_pids(proc.pid)  # (several with --api-server-count)
        cpu0 = sum(process_cpu_s(pid) or 0.0 for pid in servers)
        code = f"import json; from benchmarks.bench_server_cpu import _client; " \
               f"print(json.dumps(_client({url!r}, {concurrency}, {requests}, {max_tokens})))"  # fmt: skip
        done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                              text=True, cwd=Path(__file__).parent.parent)  # fmt: skip
        cpu1 = sum(process_cpu_s(pid) or 0.0 for pid in servers)
    res = json.loads(done.stdout.strip().splitlines()[-1])
    res["server_cpu_s"] = cpu1 - cpu0
    res["api_servers"] = len(servers)
    res["us_per_token"] = 1e6 * res["server_cpu_s"] / max(1, res["tokens"])
    res["ms_per_request"] = 1e3 * res["server_cpu_s"] / requests
    res["tok_s"] = res["tokens"] / res["wall_s"]
    return res


def render(report: dict) -> str:
    lines = [
        "# The API server's CPU per streamed token and per request",
        "",
        f"{report['machine']}; tiny float32 Llama (hidden 64, one layer); {report['rounds']} "
        "rounds, arms in alternation; the API server processes' CPU seconds (summed) over the load "
        "(`/proc`), per token the client counted (usage) and per request.",
        "",
    ]
    for load, (c, n, t) in LOADS.items():
        per = "us_per_token" if load == "tokens" else "ms_per_request"
        unit = "us per token" if load == "tokens" else "ms per request"
        lines += [f"## {load}: C={c}, {n} requests x {t} tokens", "",
                  f"| arm | {unit} (rounds) | median | output tok/s (rounds) | tokens per event with text |",
                  "|---|---|---:|---|---:|"]  # fmt: skip
        digits = 1 if load == "tokens" else 2
        for arm, runs in report["results"].get(load, {}).items():
            vals = " / ".join(f"{r[per]:.{digits}f}" for r in runs)
            median = statistics.median(r[per] for r in runs)
            toks = " / ".join(f"{r['tok_s']:,.0f}" for r in runs)
            tpe = statistics.median(r["tokens"] / max(1, r["events"]) for r in runs)
            lines.append(f"| {arm} | {vals} | {median:.{digits}f} | {toks} | {tpe:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", action="append", required=True,
                    help="NAME=SRC[:FLAGS]: a source folder (PYTHONPATH) and server flags")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loads", default="tokens,requests")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/reports"))
    ap.add_argument("--tag", default="server_cpu")
    args = ap.parse_args(argv)
    from infer.bench.online import parse_arm
    from infer.testing.bench_models import build_random_llama

    model = build_random_llama(Path.home() / ".cache/infer/bench/llama-tiny-64", hidden_size=64,
                               intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1)  # fmt: skip
    arms = [parse_arm(a) for a in args.arm]
    loads = [x for x in args.loads.split(",") if x]
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    report: dict = {"machine": f"{cpu}, {os.cpu_count()} CPUs", "rounds": args.rounds,
                    "arms": [{"name": n, "src": s, "flags": f} for n, s, f in arms],
                    "results": {}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        for load in loads:
            for name, src, flags in arms:
                if load == "requests" and "--stream-interval" in flags:
                    continue  # (a one-token request is the same under any --stream-interval)
                res = _run_arm(model, src, flags, load, args.out / f"{args.tag}_server.log")
                report["results"].setdefault(load, {}).setdefault(name, []).append(res)
                print(f"round {r + 1} {load} {name}: {json.dumps(res)}", flush=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{args.tag}.md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

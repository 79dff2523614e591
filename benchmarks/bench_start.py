"""Time to serve: seconds from ``infer serve`` to ``/health`` answering 200, arm against arm.

Starts the server once per arm and round on a random bf16 Llama (``--size tiny``: hidden 64,
one layer, where the processes' imports are most of the start; ``--size small``: hidden 1024,
16 layers, ~240M parameters, 0.5 GB, where the model's load and warm-up add to it), polls
``/health`` every 20 ms, then stops it (SIGTERM). Arms alternate round by round; each arm is
a name, the source folder it runs from (``PYTHONPATH``, so two commits can be compared side by
side) and server flags::

    python benchmarks/bench_start.py --arm "before asc4=/tmp/base/src:--api-server-count 4" \
        --arm "asc4=src:--api-server-count 4" --arm "asc1=src" --rounds 5

Writes a JSON and a markdown report under ``--out`` (medians over the rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SIZES = {  # name: LlamaConfig fields
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1),
    "small": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4),
}  # fmt: skip


ENGINE_UP = "engine runs in process"  # (the first API server's line once the engine is up)


def time_to_serve(model: Path, src: str, flags: list[str], log: Path,
                  timeout: float = 600) -> dict[str, float | None]:  # fmt: skip
    """Seconds from the server's start to its first ``/health`` 200 (``serve``) and to its log
    saying the engine is up (``engine_up``; None where it does not); then it is stopped."""
    from infer.bench.online import free_port, stop_server

    port = free_port()
    cmd = [sys.executable, "-m", "infer.server", "--model", str(model), "--port", str(port),
           "--no-access-log", *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    engine_up = None
    try:
        while time.perf_counter() - start < timeout:
            if engine_up is None and ENGINE_UP in log.read_text(errors="replace"):
                engine_up = time.perf_counter() - start
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return {"serve": time.perf_counter() - start, "engine_up": engine_up}
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.02)
        raise RuntimeError(f"the server did not serve in {timeout:g} s; see {log}")
    finally:
        stop_server(proc, port)


def render(report: dict) -> str:
    lines = [
        "# Time to serve: `infer serve` to `/health` 200",
        "",
        f"{report['machine']}; random bf16 Llama `{report['size']}` "
        f"({report['shape']}); {report['rounds']} rounds, arms in alternation.",
        "",
        "Serving: from the start to `/health` 200. After the engine: from the log's line that",
        "the engine is up to `/health` 200 (what the API server processes add once the engine",
        "has started).",
        "",
        "| arm | flags | serving, s (rounds) | median | after the engine, s (rounds) | median |",
        "|---|---|---|---:|---|---:|",
    ]

    def cells(values: list[float]) -> str:
        if not values:
            return "- | -"
        return f"{' / '.join(f'{x:.2f}' for x in values)} | {statistics.median(values):.2f}"

    for arm in report["arms"]:
        runs = report["results"][arm["name"]]
        serve = [r["serve"] for r in runs]
        after = [r["serve"] - r["engine_up"] for r in runs if r["engine_up"] is not None]
        flags = " ".join(arm["flags"]) or "-"
        lines.append(f"| {arm['name']} | `{flags}` | {cells(serve)} | {cells(after)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", action="append", required=True,
                    help="NAME=SRC[:FLAGS]: a source folder (PYTHONPATH) and server flags")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--tag", default="start")
    args = ap.parse_args(argv)
    from infer.bench.online import parse_arm
    from infer.bench.report import cpu_model, save_report
    from infer.testing.bench_models import build_random_llama

    shape = SIZES[args.size]
    model = build_random_llama(Path.home() / f".cache/infer/bench/llama-start-{args.size}",
                               **shape)  # fmt: skip
    arms = [parse_arm(a) for a in args.arm]
    report: dict = {"machine": f"{cpu_model()}, {os.cpu_count()} CPUs", "rounds": args.rounds,
                    "size": args.size, "shape": ", ".join(f"{k} {v}" for k, v in shape.items()),
                    "arms": [{"name": n, "src": s, "flags": f} for n, s, f in arms],
                    "results": {}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        for name, src, flags in arms:
            times = time_to_serve(model, src, flags, args.out / f"{args.tag}_server.log")
            report["results"].setdefault(name, []).append(times)
            print(f"round {r + 1} {name}: {json.dumps(times)}", flush=True)
    save_report(report, render(report), args.out, args.tag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

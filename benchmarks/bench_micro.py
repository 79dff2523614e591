"""Engine micro-benchmarks on the toy NanoGPT, no HTTP: ``infer bench micro``.

    infer bench micro all|kv-cache|batching|chunked-prefill|scheduling|prefix-cache
                      [--repeats 3] [--trace DIR] [--out bench-results]

(``python benchmarks/bench_micro.py ...`` runs the same.) The suites are in ``micro/`` (one
module each, :data:`benchmarks.micro.SUITES`); each writes ``micro_<suite>.json``, ``.md`` and,
where it has a chart, ``.png``. Exits 1 when a case did not complete every configured request.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the checkout's root, where `benchmarks` imports from
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.micro import SUITES, run_suite  # noqa: E402
from benchmarks.micro.common import record_traces, toy_model_path  # noqa: E402
from infer.bench.cli import add_common  # noqa: E402
from infer.bench.report import collect_environment, now_iso  # noqa: E402


def run(args: argparse.Namespace) -> int:
    model, origin = toy_model_path(args.model)
    if args.trace:
        record_traces(args.trace)
        print(f"step traces: {args.trace}/<case>.jsonl (open them in /dashboard)", flush=True)
    names = list(SUITES) if args.suite == "all" else [args.suite]
    failed = 0
    for name in names:
        print(f"== micro {name} on {model} ({origin}) ==", flush=True)
        result = run_suite(name, model, repeats=args.repeats, seed=args.seed)
        result |= {
            "schema": "infer.bench.micro/1",
            "model": model,
            "model_origin": origin,
            "repeats": args.repeats,
            "seed": args.seed,
            "created": now_iso(),
            "environment": collect_environment(),
        }
        print(result["markdown"], flush=True)
        failed += incomplete(result)
        if not args.no_save:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            stem = out / f"micro_{name.replace('-', '_')}"
            stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
            header = f"# Micro benchmark: {name}\n\nModel: `{model}` ({origin}), median of "
            header += f"{args.repeats} runs, {result['created']}\n\n"
            png = chart(name, result, stem.with_suffix(".png"))
            if png:
                header += f"![{name}]({png.name})\n\n"
            stem.with_suffix(".md").write_text(header + result["markdown"] + "\n")
            print(f"report: {stem}.json", flush=True)
    return 1 if failed else 0


def chart(name: str, result: dict, path: Path) -> Path | None:
    """The suite's bar chart as a PNG next to its report (suites without ``chart``: none)."""
    make = getattr(importlib.import_module(SUITES[name]), "chart", None)
    if make is None:
        return None
    from infer.bench.plots import plot_bars

    groups, runs, title, ylabel = make(result)
    return plot_bars(groups, runs, title, ylabel, path)


def incomplete(result: dict) -> int:
    """Runs in a micro result that did not complete every configured request."""
    bad = 0
    for case in result.get("cases", []) + result.get("sweep", []):
        runs = case.get("methods", case)
        for v in runs.values():
            if isinstance(v, dict) and "configured" in v and v["completed"] != v["configured"]:
                bad += 1
    return bad


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer bench micro", description="engine micro-benchmarks on the toy NanoGPT"
    )
    p.add_argument("suite", choices=["all", *SUITES])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the toy model)")
    p.add_argument("--repeats", type=int, default=3, help="runs per case; the median is kept")
    add_common(p, seed=True, out="")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="write each case's step trace (JSON lines) to DIR/<case>.jsonl, for the "
                   "live view's replay (/dashboard, 'open trace')")  # fmt: skip
    return p


if __name__ == "__main__":
    from infer.bench.cli import main as infer_main

    sys.exit(infer_main(["bench", "micro", *sys.argv[1:]]))

"""Benchmark reports: the JSON record of a run and its markdown tables.

A serving report is one JSON document (``SCHEMA``) holding the run's configuration, the machine it
ran on, what the server said about itself, and per workload: the spec, the summary metrics and
every request's record. The markdown tables follow the usual serving-benchmark layout: one
``| Metric | run ... |`` table per workload (one column per run) and a cross-workload table.
A run that lost requests says so under its table.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from infer.bench.metrics import WorkloadMetrics

SCHEMA = "infer.bench.serve/1"


# --------------------------------------------------------------------------------------------
# Environment


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except (OSError, ValueError):
        pass
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def collect_environment() -> dict:
    """The client machine: CPU, GPU if any, memory, Python/torch/infer versions, git commit."""
    import infer

    env: dict = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gib": _mem_total_gib(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "infer": infer.__version__,
        "git_commit": _git_commit(),
        "torch": None,
        "gpu": None,
    }
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return env


# --------------------------------------------------------------------------------------------
# JSON


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def slug(text: str) -> str:
    """A file-name-safe form of a label or model path."""
    text = text.rstrip("/").split("/")[-1] if "/" in text and Path(text).exists() else text
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:60] or "run"


def offline_machine() -> dict:
    """The CPU, torch's thread count and version: the machine line of an offline report."""
    import torch

    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__}


def machine_line(m: dict) -> str:
    """``Machine: <cpu>, <n> threads, torch <version>.``: the machine sentence of an offline
    report, from its ``machine`` record (the keys of :func:`offline_machine`)."""
    return f"Machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}."


def save_json(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # NaN (a workload with no completed request has no latencies) as null: strict JSON, which
    # every reader takes (JavaScript's JSON.parse refuses a bare NaN); read back as NaN.
    path.write_text(json.dumps(_finite(report), indent=1, allow_nan=False) + "\n")
    return path


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def save_report(report: dict, markdown: str, folder: str | Path, stem: str) -> None:
    """``folder/stem.json`` and ``folder/stem.md``, and the markdown on stdout."""
    save_json(report, Path(folder) / f"{stem}.json")
    (Path(folder) / f"{stem}.md").write_text(markdown)
    print(markdown, flush=True)


def load_report(path: str | Path) -> dict:
    """Load a serving report written by :func:`save_json` (checks the schema tag). ``path``: the
    file, a run's folder (``serve_*/``, an ablation rung), or the ``--out`` folder holding one
    run. ``ValueError`` naming the problem when there is no single report there."""
    path = Path(path)
    if path.is_dir():
        runs = [path / "report.json"] if (path / "report.json").is_file() else []
        runs = runs or sorted(path.glob("*/report.json"))
        if len(runs) > 1:
            names = ", ".join(r.parent.name for r in runs)
            raise ValueError(f"{path}: {len(runs)} runs in it ({names}); name the one to read")
        path = runs[0] if runs else path / "report.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such report (a run's report.json, or its folder)")
    report = json.loads(path.read_text())
    if report.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not an infer serving report (schema {report.get('schema')!r})")
    return report


def report_metrics(report: dict) -> dict[str, WorkloadMetrics]:
    """Workload name -> metrics, in the report's order."""
    return {
        name: WorkloadMetrics.from_dict(w["metrics"]) for name, w in report["workloads"].items()
    }


def report_label(report: dict) -> str:
    return str(report.get("label") or report.get("config", {}).get("model") or "run")


def run_labels(reports: Sequence[dict]) -> list[str]:
    """Each report's label, made distinct (two runs of the same model: ``toy``, ``toy #2``),
    as tables and plots name them."""
    seen: dict[str, int] = {}
    out = []
    for label in map(report_label, reports):
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return out


# --------------------------------------------------------------------------------------------
# Markdown


def fmt(value: float | None, digits: int = 0) -> str:
    """Number for a table cell; ``—`` for missing or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}"


# (row label, getter, digits): the core rows first (throughput, TTFT, ITL, latency, errors),
# then the extended ones.
ROWS = (
    ("Throughput (tok/s)", lambda m: m.output_throughput, 1),
    ("TTFT P50 (ms)", lambda m: m.ttft.p50, 0),
    ("TTFT P99 (ms)", lambda m: m.ttft.p99, 0),
    ("ITL P50 (ms)", lambda m: m.itl.p50, 0),
    ("ITL P99 (ms)", lambda m: m.itl.p99, 0),
    ("Latency P50 (s)", lambda m: m.e2e.p50 / 1000.0, 3),
    ("Errors", lambda m: m.errors, 0),
    ("Requests (done/configured)", None, 0),
    ("Request rate (req/s)", lambda m: m.request_throughput, 2),
    ("TTFT mean / P95 (ms)", None, 0),
    ("ITL mean / P95 (ms)", None, 0),
    ("TPOT P50 / P99 (ms)", None, 0),
    ("Latency P95 / P99 (s)", None, 3),
    ("Output tokens", lambda m: m.output_tokens, 0),
)


def _cell(row: str, m: WorkloadMetrics) -> str:
    if row == "Requests (done/configured)":
        mark = "" if m.lost == 0 else " ⚠"
        return f"{m.completed}/{m.configured}{mark}"
    if row == "TTFT mean / P95 (ms)":
        return f"{fmt(m.ttft.mean)} / {fmt(m.ttft.p95)}"
    if row == "ITL mean / P95 (ms)":
        return f"{fmt(m.itl.mean)} / {fmt(m.itl.p95)}"
    if row == "TPOT P50 / P99 (ms)":
        return f"{fmt(m.tpot.p50)} / {fmt(m.tpot.p99)}"
    if row == "Latency P95 / P99 (s)":
        return f"{fmt(m.e2e.p95 / 1000.0, 3)} / {fmt(m.e2e.p99 / 1000.0, 3)}"
    for name, get, digits in ROWS:
        if name == row and get is not None:
            return fmt(get(m), digits)
    raise KeyError(row)


def md_table(
    header: str | Sequence[str],
    rows: Sequence[Sequence[object]],
    align: str = "",
    pad: bool = False,
) -> list[str]:
    """A markdown table as lines: the one table shape of every bench report.

    ``header`` is a list of column names or one string of them separated by ``" | "``;
    ``align`` has a letter per column, ``r`` for right-aligned (``---:``), anything else left;
    a shorter ``align`` leaves the remaining columns left-aligned. ``pad`` pads every cell to
    its column's width (at least 3), the separator's dashes spanning it: a table that reads
    aligned as plain text too."""
    cols = [str(c) for c in (header.split(" | ") if isinstance(header, str) else header)]
    body = [[str(c) for c in row] for row in rows]
    right = [a == "r" for a in align.ljust(len(cols))[: len(cols)]]
    if pad:
        widths = [max(3, *map(len, col)) for col in zip(cols, *body, strict=True)]
        cols, *body = [
            [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)]
            for row in [cols, *body]
        ]
        sep = [
            "-" * (w + 1) + ":" if r else "-" * (w + 2) for w, r in zip(widths, right, strict=True)
        ]
    else:
        sep = ["---:" if r else "---" for r in right]
    line = "| {} |".format
    return [line(" | ".join(cols)), "|" + "|".join(sep) + "|", *(line(" | ".join(r)) for r in body)]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """:func:`md_table` padded, the first column left-aligned and the rest right, as one string."""
    return "\n".join(md_table(header, rows, "l" + "r" * (len(header) - 1), pad=True))


def num(x: float | None, spec: str = ".1f", none: str = "-") -> str:
    """``x`` formatted with ``spec`` for a table cell, ``none`` when it is missing."""
    return none if x is None else format(x, spec)


def lost_note(label: str, m: WorkloadMetrics, errors: Sequence[str] = ()) -> str | None:
    """The warning line for a run that did not complete every configured request."""
    if m.lost == 0:
        return None
    first = f" First error: `{errors[0][:160]}`" if errors else ""
    return (
        f"> **Lost requests ({label})**: {m.lost} of {m.configured} configured requests did not "
        f"complete ({m.errors} errors).{first}"
    )


def workload_table(
    columns: Sequence[tuple[str, WorkloadMetrics]], with_goodput: bool | None = None
) -> str:
    """``| Metric | label1 | label2 ... |`` for one workload (core rows, then the extras)."""
    header = ["Metric", *(label for label, _ in columns)]
    rows = [[name, *(_cell(name, m) for _, m in columns)] for name, _, _ in ROWS]
    if with_goodput is None:
        with_goodput = any(m.slo for _, m in columns)
    if with_goodput:
        slo = next((m.slo for _, m in columns if m.slo), "")
        rows.append(
            [f"Goodput req/s ({slo})", *(fmt(m.goodput_rps, 2) for _, m in columns)],
        )
        rows.append(
            [
                "SLO met (requests)",
                *("—" if m.slo_met is None else f"{m.slo_met}/{m.configured}" for _, m in columns),
            ]
        )
    return markdown_table(header, rows)


CROSS_HEADER = (
    "Workload",
    "Done/Conf",
    "Errors",
    "Tok/s",
    "Req/s",
    "TTFT P50",
    "TTFT P99",
    "ITL P50",
    "ITL P99",
    "TPOT P50",
    "Lat P50 (s)",
)


def cross_workload_table(metrics: dict[str, WorkloadMetrics]) -> str:
    """One row per workload: the headline numbers side by side (times in ms unless marked)."""
    rows = []
    for name, m in metrics.items():
        rows.append(
            [
                name,
                f"{m.completed}/{m.configured}" + ("" if m.lost == 0 else " ⚠"),
                str(m.errors),
                fmt(m.output_throughput, 1),
                fmt(m.request_throughput, 2),
                fmt(m.ttft.p50),
                fmt(m.ttft.p99),
                fmt(m.itl.p50),
                fmt(m.itl.p99),
                fmt(m.tpot.p50),
                fmt(m.e2e.p50 / 1000.0, 3),
            ]
        )
    header = list(CROSS_HEADER)
    if any(m.slo for m in metrics.values()):
        header.append("Goodput (req/s)")
        for row, m in zip(rows, metrics.values(), strict=True):
            row.append(fmt(m.goodput_rps, 2))
    return markdown_table(header, rows)


def _errors_of(workload: dict) -> list[str]:
    return [r["error"] for r in workload.get("requests", []) if r.get("error")]


def render_markdown(report: dict, plots: dict[str, str] | None = None) -> str:
    """The full markdown log of one serving report (plots: name -> relative PNG path)."""
    label = report_label(report)
    cfg = report.get("config", {})
    env = report.get("environment", {})
    metrics = report_metrics(report)
    hw = env.get("gpu") or env.get("cpu") or "unknown"
    out = [
        f"# Serving benchmark: {label}",
        "",
        f"- **Server**: {cfg.get('server')} · model `{cfg.get('model')}` · endpoint "
        f"`{cfg.get('endpoint')}`",
        f"- **Hardware (client)**: {hw} · {env.get('cpus_usable') or env.get('cpu_count')} CPUs"
        f" · torch {env.get('torch')} · infer {env.get('infer')} ({env.get('git_commit')})",
        f"- **Run**: seed {cfg.get('seed')} · scale {cfg.get('scale')} · rate scale "
        f"{cfg.get('rate_scale')} · {cfg.get('warmup')} warm-up requests per workload · "
        f"{report.get('created')}",
    ]
    if cfg.get("server_flags"):
        out.append(f"- **Server flags**: `{cfg['server_flags']}`")
    if cfg.get("slo"):
        out.append(f"- **SLO**: {cfg['slo']}")
    out += ["", "## Cross-workload comparison", "", cross_workload_table(metrics), ""]
    for name, w in report["workloads"].items():
        spec = w.get("spec", {})
        title = spec.get("title", "")
        out += [f"### {name}" + (f" — {title}" if title else ""), ""]
        desc = _spec_line(spec)
        if desc:
            out += [desc, ""]
        for note in w.get("notes", []):
            out += [f"> {note}", ""]
        m = metrics[name]
        out += [workload_table([(label, m)]), ""]
        note = lost_note(label, m, _errors_of(w))
        if note:
            out += [note, ""]
        stats_line = server_stats_line(w.get("server_stats"))
        if stats_line:
            out += [stats_line, ""]
        if not m.usage_reported and m.completed:
            out += ["> Output tokens counted from stream chunks: the server sent no `usage`.", ""]
    if plots:
        out += ["## Plots", ""]
        for name, rel in plots.items():
            out += [f"![{name}]({rel})", ""]
    return "\n".join(out).rstrip() + "\n"


def server_stats_line(stats: dict | None) -> str | None:
    """One line of the server's own counters over the workload (infer servers only)."""
    if not stats:
        return None
    parts = []
    if "prompt_tokens_total" in stats:
        parts.append(f"prompt tokens {stats['prompt_tokens_total']}")
    if "generation_tokens_total" in stats:
        parts.append(f"generated tokens {stats['generation_tokens_total']}")
    q, h = stats.get("prefix_cache_queries_total"), stats.get("prefix_cache_hits_total")
    if q:
        parts.append(f"prefix-cache hits {h}/{q} ({h / q:.0%})")
    if "prefix_cache_evictions_total" in stats:
        parts.append(f"evictions {stats['prefix_cache_evictions_total']}")
    if "num_preemptions_total" in stats:
        parts.append(f"preemptions {stats['num_preemptions_total']}")
    if "steps" in stats:
        parts.append(f"engine steps {stats['steps']}")
    return "Server counters (warm-ups included): " + ", ".join(parts) if parts else None


def _spec_line(spec: dict) -> str:
    if not spec:
        return ""
    bands = spec.get("prompt_bands") or []
    prompt = " + ".join(
        (f"{b['weight']:.0%} " if len(bands) > 1 else "") + f"[{b['low']}, {b['high']}]"
        for b in bands
    )
    if spec.get("shared_prefix_len"):
        prompt = f"{spec['shared_prefix_len']} shared prefix + {prompt}"
    ob = spec.get("output_band", {})
    arrival = spec.get("arrival")
    if arrival in ("uniform", "poisson"):
        arrival = f"{arrival} {spec.get('rate'):g} RPS"
    return (
        f"{spec.get('num_requests')} requests · prompt ~{prompt} tok · max tokens "
        f"[{ob.get('low')}, {ob.get('high')}] · {arrival} · measures: {spec.get('measures')}"
    )

"""``infer bench compare A.json B.json ...``: "phase vs phase" delta tables with percentages.

For reports A, B, C (in that order) the output holds:

1. a throughput table, one row per run and a last row "last vs first";
2. for each consecutive pair (or each run against the first, ``against="first"``) a delta table
   ``| Metric | workload ... |`` whose cells read ``a → b (+x%)``;
3. per workload, the metric table of :func:`~infer.bench.report.workload_table` with one column
   per run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

from infer.bench.metrics import WorkloadMetrics
from infer.bench.report import (
    ROWS,
    fmt,
    lost_note,
    markdown_table,
    report_metrics,
    run_labels,
    workload_table,
)

Getter = Callable[[WorkloadMetrics], float]

DELTA_METRICS: tuple[tuple[str, Getter, int], ...] = ROWS[:7]  # type: ignore[assignment]
"""The rows of a phase-vs-phase table: the report tables' core rows (throughput to errors)."""


def pct_change(old: float, new: float) -> float | None:
    """Relative change in percent; ``None`` when undefined (old is 0 or a value is missing)."""
    if any(v is None or math.isnan(v) for v in (old, new)) or old == 0:
        return None
    return (new - old) / abs(old) * 100.0


def fmt_pct(p: float | None) -> str:
    if p is None:
        return "n/a"
    r = round(p)
    return "0%" if r == 0 else f"{r:+d}%"


def delta_cell(old: float, new: float, digits: int) -> str:
    """``"346.1 → 455.2 (+32%)"``."""
    return f"{fmt(old, digits)} → {fmt(new, digits)} ({fmt_pct(pct_change(old, new))})"


def _common_workloads(metrics: Sequence[dict[str, WorkloadMetrics]]) -> list[str]:
    return [w for w in metrics[0] if all(w in m for m in metrics[1:])]


def throughput_table(labels: Sequence[str], metrics: Sequence[dict[str, WorkloadMetrics]]) -> str:
    """Rows: runs (+ last vs first); columns: workloads; cells: output tok/s."""
    workloads = _common_workloads(metrics)
    rows = [
        [lab, *(fmt(m[w].output_throughput, 1) for w in workloads)]
        for lab, m in zip(labels, metrics, strict=True)
    ]
    if len(metrics) > 1:
        first, last = metrics[0], metrics[-1]
        rows.append(
            [
                f"{labels[-1]} vs {labels[0]}",
                *(
                    f"**{fmt_pct(pct_change(first[w].output_throughput, last[w].output_throughput))}**"
                    for w in workloads
                ),
            ]
        )
    return markdown_table(["Configuration", *workloads], rows)


def delta_table(old: dict[str, WorkloadMetrics], new: dict[str, WorkloadMetrics]) -> str:
    """Rows: headline metrics; columns: workloads; cells ``a → b (+x%)``."""
    workloads = _common_workloads([old, new])
    rows = [
        [name, *(delta_cell(get(old[w]), get(new[w]), digits) for w in workloads)]
        for name, get, digits in DELTA_METRICS
    ]
    return markdown_table(["Metric", *workloads], rows)


def compare_markdown(
    reports: Sequence[dict], against: Literal["previous", "first"] = "previous"
) -> str:
    """The whole comparison of two or more serving reports, as markdown."""
    if len(reports) < 2:
        raise ValueError("compare needs at least two reports")
    labels = run_labels(reports)
    metrics = [report_metrics(r) for r in reports]
    workloads = _common_workloads(metrics)
    if not workloads:
        raise ValueError("the reports have no workload in common")
    out = ["# Comparison: " + " → ".join(labels), "", "## Output throughput (tok/s)", ""]
    out += [throughput_table(labels, metrics), ""]
    for i in range(1, len(reports)):
        j = i - 1 if against == "previous" else 0
        out += [f"## {labels[i]} vs {labels[j]}", "", delta_table(metrics[j], metrics[i]), ""]
    for w in workloads:
        out += [f"### {w}", ""]
        cols = [(lab, m[w]) for lab, m in zip(labels, metrics, strict=True)]
        out += [workload_table(cols), ""]
        for lab, m in cols:
            note = lost_note(lab, m)
            if note:
                out += [note, ""]
    return "\n".join(out).rstrip() + "\n"

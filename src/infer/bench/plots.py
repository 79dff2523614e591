"""PNG plots of serving reports (matplotlib, Agg backend: no display needed).

matplotlib comes with the ``bench`` extra and is imported by the first plot, not by this module.

- TTFT and ITL CDFs, one line per workload (or per run when comparing);
- output-throughput bars, per workload and grouped by run;
- a per-request timeline: each request's wait-to-first-token and decode span, failures in red.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from infer.bench.client import RequestRecord
from infer.bench.report import report_label, report_metrics, run_labels


def _pyplot():
    """``matplotlib.pyplot`` on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _records(workload: dict) -> list[RequestRecord]:
    return [RequestRecord.from_dict(r) for r in workload.get("requests", [])]


def plot_cdf(series: dict[str, Sequence[float]], title: str, xlabel: str, path: Path) -> Path:
    """Empirical CDFs (values in ms), log-scaled x when the values span two decades."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lo, hi = float("inf"), 0.0
    for label, values in series.items():
        xs = sorted(values)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step([xs[0], *xs], [0.0, *ys], where="post", label=f"{label} (n={len(xs)})")
        lo, hi = min(lo, xs[0]), max(hi, xs[-1])
    if lo > 0 and hi / lo > 100:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(
    groups: Sequence[str], runs: dict[str, Sequence[float]], title: str, ylabel: str, path: Path
) -> Path:
    """Grouped bars: one group per entry of ``groups``, one bar per run within it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups) * max(1, len(runs)) ** 0.5), 4.2))
    n = max(1, len(runs))
    width = 0.8 / n
    for j, (label, values) in enumerate(runs.items()):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(groups))]
        bars = ax.bar(xs, values, width=width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)), groups, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(records: Sequence[RequestRecord], title: str, path: Path) -> Path:
    """One row per request: grey from send to first token, blue while streaming, red if failed."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.12 * len(records) + 1.2)))
    for row, r in enumerate(sorted(records, key=lambda r: (r.start_s, r.index))):
        if not r.success:
            end = r.e2e_s if r.e2e_s is not None else 0.05
            ax.barh(row, max(end, 0.05), left=r.start_s, color="tab:red", height=0.8)
            continue
        ttft = r.ttft_s or 0.0
        ax.barh(row, ttft, left=r.start_s, color="0.7", height=0.8)
        ax.barh(row, (r.e2e_s or ttft) - ttft, left=r.start_s + ttft, color="tab:blue", height=0.8)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("request (by send time)")
    ax.set_title(
        title + "  (grey: waiting for first token, blue: streaming, red: failed)", fontsize=9
    )
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report_plots(report: dict, out_dir: str | Path) -> dict[str, str]:
    """All plots of one report into ``out_dir``; returns name -> file name (relative)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    label = report_label(report)
    workloads = report["workloads"]
    recs = {name: _records(w) for name, w in workloads.items()}
    made: dict[str, str] = {}
    ttft = {
        n: [r.ttft_s * 1000 for r in rs if r.success and r.ttft_s is not None]
        for n, rs in recs.items()
    }
    plot_cdf(ttft, f"TTFT CDF — {label}", "TTFT (ms)", out / "ttft_cdf.png")
    made["TTFT CDF"] = "ttft_cdf.png"
    itl = {n: [g * 1000 for r in rs if r.success for g in r.itls_s] for n, rs in recs.items()}
    plot_cdf(itl, f"ITL CDF — {label}", "inter-token latency (ms)", out / "itl_cdf.png")
    made["ITL CDF"] = "itl_cdf.png"
    metrics = report_metrics(report)
    plot_bars(
        list(metrics),
        {label: [m.output_throughput for m in metrics.values()]},
        f"Output throughput — {label}",
        "output tokens / s",
        out / "throughput.png",
    )
    made["Throughput"] = "throughput.png"
    for name, rs in recs.items():
        fname = f"timeline_{name}.png"
        plot_timeline(rs, f"{name} — {label}", out / fname)
        made[f"Timeline {name}"] = fname
    return made


def write_compare_plots(reports: Sequence[dict], out_dir: str | Path) -> dict[str, str]:
    """Throughput bars grouped by workload (one bar per run) and per-workload TTFT/ITL CDFs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = run_labels(reports)
    metrics = [report_metrics(r) for r in reports]
    workloads = [w for w in metrics[0] if all(w in m for m in metrics)]
    made: dict[str, str] = {}
    plot_bars(
        workloads,
        {
            lab: [m[w].output_throughput for w in workloads]
            for lab, m in zip(labels, metrics, strict=True)
        },
        "Output throughput by run",
        "output tokens / s",
        out / "compare_throughput.png",
    )
    made["Throughput by run"] = "compare_throughput.png"
    for w in workloads:
        series_ttft, series_itl = {}, {}
        for lab, rep in zip(labels, reports, strict=True):
            rs = _records(rep["workloads"][w])
            series_ttft[lab] = [r.ttft_s * 1000 for r in rs if r.success and r.ttft_s is not None]
            series_itl[lab] = [g * 1000 for r in rs if r.success for g in r.itls_s]
        plot_cdf(series_ttft, f"TTFT CDF — {w}", "TTFT (ms)", out / f"compare_ttft_{w}.png")
        plot_cdf(series_itl, f"ITL CDF — {w}", "ITL (ms)", out / f"compare_itl_{w}.png")
        made[f"TTFT {w}"] = f"compare_ttft_{w}.png"
        made[f"ITL {w}"] = f"compare_itl_{w}.png"
    return made

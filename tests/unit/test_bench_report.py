"""Report writers (JSON fields, markdown tables, PNGs) and the compare tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer.bench.client import RequestRecord
from infer.bench.compare import compare_markdown, delta_cell, delta_table, fmt_pct, pct_change
from infer.bench.metrics import summarize
from infer.bench.report import (
    SCHEMA,
    collect_environment,
    cross_workload_table,
    load_report,
    markdown_table,
    render_markdown,
    report_metrics,
    save_json,
    workload_table,
)
from infer.bench.workloads import WORKLOADS, scale_workload

PNG = b"\x89PNG\r\n\x1a\n"


def records(n: int, speed: float, fail: int = 0) -> list[RequestRecord]:
    """n synthetic requests; ``speed`` divides every time (2.0 = twice as fast)."""
    out = []
    for i in range(n):
        r = RequestRecord(i, 100, 8, i * 0.1)
        r.start_s = i * 0.1
        if i < fail:
            r.error = "HTTP 500: boom"
            out.append(r)
            continue
        ttft = (0.05 + 0.01 * i) / speed
        r.chunk_times_s = [ttft + k * 0.02 / speed for k in range(8)]
        r.ttft_s, r.e2e_s = ttft, r.chunk_times_s[-1]
        r.prompt_tokens, r.output_tokens, r.usage_reported, r.success = 100, 8, True, True
        out.append(r)
    return out


def make_report(label: str, speed: float, fail: int = 0, slo=None) -> dict:
    workloads = {}
    for name in ("baseline", "paged_attention"):
        recs = records(6, speed, fail if name == "paged_attention" else 0)
        m = summarize(recs, duration_s=2.0 / speed, slo=slo)
        workloads[name] = {
            "spec": scale_workload(WORKLOADS[name], 0.1).describe(),
            "notes": [],
            "metrics": m.to_dict(),
            "requests": [r.to_dict() for r in recs],
        }
    return {
        "schema": SCHEMA,
        "label": label,
        "created": "2026-01-01T00:00:00+00:00",
        "config": {"server": "http://x", "model": "m", "endpoint": "completions", "seed": 42},
        "environment": {"cpu": "Test CPU", "torch": "2.x"},
        "workloads": workloads,
    }


def test_environment_has_the_fields_reports_need():
    env = collect_environment()
    assert env["cpu"] and env["cpu_count"] >= 1
    assert env["python"].count(".") == 2 and env["infer"]
    assert "torch" in env and "gpu" in env


def test_json_roundtrip_keeps_metrics_and_records(tmp_path: Path):
    rep = make_report("phase A", 1.0, fail=1)
    path = save_json(rep, tmp_path / "r" / "report.json")
    loaded = load_report(path)
    assert loaded["workloads"]["paged_attention"]["requests"][0]["error"] == "HTTP 500: boom"
    m = report_metrics(loaded)
    assert list(m) == ["baseline", "paged_attention"]
    assert m["paged_attention"].lost == 1 and m["baseline"].lost == 0
    assert m["baseline"] == report_metrics(rep)["baseline"]
    back = RequestRecord.from_dict(loaded["workloads"]["baseline"]["requests"][2])
    assert back.chunk_times_s == pytest.approx(
        rep["workloads"]["baseline"]["requests"][2]["chunk_times_s"]
    )
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError):
        load_report(tmp_path / "bad.json")


def test_a_workload_without_completed_requests_saves_strict_json(tmp_path: Path):
    """No latencies: null in the file (a bare NaN is not JSON: JavaScript refuses it), NaN
    again when read, "—" in the tables."""
    import math

    rep = make_report("A", 1.0, fail=6)
    assert math.isnan(report_metrics(rep)["paged_attention"].ttft.p50)
    path = save_json(rep, tmp_path / "report.json")

    def refuse(name: str):
        raise AssertionError(f"{name} in the JSON")

    json.loads(path.read_text(), parse_constant=refuse)
    m = report_metrics(load_report(path))["paged_attention"]
    assert m.completed == 0 and m.output_throughput == 0 and math.isnan(m.ttft.p50)
    assert "—" in workload_table([("A", m)])


def _shape(table: str) -> tuple[int, set[int]]:
    lines = table.splitlines()
    return len(lines), {line.count("|") for line in lines}


def test_markdown_table_shape_and_alignment():
    t = markdown_table(["Metric", "A", "B"], [["x", "1", "22"], ["long name", "333", "4"]])
    lines = t.splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    assert lines[1].startswith("|---") and lines[1].endswith(":|")
    assert lines[2].startswith("| x ")


def test_workload_table_has_reference_rows_then_extras():
    rep = make_report("A", 1.0, fail=2)
    m = report_metrics(rep)["paged_attention"]
    t = workload_table([("Llama", m), ("Qwen3", m)])
    rows = [line.split("|")[1].strip() for line in t.splitlines()]
    assert rows[0] == "Metric" and rows[2:9] == [
        "Throughput (tok/s)",
        "TTFT P50 (ms)",
        "TTFT P99 (ms)",
        "ITL P50 (ms)",
        "ITL P99 (ms)",
        "Latency P50 (s)",
        "Errors",
    ]
    n, bars = _shape(t)
    assert bars == {4}  # Metric + two columns
    assert "4/6 ⚠" in t  # lost requests are flagged in the table itself
    errors = next(line for line in t.splitlines() if line.startswith("| Errors "))
    assert [c.strip() for c in errors.split("|")[2:4]] == ["2", "2"]


def test_goodput_rows_appear_with_an_slo():
    from infer.bench.metrics import SLO

    rep = make_report("A", 1.0, slo=SLO(ttft_ms=80))
    t = workload_table([("A", report_metrics(rep)["baseline"])])
    assert "Goodput req/s (ttft_ms=80)" in t and "SLO met (requests)" in t
    cross = cross_workload_table(report_metrics(rep))
    assert "Goodput" in cross.splitlines()[0]


def test_render_markdown_sections_and_lost_request_note():
    rep = make_report("phase A", 1.0, fail=1)
    md = render_markdown(rep, {"TTFT CDF": "ttft_cdf.png"})
    assert md.startswith("# Serving benchmark: phase A")
    assert "## Cross-workload comparison" in md
    assert "### baseline — Sequential Single Requests" in md
    assert "### paged_attention — Single Burst, Moderate Lengths" in md
    assert "**Lost requests (phase A)**: 1 of 6" in md and "HTTP 500: boom" in md
    assert "![TTFT CDF](ttft_cdf.png)" in md
    # the healthy workload carries no warning
    baseline_part = md.split("### baseline")[1].split("### paged_attention")[0]
    assert "Lost requests" not in baseline_part


def test_cross_workload_table_one_row_per_workload():
    t = cross_workload_table(report_metrics(make_report("A", 1.0)))
    lines = t.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| baseline")


def test_report_plots_are_pngs(tmp_path: Path):
    from infer.bench.plots import write_compare_plots, write_report_plots

    rep = make_report("A", 1.0, fail=1)
    made = write_report_plots(rep, tmp_path / "plots")
    assert set(made.values()) == {
        "ttft_cdf.png",
        "itl_cdf.png",
        "throughput.png",
        "timeline_baseline.png",
        "timeline_paged_attention.png",
    }
    for f in made.values():
        assert (tmp_path / "plots" / f).read_bytes()[:8] == PNG
    made = write_compare_plots([rep, make_report("B", 2.0)], tmp_path / "cmp")
    assert "compare_throughput.png" in made.values()
    for f in made.values():
        assert (tmp_path / "cmp" / f).read_bytes()[:8] == PNG


def test_compare_plots_keep_runs_that_share_a_label(tmp_path: Path, monkeypatch):
    """Two runs of one model (no --label): a bar and a curve each, named as the tables name
    them (the second overwrote the first in the plots)."""
    from infer.bench import plots

    drawn: list[list[str]] = []
    monkeypatch.setattr(plots, "plot_bars", lambda groups, series, *a: drawn.append(list(series)))
    monkeypatch.setattr(plots, "plot_cdf", lambda series, *a: drawn.append(list(series)))
    plots.write_compare_plots([make_report("toy", 1.0), make_report("toy", 2.0)], tmp_path)
    assert drawn and all(names == ["toy", "toy #2"] for names in drawn)
    assert "# Comparison: toy → toy #2" in compare_markdown(
        [make_report("toy", 1.0), make_report("toy", 2.0)]
    )


def test_pct_change_and_cells():
    assert pct_change(100.0, 132.0) == pytest.approx(32.0)
    assert pct_change(0.0, 5.0) is None
    assert pct_change(float("nan"), 1.0) is None
    assert fmt_pct(31.6) == "+32%" and fmt_pct(-55.4) == "-55%" and fmt_pct(0.2) == "0%"
    assert fmt_pct(None) == "n/a"
    assert delta_cell(346.1, 455.2, 1) == "346.1 → 455.2 (+32%)"


def test_delta_table_between_two_runs():
    a, b = report_metrics(make_report("A", 1.0)), report_metrics(make_report("B", 2.0))
    t = delta_table(a, b)
    lines = t.splitlines()
    assert lines[0].split("|")[2].strip() == "baseline"
    thr = next(line for line in lines if line.startswith("| Throughput"))
    assert "(+100%)" in thr  # twice the speed, same tokens
    ttft = next(line for line in lines if line.startswith("| TTFT P50"))
    assert "(-50%)" in ttft


def test_compare_markdown_phase_vs_phase(tmp_path: Path):
    reps = [make_report("P4", 1.0), make_report("P5", 2.0), make_report("P6", 4.0, fail=1)]
    md = compare_markdown(reps)
    assert "## P5 vs P4" in md and "## P6 vs P5" in md and "P6 vs P4" in md
    assert "**+300%**" in md  # throughput table's last-vs-first row (4x)
    assert "**Lost requests (P6)**" in md
    first = compare_markdown(reps, against="first")
    assert "## P6 vs P4" in first and "## P6 vs P5" not in first
    dup = compare_markdown([make_report("X", 1.0), make_report("X", 1.0)])
    assert "X #2 vs X" in dup
    with pytest.raises(ValueError):
        compare_markdown(reps[:1])


def test_compare_cli_writes_markdown_and_plots(tmp_path: Path, capsys):
    from infer.bench.cli import main

    paths = [save_json(make_report(n, s), tmp_path / f"{n}.json") for n, s in (("A", 1), ("B", 2))]
    out = tmp_path / "cmp.md"
    rc = main(
        ["bench", "compare", *map(str, paths), "--out", str(out), "--plots", str(tmp_path / "png")]
    )
    assert rc == 0
    text = out.read_text()
    assert "## B vs A" in text and "![Throughput by run](png/compare_throughput.png)" in text
    assert (tmp_path / "png" / "compare_throughput.png").read_bytes()[:8] == PNG
    assert "## B vs A" in capsys.readouterr().out


def test_load_report_accepts_a_run_folder(tmp_path: Path):
    save_json(make_report("A", 1.0), tmp_path / "run" / "report.json")
    assert load_report(tmp_path / "run")["label"] == "A"
    # the --out folder of `infer bench serve`, its one run in serve_<stamp>_<model>/
    assert load_report(tmp_path)["label"] == "A"


def test_compare_names_a_missing_or_ambiguous_report(tmp_path: Path, capsys):
    from infer.bench.cli import main

    save_json(make_report("A", 1.0), tmp_path / "runA" / "serve_1_m" / "report.json")
    save_json(make_report("B", 2.0), tmp_path / "runA" / "serve_2_m" / "report.json")
    assert main(["bench", "compare", str(tmp_path / "runA"), str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "2 runs in it (serve_1_m, serve_2_m); name the one to read" in err
    assert (
        main(["bench", "compare", str(tmp_path / "runA" / "serve_1_m"), str(tmp_path / "nope")])
        == 2
    )
    assert "nope: no such report" in capsys.readouterr().err


def test_batching_reading_tells_plateau_from_scaling():
    from infer.bench.client_suite import BatchResult, batching_reading

    plateau = [
        BatchResult("concurrent", 1, 700, 10.9, 1.0),
        BatchResult("concurrent", 12, 9430, 11.1, 1.0),
    ]
    text = batching_reading(plateau)
    assert "From 1 to 12" in text and "x1.02" in text and "x13.47" in text and "plateaus" in text
    scaling = [
        BatchResult("concurrent", 1, 50, 40.0, 1.0),
        BatchResult("concurrent", 8, 90, 250.0, 1.0),
    ]
    assert "raises throughput" in batching_reading(scaling)
    assert batching_reading(plateau[:1]) is None


def test_the_engine_reports_title_names_the_model_it_measured():
    """``infer bench engine --model X`` is titled with X (it said "~100M Llama" whatever ran)."""
    from infer.bench.engine import _model_title
    from infer.testing.bench_models import LLAMA_100M_DIR

    assert _model_title({"model": str(LLAMA_100M_DIR), "results": {}}) == "~100M Llama"
    other = {"model": "/models/tiny-llama", "results": {"float32": {"params": 215_000}}}
    assert _model_title(other) == "tiny-llama (0.2M parameters)"

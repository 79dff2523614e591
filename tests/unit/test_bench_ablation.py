"""Ablation ladder helpers and micro-report charts (no server, no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer.bench.ablation import _shift_headings, ladder, model_context

PNG = b"\x89PNG\r\n\x1a\n"


def test_ladder_adds_one_optimisation_per_rung():
    rungs = ladder(256)
    assert [r.name for r in rungs] == [
        "static+contiguous",
        "continuous+contiguous",
        "continuous+paged",
        "+chunked_prefill",
        "+prefix_caching",
    ]
    flags = [" ".join(r.flags) for r in rungs]
    assert "--batching-mode static" in flags[0] and "--kv-cache-backend contiguous" in flags[0]
    assert "--batching-mode continuous" in flags[1] and "contiguous" in flags[1]
    assert "--kv-cache-backend paged" in flags[2] and "chunk" not in flags[2]
    # prefix caching is on by default: every rung before its own turns it off by name
    assert all(f.endswith(" --no-enable-prefix-caching") for f in flags[2:4])
    assert flags[3].removesuffix(" --no-enable-prefix-caching").endswith("--prefill-chunk-size 256")
    assert flags[4] == flags[3].replace("--no-enable-prefix-caching", "--enable-prefix-caching")
    with_compile = ladder(256, "--compile")
    assert with_compile[-1].name == "+compiled_decode"
    assert with_compile[-1].flags[-1] == "--compile"


def test_compile_rung_only_from_an_explicit_flag():
    """No probing of the server's --help: the compile rung exists only when asked for."""
    import argparse

    from infer.bench import ablation
    from infer.bench.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["bench", "ablation", "--model", "m"]).compile_flag is None
    argv = ["bench", "ablation", "--model", "m", "--compile-flag=--compile-decode"]
    assert parser.parse_args(argv).compile_flag == "--compile-decode"
    assert not hasattr(ablation, "find_compile_flag") and not hasattr(ablation, "server_help")
    assert all(r.name != "+compiled_decode" for r in ladder(256))


def test_model_context_reads_local_configs(tmp_path: Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps({"n_positions": 64}))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 512}})
    )
    assert model_context(str(tmp_path / "a")) == 2048
    assert model_context(str(tmp_path / "b")) == 64
    assert model_context(str(tmp_path / "c")) == 512
    assert model_context("toy") is None


def test_rung_report_is_nested_in_the_log():
    md = "# Serving benchmark: x\n\n## Plots\n\n![TTFT CDF](ttft_cdf.png)\n| a | b |"
    out = _shift_headings(md, "rung1")
    assert out.splitlines()[0] == "## Serving benchmark: x"
    assert "![TTFT CDF](rung1/ttft_cdf.png)" in out and "| a | b |" in out


def _summary(tps: float, **extra) -> dict:
    return {"tokens_per_s": tps, "configured": 2, "completed": 2, **extra}


SYNTHETIC = {
    "kv-cache": {
        "cases": [
            {"case": "a", "methods": {"no_cache": _summary(1.0), "kv_cache": _summary(2.0)}},
        ]
    },
    "batching": {"cases": [{"case": "a", "sequential": _summary(1.0), "batched": _summary(3.0)}]},
    "chunked-prefill": {
        "cases": [
            {
                "case": "a",
                "normal": _summary(1.0, decode_max_gap_ms=30.0),
                "chunked": _summary(1.0, decode_max_gap_ms=None),
            }
        ]
    },
    "scheduling": {
        "cases": [
            {
                "case": "a",
                "fcfs": _summary(1.0, high_latency_ms=300.0),
                "priority": _summary(1.0, high_latency_ms=100.0),
            }
        ]
    },
    "prefix-cache": {
        "cases": [{"case": "a", "prompt_tokens": 192, "prefix_cache": {"cached_tokens": 112}}]
    },
}


@pytest.mark.parametrize("suite", list(SYNTHETIC))
def test_micro_charts_are_written(suite, tmp_path: Path):
    from infer.bench.cli import study_module

    micro = study_module("micro")  # benchmarks/bench_micro.py
    path = micro.chart(suite, SYNTHETIC[suite], tmp_path / "x.png")
    assert path is not None and path.read_bytes()[:8] == PNG
    assert micro.incomplete(SYNTHETIC[suite]) == 0


def test_incomplete_micro_runs_are_counted():
    from infer.bench.cli import study_module

    _incomplete = study_module("micro").incomplete
    bad = {"cases": [{"case": "a", "sequential": _summary(1.0), "batched": _summary(2.0)}]}
    bad["cases"][0]["batched"]["completed"] = 1
    assert _incomplete(bad) == 1


def test_results_skeleton_stitches_the_latest_reports(tmp_path: Path):
    from infer.bench.results import READING, build_results

    reports = tmp_path / "benchmarks" / "reports"
    (reports / "ablation_1_m" / "rung").mkdir(parents=True)
    (reports / "micro_kv_cache.md").write_text(
        "# Micro benchmark: kv-cache\n\n![kv-cache](micro_kv_cache.png)\n\n## KV cache vs no cache\n| a |"
    )
    (reports / "ablation_1_m" / "ABLATION.md").write_text(
        "# Ablation ladder: m\n\n## Comparison\n![t](compare/compare_throughput.png)\n"
        "### rung\n![x](rung/ttft_cdf.png)\n"
    )
    out = tmp_path / "benchmarks" / "RESULTS.md"
    text = build_results(reports, out)
    assert text.startswith("# Results on this machine")
    assert "![kv-cache](reports/micro_kv_cache.png)" in text
    assert "### KV cache vs no cache" in text  # one level deeper
    assert "![t](reports/ablation_1_m/compare/compare_throughput.png)" in text
    assert "![x](reports/ablation_1_m/rung/ttft_cdf.png)" in text
    assert "# Micro benchmark" not in text and "# Ablation ladder" not in text
    assert "_Not run yet: `infer bench micro batching`._" in text
    assert "_Not run yet: `infer bench client --server URL`._" in text
    assert text.count(READING) == 2

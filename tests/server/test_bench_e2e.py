"""The benchmark suite end to end against a real ``infer serve`` on a tiny checkpoint.

Every workload runs at a tiny scale; the report's fields, counts and files are checked, and so
are the openai-SDK client tests and a two-rung ablation (which starts its own servers).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infer.bench.ablation import ServerProcess
from infer.bench.cli import main
from infer.bench.report import load_report
from infer.bench.workloads import WORKLOADS

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("bench-server") / "server.log"
    srv = ServerProcess(
        str(tiny_checkpoints["llama"]),
        ["--served-model-name", "tiny"],
        log,
        startup_timeout_s=240,
    )
    srv.start()
    yield srv
    srv.stop()


def _check_dist(d: dict) -> None:
    assert d["count"] > 0
    assert 0 <= d["p50"] <= d["p95"] <= d["p99"] <= d["max"]


def test_every_workload_against_a_real_server(server, tiny_checkpoints, tmp_path: Path):
    tok = str(tiny_checkpoints["llama"])
    rc = main(
        ["bench", "serve", "--server", server.url, "--model", "tiny", "--workload", "all",
         "--scale", "0.05", "--seed", "42", "--tokenizer", tok, "--out", str(tmp_path),
         "--no-progress", "--slo", "ttft_ms=60000,tpot_ms=10000"]
    )  # fmt: skip
    assert rc == 0  # no request lost
    (folder,) = tmp_path.iterdir()
    report = load_report(folder / "report.json")
    cfg = report["config"]
    assert cfg["model"] == "tiny" and cfg["seed"] == 42 and cfg["scale"] == 0.05
    assert cfg["max_model_len"] == 1024 and cfg["tokenizer"] == tok
    env = report["environment"]
    assert env["cpu"] and env["torch"] and env["python"]
    assert report["server_info"]["models"][0]["id"] == "tiny"
    assert list(report["workloads"]) == list(WORKLOADS)
    for name, w in report["workloads"].items():
        m, reqs = w["metrics"], w["requests"]
        assert m["configured"] == m["completed"] == len(reqs) == w["spec"]["num_requests"], name
        assert m["errors"] == 0 and m["usage_reported"] and w["warmup_errors"] == []
        assert m["output_throughput"] > 0 and m["request_throughput"] > 0
        assert m["slo_met"] == m["completed"]
        # the server's own counters over the workload (warm-ups included)
        assert w["server_stats"]["generation_tokens_total"] > 0
        assert w["server_stats"]["num_preemptions_total"] >= 0
        for key in ("ttft", "e2e"):
            _check_dist(m[key])
        assert m["output_tokens"] == sum(r["max_tokens"] for r in reqs)
        for r in reqs:
            assert r["success"] and r["finish_reason"] == "length"
            assert r["output_tokens"] == r["max_tokens"]  # ignore_eos honoured
            assert r["chunk_times_s"] == sorted(r["chunk_times_s"])
            assert 0 < r["ttft_s"] <= r["e2e_s"]
            # lengths set with the model's own tokenizer land on target (BOS, joins: a few)
            assert abs(r["prompt_tokens"] - r["prompt_len_target"]) <= 3, (name, r)
    arrivals = [r["start_s"] for r in report["workloads"]["continuous_batching"]["requests"]]
    assert arrivals == sorted(arrivals)
    md = (folder / "report.md").read_text()
    assert "## Cross-workload comparison" in md and "Lost requests" not in md
    assert "Server counters (warm-ups included): prompt tokens" in md
    for png in ("ttft_cdf.png", "itl_cdf.png", "throughput.png", "timeline_prefix_caching.png"):
        assert (folder / png).read_bytes()[:8] == PNG


def test_client_suite_against_a_real_server(server):
    from infer.bench.client_suite import run_client_suite

    out = run_client_suite(
        server.url, "tiny", endpoint="chat", prefix_tokens=200, num_warm=2, batch_sizes=(1, 2),
        max_tokens=6,
    )  # fmt: skip
    cache = out["caching"]
    assert cache["status"] == "ok" and len(cache["warm_ttfts_ms"]) == 2
    assert cache["cold_ttft_ms"] > 0 and cache["speedup"] is not None
    assert [(b["kind"], b["batch_size"]) for b in out["batching"]] == [
        ("sequential", 1), ("sequential", 2), ("concurrent", 1), ("concurrent", 2)
    ]  # fmt: skip
    for b in out["batching"]:
        assert b["success_rate"] == 1.0 and b["tps"] > 0, b


def test_ablation_two_rungs(tiny_checkpoints, tmp_path: Path):
    model = str(tiny_checkpoints["llama"])
    rc = main(
        ["bench", "ablation", "--model", model, "--workload", "baseline", "--scale", "0.03",
         "--rungs", "static+contiguous,+prefix_caching", "--out", str(tmp_path), "--no-progress",
         "--startup-timeout", "240"]
    )  # fmt: skip
    assert rc == 0
    (root,) = tmp_path.iterdir()
    log = (root / "ABLATION.md").read_text()
    assert "## +prefix_caching vs static+contiguous" in log
    static = load_report(root / "static-contiguous" / "report.json")
    prefix = load_report(root / "prefix_caching" / "report.json")
    assert "--batching-mode static" in static["config"]["server_flags"]
    assert "--enable-prefix-caching" in prefix["config"]["server_flags"]
    for rep in (static, prefix):
        m = rep["workloads"]["baseline"]["metrics"]
        assert m["completed"] == m["configured"] and m["errors"] == 0
    # each workload starts with a cold prefix cache where the server has one
    assert prefix["workloads"]["baseline"]["prefix_cache_reset"] is True
    assert static["workloads"]["baseline"]["prefix_cache_reset"] is False
    assert (root / "compare" / "compare_throughput.png").read_bytes()[:8] == PNG


def test_ablation_reports_a_rung_that_cannot_start(tiny_checkpoints, tmp_path: Path):
    model = str(tiny_checkpoints["llama"])
    rc = main(
        ["bench", "ablation", "--model", model, "--workload", "baseline", "--scale", "0.03",
         "--rungs", "static+contiguous", "--server-args=--no-such-flag", "--out",
         str(tmp_path), "--no-progress"]
    )  # fmt: skip
    assert rc == 1
    (root,) = tmp_path.iterdir()
    log = (root / "ABLATION.md").read_text()
    assert "**Rungs that failed**: static+contiguous" in log
    assert "> **Rung failed**: `server exited with 2" in log
    assert "--no-such-flag" in (root / "static-contiguous" / "server.log").read_text()


def test_closed_loop_over_client_processes_keeps_each_record_with_its_prompt(server):
    from infer.bench.online import ClientSpan, closed_loop_processes

    # Prompt i is 3 + i tokens long: the usage the server reports ties each record to its prompt.
    prompts = [list(range(10, 13 + i)) for i in range(7)]
    span = ClientSpan()
    records, wall = closed_loop_processes(server.url + "/v1", prompts, 4, 5, 3, model="tiny",
                                          span=span)  # fmt: skip
    assert span.end - span.start == wall and len(span.cpu_s) == 3  # one figure a process
    assert all(cpu > 0 for cpu in span.cpu_s)
    assert [r.index for r in records] == list(range(7))
    assert all(r.success for r in records), [r.error for r in records]
    assert [r.prompt_tokens for r in records] == [3 + i for i in range(7)]
    assert [r.output_tokens for r in records] == [5] * 7
    assert wall >= max(r.e2e_s for r in records) > 0

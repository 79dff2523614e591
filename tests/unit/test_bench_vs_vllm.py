"""``infer bench vs-vllm`` and ``decode-curve`` helpers: no server, no model."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infer.bench.decode_curve import decode_steps, longest_overshoot, with_context
from infer.bench.online import port_is_free, start_server, stop_server
from infer.bench.vs_vllm import (
    LLAMACPP_COUNT_NOTE,
    Cell,
    OtherLoad,
    _involuntary_switches,
    _vllm_dtype_note,
    check_targets,
    client_command,
    finish,
    lora_server_args,
    median_result,
    paired_http_loss,
    paired_ratios,
    parse_result,
    parse_workloads,
    peer_dtype,
    render,
    server_command,
    server_groups,
)


def test_workloads_default_cells_and_explicit_concurrency():
    assert [c.key for c in parse_workloads("64x64,1024x128")] == [
        "64x64@1",
        "64x64@16",
        "64x64@64",
        "1024x128@16",
    ]
    assert [c.key for c in parse_workloads("64x64@1+16, 32x8@2,64x64@1")] == [
        "64x64@1",
        "64x64@16",
        "32x8@2",
    ]
    for bad in ("64", "64x64@", "32x8", "0x8@1", ""):
        with pytest.raises(ValueError):
            parse_workloads(bad)


def test_shared_prefix_workloads_use_vllms_prefix_repetition_dataset():
    cells = parse_workloads("shared512/8+32x64@16+64,shared1024+16x64@16")
    assert [c.key for c in cells] == [
        "shared512/8+32x64@16",
        "shared512/8+32x64@64",
        "shared1024/4+16x64@16",  # 4 prefixes unless told
    ]
    with pytest.raises(ValueError, match="no default concurrency"):
        parse_workloads("shared512+32x64")
    cmd = client_command(Path("vllm"), cells[0], base_url="u", model_name="m", tokenizer=Path("t"),
                         num_prompts=64, seed=1, result_dir=Path("r"), result_filename="f")  # fmt: skip
    flags = dict(zip(cmd[3::1], cmd[4::1], strict=False))
    assert flags["--dataset-name"] == "prefix_repetition"
    assert flags["--prefix-repetition-prefix-len"] == "512"
    assert flags["--prefix-repetition-suffix-len"] == "32"
    assert flags["--prefix-repetition-num-prefixes"] == "8"
    assert flags["--prefix-repetition-output-len"] == "64"
    assert "--random-input-len" not in flags


def test_lora_workloads_spread_requests_over_the_adapters():
    cells = parse_workloads("64x64@1+16,lora/64x64@16+1")
    assert [c.key for c in cells] == ["64x64@1", "64x64@16", "lora/64x64@16", "lora/64x64@1"]
    assert [c.lora for c in cells] == [False, False, True, True]
    with pytest.raises(ValueError, match="no default concurrency"):
        parse_workloads("lora/64x64")
    assert server_groups(cells) == [(False, cells[:2]), (True, cells[2:])]
    assert server_groups(cells[2:]) == [(True, cells[2:])]
    common = {"base_url": "u", "model_name": "m", "tokenizer": Path("t"), "num_prompts": 64,
              "seed": 1, "result_dir": Path("r"), "result_filename": "f"}  # fmt: skip
    base = client_command(Path("vllm"), cells[1], **common)
    assert "--lora-modules" not in base and "--lora-assignment" not in base
    cmd = client_command(Path("vllm"), cells[2], **common, lora_modules=["a0", "a1"])
    i = cmd.index("--lora-modules")
    assert cmd[i + 1 : i + 3] == ["a0", "a1"] and "--lora-assignment" not in cmd  # random
    assert cmd[cmd.index("--model") + 1] == "m"  # the base name; each request names an adapter
    assert cmd[:-3] == base  # otherwise the same command
    warm = client_command(Path("vllm"), cells[2], **common, lora_modules=["a0", "a1"],
                          lora_assignment="round-robin")  # fmt: skip
    assert warm[-2:] == ["--lora-assignment", "round-robin"]
    assert lora_server_args(["a0=/p/0", "a1=/p/1"], 2, 16) == [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", "a0=/p/0", "a1=/p/1",
    ]  # fmt: skip


def test_lora_target_and_cost_in_the_report(tmp_path):
    rows = {("infer", "64x64@16"): 500.0, ("infer", "lora/64x64@16"): 450.0,
            ("vllm", "64x64@16"): 200.0, ("vllm", "lora/64x64@16"): 100.0}  # fmt: skip
    cells = {p: {} for p, _ in rows}
    for (peer, key), tok in rows.items():
        cells[peer][key] = median_result([_row(tok)])
    t = {x["target"]: x for x in check_targets(cells)}
    lora = t["lora/64x64@16: infer output tok/s >= 1.5x vLLM's"]
    assert lora["status"] == "pass" and "4.50x" in lora["figure"]
    base = {p: {k: v for k, v in c.items() if not k.startswith("lora/")} for p, c in cells.items()}
    assert not any(x["target"].startswith("lora/") for x in check_targets(base))
    report = {
        "created": "now", "argv": "infer bench vs-vllm",
        "config": {"model": "/m", "served_name": "m", "peers": ["infer", "vllm"],
                   "dtype": "bfloat16", "max_num_seqs": 64, "max_model_len": 2048,
                   "infer_args": "", "vllm_args": "", "runs": 1, "num_prompts": None,
                   "warmup_output_len": 16, "vllm_venv": "/venv",
                   "lora_modules": ["a0=/p/0", "a1=/p/1"],
                   "lora_server_args": "--enable-lora --max-loras 2 --max-lora-rank 16 "
                   "--lora-modules a0=/p/0 a1=/p/1"},
        "cells": [{"key": "64x64@16"}, {"key": "lora/64x64@16"}],
        "versions": {"infer": "0.1", "torch": "2", "torch_threads": 2, "python": "3",
                     "cpu": "x", "cpus": 2, "platform": "linux"},
        "client_env": {"A": "1"},
        "servers": [{"round": 0, "peer": "vllm", "lora": True, "server_log": "l",
                     "server_command": "vllm serve /m --enable-lora", "server_env": {}}],
        "runs": [{"peer": p, "cell": k, "round": 0, "num_prompts": 64, **_row(tok)}
                 | {"load_before": [1.0, 1.0, 1.0], "other_cpu_cores": 0.0}
                 for (p, k), tok in rows.items()],
    }  # fmt: skip
    finish(report, tmp_path)
    md = (tmp_path / "vs_vllm.md").read_text()
    assert "| lora/64x64 | 16 | 450.0 | 100.0 | 4.50x |" in md
    assert (
        "- lora/64x64@16: infer 90% (450.0 vs 500.0 tok/s); vLLM 50% (100.0 vs 200.0 tok/s)" in md
    )
    assert "`vllm bench serve --lora-modules a0 a1`" in md
    assert "round 0 vllm LoRA server" in md


def test_prefix_counters_read_both_peers_metric_names(tmp_path):
    import http.server
    import threading

    from infer.bench.vs_vllm import prefix_counters

    body = (
        b"# HELP vllm:prefix_cache_queries_total x\n"
        b'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 1000.0\n'
        b'vllm:prefix_cache_hits_total{model_name="m",engine="0"} 750.0\n'
    )

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert prefix_counters(f"http://127.0.0.1:{server.server_port}") == (1000.0, 750.0)
    finally:
        server.shutdown()
    assert prefix_counters("http://127.0.0.1:9") is None  # nothing listening


def test_client_command_uses_vllm_bench_flags():
    cmd = client_command(
        Path("/venv/bin/vllm"),
        Cell(1024, 128, 16),
        base_url="http://127.0.0.1:8321",
        model_name="llama-100m",
        tokenizer=Path("/models/llama-100m"),
        num_prompts=64,
        seed=5,
        result_dir=Path("/out/results"),
        result_filename="r.json",
    )
    assert cmd[:3] == ["/venv/bin/vllm", "bench", "serve"]
    flags = dict(zip(cmd[3::1], cmd[4::1], strict=False))
    expect = {
        "--backend": "openai",
        "--endpoint": "/v1/completions",
        "--dataset-name": "random",
        "--random-input-len": "1024",
        "--random-output-len": "128",
        "--temperature": "0",
        "--num-prompts": "64",
        "--max-concurrency": "16",
        "--model": "llama-100m",
        "--tokenizer": "/models/llama-100m",
        "--percentile-metrics": "ttft,tpot,itl,e2el",
        "--metric-percentiles": "50,99",
        "--result-dir": "/out/results",
        "--result-filename": "r.json",
        "--seed": "5",
    }
    for k, v in expect.items():
        assert flags[k] == v, k
    assert {"--ignore-eos", "--save-result"} <= set(cmd)
    warm = client_command(
        Path("vllm"),
        Cell(64, 64, 4),
        base_url="u",
        model_name="m",
        tokenizer=Path("t"),
        num_prompts=4,
        seed=1,
        result_dir=Path("d"),
        result_filename="w.json",
        output_len=16,
    )
    assert warm[warm.index("--random-output-len") + 1] == "16"


VLLM_RESULT = {
    "duration": 10.0,
    "completed": 64,
    "failed": 0,
    "num_prompts": 64,
    "total_input_tokens": 4096,
    "total_output_tokens": 4096,
    "request_throughput": 6.4,
    "output_throughput": 409.6,
    "mean_ttft_ms": 120.0,
    "median_ttft_ms": 110.0,
    "p50_ttft_ms": 110.0,
    "p99_ttft_ms": 300.0,
    "median_tpot_ms": 30.0,
    "p50_tpot_ms": 30.0,
    "p99_tpot_ms": 40.0,
    "median_itl_ms": 29.0,
    "p50_itl_ms": 29.0,
    "p99_itl_ms": 80.0,
    "p50_e2el_ms": 2000.0,
    "p99_e2el_ms": 2500.0,
}


def test_parse_result_reads_vllm_keys():
    r = parse_result(VLLM_RESULT)
    assert r["output_tok_s"] == 409.6 and r["completed"] == 64 and r["failed"] == 0
    assert r["ttft_p50_ms"] == 110.0 and r["itl_p99_ms"] == 80.0 and r["tpot_p50_ms"] == 30.0
    assert parse_result({"median_ttft_ms": 5.0})["ttft_p50_ms"] == 5.0  # no p50 key: median


def _row(tok_s: float, **metrics: float) -> dict:
    return {"result": parse_result(VLLM_RESULT | {"output_throughput": tok_s, **metrics})}


def test_median_result_is_per_metric_and_skips_failed_runs():
    runs = [_row(100.0), _row(300.0), _row(200.0), {"error": "boom"}]
    m = median_result(runs)
    assert m["output_tok_s"] == 200.0 and m["ok_runs"] == 3 and m["runs"] == 4
    assert m["output_tok_s_runs"] == [100.0, 300.0, 200.0]
    assert median_result([{"error": "boom"}])["error"] == "boom"


def test_targets_pass_miss_and_not_measured():
    cells = {
        "infer": {
            "64x64@1": median_result([_row(30, p50_tpot_ms=20.0, p50_itl_ms=20.0)]),
            "64x64@16": median_result([_row(500, p50_itl_ms=40.0, p50_tpot_ms=30.0)]),
            "64x64@64": median_result([_row(700)]),
        },
        "vllm": {
            "64x64@1": median_result([_row(25, p50_tpot_ms=25.0)]),
            "64x64@16": median_result([_row(200)]),
            "64x64@64": median_result([_row(400)]),
        },
    }
    t = {x["target"]: x for x in check_targets(cells, offline={"output_tok_s": 510.0})}
    assert t["64x64@16: infer output tok/s >= 2x vLLM's"]["status"] == "pass"
    assert t["64x64@64: infer output tok/s >= 2x vLLM's"]["status"] == "miss"
    assert "1.75x" in t["64x64@64: infer output tok/s >= 2x vLLM's"]["figure"]
    assert t["64x64@1: infer TPOT p50 <= vLLM's"]["status"] == "pass"
    assert t["1024x128@16: infer output tok/s >= 1.5x vLLM's"]["status"] == "n/a"
    assert t["1024x128@16: infer TTFT p50 <= vLLM's"]["status"] == "n/a"
    assert t["64x64@1: infer ITL p50 <= 1.2x its TPOT p50"]["status"] == "pass"
    assert t["64x64@16: infer ITL p50 <= 1.2x its TPOT p50"]["status"] == "miss"  # 1.33x
    loss = t["64x64@16: infer over HTTP loses <= 5% vs the offline engine"]
    assert loss["status"] == "pass" and "+2.0%" in loss["figure"]  # 500 vs 510
    assert "offline" not in " ".join(x["target"] for x in check_targets(cells))


def test_finish_writes_json_and_markdown(tmp_path):
    runs = [
        {"peer": p, "cell": "64x64@16", "round": 0, "num_prompts": 64, **_row(tok)}
        | {"load_before": [1.0, 1.0, 1.0], "other_cpu_cores": other}
        for p, tok, other in (("infer", 500.0, 0.01), ("vllm", 200.0, 0.9))
    ]
    report = {
        "created": "now",
        "argv": "infer bench vs-vllm",
        "config": {
            "model": "/m",
            "served_name": "m",
            "peers": ["infer", "vllm"],
            "dtype": "bfloat16",
            "max_num_seqs": 64,
            "max_model_len": 2048,
            "infer_args": "",
            "vllm_args": "",
            "runs": 1,
            "num_prompts": None,
            "warmup_output_len": 16,
            "vllm_venv": "/venv",
        },
        "cells": [{"key": "64x64@16"}],
        "versions": {
            "infer": "0.1",
            "torch": "2",
            "torch_threads": 2,
            "python": "3",
            "cpu": "x",
            "cpus": 2,
            "platform": "linux",
        },
        "client_env": {"A": "1"},
        "servers": [
            {
                "round": 0,
                "peer": "vllm",
                "server_command": "vllm serve /m",
                "server_log": "l",
                "server_env": {"VLLM_TARGET_DEVICE": "cpu"},
            },
        ],  # fmt: skip
        "runs": runs,
    }
    finish(report, tmp_path)
    md = (tmp_path / "vs_vllm.md").read_text()
    assert "| 64x64 | 16 | 500.0 | 200.0 | 2.50x |" in md
    assert "**PASS** 64x64@16: infer output tok/s >= 2x vLLM's: 2.50x" in md
    assert "⚠ disturbed" in md and "1 of 2 measured runs" in md
    assert "VLLM_TARGET_DEVICE=cpu vllm serve /m" in md
    data = json.loads((tmp_path / "vs_vllm.json").read_text())
    assert data["medians"]["infer"]["64x64@16"]["output_tok_s"] == 500.0
    assert data["paired_ratios"]["64x64@16"] == {"runs": [2.5], "median": 2.5}
    assert "Paired by round" not in md  # one round: nothing to pair beyond the table
    shared = "shared512/4+32x64@16"  # a shared-prefix cell: ordered, shown with its hit rate
    report["cells"].append({"key": shared})
    runs = list(runs)  # report["runs"] grows below
    for r in runs:
        row = r | {"cell": shared} | _row(r["result"]["output_tok_s"])
        row["result"] = row["result"] | {"prefix_hit_rate": 0.9}
        report["runs"].append(row)
    finish(report, tmp_path)
    assert (
        "| shared512/4+32x64 | 16 | 500.0 | 200.0 | 2.50x |"
        in (tmp_path / "vs_vllm.md").read_text()
    )
    assert "prefix cache hit rate 90% / 90%" in (tmp_path / "vs_vllm.md").read_text()
    report["cells"].pop()
    report["runs"] = runs + [r | {"round": 1} | _row(r["result"]["output_tok_s"] / 2) for r in runs]
    report["runs"][-1] |= _row(125.0)  # round 1: 250 / 125
    finish(report, tmp_path)
    md = (tmp_path / "vs_vllm.md").read_text()
    assert "- 64x64@16: median 2.25x (rounds: 2.50, 2.00)" in md


def test_paired_ratios_pair_peers_within_each_round():
    def run(peer, rnd, tok, cell="1024x128@16"):
        return {"peer": peer, "cell": cell, "round": rnd, **_row(tok)}

    runs = [
        run("infer", 0, 150.0), run("vllm", 0, 100.0),  # 1.5
        run("vllm", 1, 120.0), run("infer", 1, 168.0),  # 1.4
        run("infer", 2, 160.0), {"peer": "vllm", "cell": "1024x128@16", "round": 2, "error": "x"},
        run("infer", 3, 130.0), run("vllm", 3, 80.0),  # 1.625
        run("infer", 0, 500.0, "64x64@16"),
    ]  # fmt: skip
    got = paired_ratios(runs, ["1024x128@16", "64x64@16"])
    assert got["1024x128@16"]["runs"] == pytest.approx([1.5, 1.4, 1.625])
    assert got["1024x128@16"]["median"] == pytest.approx(1.5)
    assert "64x64@16" not in got  # no vLLM run to pair with


def test_paired_http_loss_compares_each_round_with_its_offline_run():
    runs = [
        {"peer": "infer", "cell": "64x64@16", "round": 1, **_row(760.0)},
        {"peer": "infer", "cell": "64x64@16", "round": 0, **_row(720.0)},
        {"peer": "vllm", "cell": "64x64@16", "round": 0, **_row(400.0)},
        {"peer": "infer", "cell": "64x64@1", "round": 0, **_row(100.0)},
        {"peer": "infer", "cell": "64x64@16", "round": 2, **_row(700.0)},
    ]
    offline = [
        {"round": 0, "result": {"output_tok_s": 800.0}},
        {"round": 1, "result": {"output_tok_s": 800.0}},
        {"round": 2, "error": "offline run exited 1"},
    ]
    got = paired_http_loss(runs, offline)
    assert got["runs"] == pytest.approx([0.10, 0.05])  # round order; round 2 has no pair
    assert got["median"] == pytest.approx(0.075)
    assert paired_http_loss(runs, []) is None


def test_server_commands_share_the_serving_flags():
    for peer in ("infer", "vllm"):
        cmd, env = server_command(
            peer, Path("/m"), 8321, "bfloat16", 64, max_model_len=2048, served_name="x"
        )
        text = " ".join(cmd)
        assert "--max-num-seqs 64" in text and "--max-model-len 2048" in text
        assert "--dtype bfloat16" in text and "--served-model-name x" in text
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    cmd, _ = server_command("infer", Path("/m"), 1, "bfloat16", 4, '--torch-threads "1"')
    assert cmd[-2:] == ["--torch-threads", "1"]


def test_llamacpp_server_command_one_slot_per_sequence_and_every_core(monkeypatch):
    cmd, _ = server_command(
        "llamacpp", Path("/g/m-q4km.gguf"), 8321, "bfloat16", 16, '--flash-attn "on"',
        max_model_len=2048, served_name="llama-1b", llamacpp_binary="/b/llama-server", threads=2,
    )  # fmt: skip
    assert cmd == [
        "/b/llama-server", "--model", "/g/m-q4km.gguf", "--host", "127.0.0.1", "--port", "8321",
        "-np", "16", "-c", "32768", "-t", "2", "-tb", "2", "--alias", "llama-1b",
        "--flash-attn", "on",
    ]  # fmt: skip
    monkeypatch.setenv("LLAMACPP_BIN", "/opt/llama-server")
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    cmd, _ = server_command("llamacpp", Path("/g.gguf"), 1, "bfloat16", 4, max_model_len=512)
    assert cmd[0] == "/opt/llama-server" and "--dtype" not in cmd
    assert cmd[cmd.index("-c") + 1] == "2048" and cmd[cmd.index("-t") + 1] == "7"
    assert cmd[cmd.index("-tb") + 1] == "7"


def test_llamacpp_output_tokens_are_counted_by_request():
    # 62 of 64 requests completed, each with 64 tokens (--ignore-eos); the client re-tokenized
    # llama-server's text and counted 1000. Per-request figures (--save-detailed): request i
    # took 100 ms to its first token and 100 + 63 * (10 + i) ms in all: TPOT 10 + i ms.
    n = 64
    ttfts = [0.1] * 62 + [0.0, 0.0]
    latencies = [0.1 + 0.063 * (10 + i) for i in range(62)] + [0.0, 0.0]
    errors = [""] * 62 + ["Traceback ...\naiohttp.ClientOSError: [Errno 104] reset"] * 2
    data = VLLM_RESULT | {
        "completed": 62, "failed": 2, "total_output_tokens": 1000, "output_throughput": 100.0,
        "ttfts": ttfts, "latencies": latencies, "errors": errors, "p50_tpot_ms": 99.0,
        "itls": [[0.02] * 63 + [0.0001]] * 61 + [[0.03] * 63 + [0.0001]] + [[], []],
    }  # fmt: skip
    r = parse_result(data, output_len=n)
    assert r["total_output_tokens"] == 62 * 64 and r["client_output_tokens"] == 1000
    assert r["output_tok_s"] == pytest.approx(62 * 64 / 10.0)
    assert r["tpot_p50_ms"] == pytest.approx(10 + 30.5) and r["client_tpot_p50_ms"] == 99.0
    assert r["tpot_p99_ms"] == pytest.approx(10 + 0.99 * 61)
    assert r["failed"] == 2 and r["errors"] == ["aiohttp.ClientOSError: [Errno 104] reset"]
    # ITL without each stream's closing chunk (no token, ~0 ms after the last one)
    assert r["itl_p50_ms"] == pytest.approx(20.0) and r["itl_p99_ms"] == pytest.approx(30.0)
    assert r["client_itl_p50_ms"] == 29.0
    plain = parse_result(data)  # other peers: the client's own count
    assert plain["output_tok_s"] == 100.0 and plain["tpot_p50_ms"] == 99.0
    assert "client_output_tokens" not in plain
    summary = parse_result(VLLM_RESULT | {"completed": 4, "total_output_tokens": 70}, 64)
    assert summary["output_tok_s"] == pytest.approx(25.6)  # no per-request figures: TPOT kept
    assert summary["tpot_p50_ms"] == 30.0
    cmd = client_command(Path("vllm"), Cell(64, 64, 1), base_url="u", model_name="m",
                         tokenizer=Path("t"), num_prompts=4, seed=1, result_dir=Path("r"),
                         result_filename="f", detailed=True)  # fmt: skip
    assert "--save-detailed" in cmd
    assert "--save-detailed" not in client_command(
        Path("vllm"), Cell(64, 64, 1), base_url="u", model_name="m", tokenizer=Path("t"),
        num_prompts=4, seed=1, result_dir=Path("r"), result_filename="f",
    )  # fmt: skip


def _llamacpp_report(peers: list[str]) -> dict:
    runs = [
        {"peer": p, "cell": "64x64@16", "round": rnd, "num_prompts": 64, **_row(tok)}
        | {"load_before": [1.0, 1.0, 1.0], "other_cpu_cores": 0.0}
        for rnd, scale in ((0, 1.0), (1, 0.5))
        for p, tok in (("infer", 500.0 * scale), ("llamacpp", 250.0 * scale), ("vllm", 200.0))
        if p in peers
    ]
    return {
        "created": "now",
        "argv": "infer bench vs-vllm",
        "config": {
            "model": "/m", "served_name": "m", "peers": peers, "dtype": "bfloat16",
            "max_num_seqs": 16, "max_model_len": 2048, "infer_args": "--quantization int4",
            "vllm_args": "", "runs": 2, "num_prompts": None, "warmup_output_len": 16,
            "vllm_venv": "/venv", "llamacpp_model": "/g/m-q4km.gguf",
            "llamacpp_bin": "/b/llama-server", "llamacpp_args": "", "llamacpp_threads": 2,
        },
        "cells": [{"key": "64x64@16"}],
        "versions": {
            "infer": "0.1", "torch": "2", "torch_threads": 2, "python": "3", "cpu": "x",
            "cpus": 2, "platform": "linux", "llamacpp": "version: 1 (abc)\nbuilt with cc",
        },
        "client_env": {"A": "1"},
        "servers": [],
        "runs": runs,
    }  # fmt: skip


def test_report_names_the_other_peer_llamacpp(tmp_path):
    report = _llamacpp_report(["infer", "llamacpp"])
    finish(report, tmp_path)
    md = (tmp_path / "vs_vllm.md").read_text()
    assert md.startswith("# infer vs llama.cpp over HTTP")
    assert "| workload | C | infer tok/s | llama.cpp tok/s | infer / llama.cpp |" in md
    assert "| 64x64 | 16 | 375.0 | 187.5 | 2.00x |" in md  # medians of the two rounds
    assert "done infer / llama.cpp" in md and "vLLM tok/s" not in md
    assert "**PASS** 64x64@16: infer output tok/s >= 2x llama.cpp's: 2.00x" in md
    assert "- 64x64@16: median 2.00x (rounds: 2.00, 2.00)" in md
    assert "Paired by round (infer / llama.cpp of the same round" in md
    assert "`-np 16 -c 32768 -t 2 -tb 2`" in md and "GGUF `/g/m-q4km.gguf`" in md
    assert LLAMACPP_COUNT_NOTE in md
    assert "`--version`: version: 1 (abc); built with cc" in md
    data = json.loads((tmp_path / "vs_vllm.json").read_text())
    assert data["paired_ratios"]["64x64@16"]["median"] == 2.0
    assert data["paired_ratios_by_peer"]["llamacpp"] == data["paired_ratios"]
    assert paired_ratios(report["runs"], ["64x64@16"]) == {}  # no vLLM run to pair with


def test_report_with_vllm_and_llamacpp_has_a_table_for_each(tmp_path):
    report = _llamacpp_report(["infer", "vllm", "llamacpp"])
    md = render(report | {"medians": {}, "targets": []})  # before finish: nothing measured
    assert md.startswith("# infer vs vLLM and llama.cpp over HTTP")
    finish(report, tmp_path)
    md = (tmp_path / "vs_vllm.md").read_text()
    assert "infer vs vLLM:" in md and "infer vs llama.cpp:" in md
    assert "| 64x64 | 16 | 375.0 | 200.0 | 1.88x |" in md
    assert "| 64x64 | 16 | 375.0 | 187.5 | 2.00x |" in md
    assert "vLLM extra args: `-`, llama.cpp extra args: `-`" in md
    targets = {t["target"] for t in report["targets"]}
    assert {"64x64@16: infer output tok/s >= 2x vLLM's",
            "64x64@16: infer output tok/s >= 2x llama.cpp's"} <= targets  # fmt: skip
    assert set(report["paired_ratios_by_peer"]) == {"vllm", "llamacpp"}


def test_llamacpp_peer_needs_its_gguf(tmp_path):
    from infer.bench.cli import main

    with pytest.raises(SystemExit, match="--llamacpp-model"):
        main(["bench", "vs-vllm", "--peers", "infer,llamacpp", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no such file"):
        main(["bench", "vs-vllm", "--peers", "llamacpp", "--out", str(tmp_path),
              "--llamacpp-model", str(tmp_path / "missing.gguf")])  # fmt: skip
    with pytest.raises(SystemExit, match="unknown peer"):
        main(["bench", "vs-vllm", "--peers", "infer,sglang", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="lora/ workloads need --lora-modules"):
        main(["bench", "vs-vllm", "--workloads", "lora/64x64@16", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs a lora/ workload"):
        main(["bench", "vs-vllm", "--lora-modules", "a=/p", "--out", str(tmp_path)])


def test_vllm_may_serve_in_its_own_dtype():
    args = argparse.Namespace(dtype="bfloat16", vllm_dtype=None)
    assert peer_dtype("vllm", args) == peer_dtype("infer", args) == "bfloat16"
    args.vllm_dtype = "float32"
    assert (peer_dtype("infer", args), peer_dtype("vllm", args)) == ("bfloat16", "float32")
    cfg = {"dtype": "bfloat16", "vllm_dtype": "float32"}
    assert _vllm_dtype_note(cfg) == " (vLLM: `--dtype float32`)"
    assert _vllm_dtype_note({"dtype": "bfloat16"}) == ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stop_server_kills_the_whole_group_and_frees_the_port(tmp_path):
    port = _free_port()
    code = (
        "import signal, socket, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # a server that ignores SIGTERM
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n"
        f"open({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    proc = start_server([sys.executable, "-c", code], dict(os.environ), tmp_path / "s.log", port)
    deadline = time.time() + 30
    while time.time() < deadline and (port_is_free(port) or not (tmp_path / "child").exists()):
        time.sleep(0.05)
    time.sleep(0.1)  # the pid file may exist a moment before its content
    child = int((tmp_path / "child").read_text())
    with pytest.raises(RuntimeError, match="already in use"):
        start_server(["true"], {}, tmp_path / "t.log", port)
    stop_server(proc, port, grace_s=0.5)
    assert proc.returncode == -signal.SIGKILL
    assert port_is_free(port)
    for _ in range(100):  # the child was killed with the group
        if not Path(f"/proc/{child}").exists() or "Z" in _proc_state(child):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the server's child survived stop_server")


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_decode_curve_config_copy_and_lengths(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    (model / "model.safetensors").write_bytes(b"w")
    same, derived = with_context(model, 2048, tmp_path / "out")
    assert same == model and not derived
    folder, derived = with_context(model, 4352, tmp_path / "out")
    assert derived and folder != model
    assert json.loads((folder / "config.json").read_text())["max_position_embeddings"] == 4352
    assert (folder / "model.safetensors").is_symlink()
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 2048
    with_context(model, 4352, tmp_path / "out")  # again: links replaced, no error
    assert decode_steps(8, 3) == 50 and longest_overshoot(8, 3) == 27
    assert 4096 + longest_overshoot(8, 3) <= 4352


def test_cli_registers_vs_vllm_and_decode_curve():
    from infer.bench.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "vs-vllm", "--help"])
    assert exc.value.code == 0
    with pytest.raises(SystemExit) as exc:
        main(["bench", "decode-curve", "--help"])
    assert exc.value.code == 0


def test_offline_worker_usage_without_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "infer.bench.vs_vllm"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1 and "infer bench vs-vllm" in out.stderr


def test_involuntary_switches_reads_the_status_line():
    status = "Name:\tpython\nvoluntary_ctxt_switches:\t12\nnonvoluntary_ctxt_switches:\t345\n"
    assert _involuntary_switches(status) == 345
    assert _involuntary_switches("Name:\tx\n") == 0


def test_server_figures_count_the_server_groups_cpu():
    # A stand-in server in its own process group burns 0.3 s of CPU (its own clock, so the
    # figure does not depend on the machine's speed) after it is told to, i.e. after the
    # baseline was read (its interpreter's start-up, ~0.05 s of CPU under load, is not
    # counted), then reports and waits.
    burn = (
        "import sys, time\n"
        "sys.stdin.readline()\n"
        "t0 = time.process_time()\n"
        "while time.process_time() - t0 < 0.3: pass\n"
        "print('done', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        load = OtherLoad(proc.pid)
        t0 = time.perf_counter()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        wall = time.perf_counter() - t0
        figures = load.server(duration_s=wall)
        assert figures["server_cpu_cores"] * wall >= 0.25
        assert figures["server_preempted_per_s"] >= 0
        assert load.server(duration_s=None) == {}  # no measured run: no figures
    finally:
        proc.kill()
        proc.wait()

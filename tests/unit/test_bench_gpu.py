"""``infer bench gpu`` without a GPU: the targets and the report from made-up results, the
refusal without CUDA, the kernel section's bookkeeping against a reference kernel, and the
whole flow on a tiny model on the CPU (the hidden ``--device cpu --tiny``)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from infer.bench import gpu
from infer.bench.cli import add_gpu_args, checkout_benchmark

gpu_kernels = checkout_benchmark("gpu_kernels")  # benchmarks/gpu_kernels.py: outside the package


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_gpu_args(p)
    return gpu.resolve_args(p.parse_args(list(argv)))


def _load(tok_s: float, itl: float = 1.0) -> dict:
    return {
        "output_tok_s": tok_s,
        "itl_ms": {"p50": itl},
        "ttft_ms": {"p50": 20.0},
        "mean_step_ms": itl,
    }


def _hf(n: int, tok_s: float) -> dict:
    tokens = n * 128
    return {"prompts": n, "max_new_tokens": 128, "tokens": tokens, "wall_s": tokens / tok_s,
            "tok_s": tok_s}  # fmt: skip


def _report(**over) -> dict:
    r = {
        "machine": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.5"},
        "model": {"path": "/m", "params": 1_235_814_400, "weight_bytes": 2_471_628_800},
        "prompt_len": 128,
        "output_len": 128,
        "sections": {"model": {"status": "ok", "seconds": 20.0}},
        "roofline": {"read_GBps": 3000.0, "weight_read_ms": 0.8, "matmul_TFLOPs": 700.0},
        "engine": {
            "graphs": {
                "loads": {
                    "128x128@1": _load(900.0, itl=1.1),
                    "128x128@64": _load(16_000.0),
                    "128x128@256": _load(41_000.0),
                },
                "buckets": {"1": {"ms": 1.0}, "256": {"ms": 5.0}},
            },
            "eager": {"loads": {}, "buckets": {"1": {"ms": 3.0}, "256": {"ms": 6.0}}},
            "torch-eager": {"loads": {"128x128@64": _load(3200.0)}},
        },
        "kernels": {
            "rows": [
                {
                    "batch": 16,
                    "context": 512,
                    "kv_bytes": 1,
                    "ms": 1,
                    "GBps": 2400.0,
                    "pct_of_read": 0.8,
                },
                {
                    "batch": 256,
                    "context": 8192,
                    "kv_bytes": 1,
                    "ms": 1,
                    "GBps": 2700.0,
                    "pct_of_read": 0.9,
                },
                # batch 1 is outside the target's range: its 10% does not count
                {
                    "batch": 1,
                    "context": 512,
                    "kv_bytes": 1,
                    "ms": 1,
                    "GBps": 300.0,
                    "pct_of_read": 0.1,
                },
            ],  # fmt: skip
            "split": {
                "context": 8192,
                "splits_ms": {"1": 0.5, "8": 0.1},
                "best_split": 8,
                "best_ms": 0.1,
                "speedup": 5.0,
            },  # fmt: skip
        },
        "hf": {"rows": {"64": _hf(64, 1000.0), "256": _hf(256, 4000.0)}},
        "http": {
            "load": "128x128@64",
            "concurrency": 64,
            "output_tok_s": 15_000.0,
            "offline_tok_s": 16_000.0,
            "ratio": 15_000.0 / 16_000.0,
            "ttft_ms_p50": 30.0,
            "itl_ms_p50": 2.5,
            "server_start_s": 20.0,
        },  # fmt: skip
    }
    r.update(over)
    return r


def _status(rows: list[dict]) -> dict[str, str]:
    return {row["target"].split(" (")[0]: row["status"] for row in rows}


def test_every_target_met():
    rows = gpu.targets(_report())
    assert [r["status"] for r in rows] == ["MET"] * 9, rows
    assert "1.100 ms = 1.38x 0.800 ms" in rows[0]["measured"]
    assert "lowest 80% at 16x512" in rows[6]["measured"]
    assert rows[7]["measured"] == "15,000 / 16,000 = 0.94x"


def test_misses_and_unmeasured_targets():
    r = _report()
    r["engine"]["graphs"]["loads"]["128x128@1"]["itl_ms"]["p50"] = 1.3  # 1.63x the limit
    r["engine"]["graphs"]["loads"]["128x128@256"]["output_tok_s"] = 39_999.0
    r["engine"]["graphs"]["buckets"]["256"]["ms"] = 6.0  # a tie with eager is not faster
    r["hf"]["rows"]["256"]["tok_s"] = 4200.0  # 41,000 / 4,200 = 9.8x
    r["kernels"]["rows"][0]["pct_of_read"] = 0.69
    r["kernels"]["split"]["speedup"] = 3.9
    del r["engine"]["graphs"]["loads"]["128x128@64"]
    r["http"].update(output_tok_s=14_000.0, ratio=14_000.0 / 16_000.0)  # 0.88x: > 10% slower
    got = _status(gpu.targets(r))
    assert got == {
        "batch-1 decode step <= 1.5x weight-read limit": "MISS",
        "C=256 128/128 >= 40,000 tok/s": "MISS",
        "C=64 128/128 >= 15,000 tok/s": "N/A",
        "graphs faster than eager at every decode bucket": "MISS",
        ">= 10x transformers generate_batch at 64": "N/A",
        ">= 10x transformers generate_batch at 256": "MISS",
        "decode attention >= 70% of the read rate": "MISS",
        "HTTP": "MISS",
        "batch 1 at 8192: split-K >= 4x one split": "MISS",
    }


def test_an_empty_report_is_all_not_measured_and_still_renders():
    r = {"sections": {"model": {"status": "error", "seconds": 1.0, "error": "Traceback\nBoom"}}}
    assert {t["status"] for t in gpu.targets(r)} == {"N/A"}
    md = gpu.render_markdown(r)
    assert "| model | error | 1.0 | Boom |" in md
    assert md.count("**N/A**") == 9
    assert "Boom" in gpu.summary(r)


def test_markdown_tables_from_a_result():
    r = _report()
    r["engine"]["graphs"]["loads"]["128x128@64"]["step_kinds"] = {"decode replayed": 250,
                                                                  "mixed eager": 3}  # fmt: skip
    r["engine"]["graphs"]["loads"]["128x128@64"]["gpu_busy_pct"] = 96.4
    r["targets"] = gpu.targets(r)
    md = gpu.render_markdown(r)
    assert "Device: **NVIDIA H100 80GB HBM3**" in md
    assert "1.236B parameters, 2.47 GB" in md
    # graphs vs the torch-eager baseline at C=64: 16,000 / 3,200
    assert "| graphs | 128x128@64 | 16,000 | 5.00x | 1.00 | 20 | 1.00 | 96 | 250 decode " \
           "replayed, 3 mixed eager |" in md  # fmt: skip
    assert "| 1 | 1.000 | 3.000 | 0.33 |" in md  # the bucket table: graphs, eager, ratio
    assert "| 8 | 100.0 | 5.00 |" in md  # split-K
    assert "| 64 | 128 | 8192 | 8.2 | 1,000 | 16,000 | 16.0 |" in md
    assert md.count("**MET**") == 9
    assert "| http / offline | 0.94 |  |  |" in md
    for line in md.splitlines():  # every table row has its header's column count
        if line.startswith("|"):
            assert line.count("|") >= 3, line
    tail = gpu.summary(r)
    assert "[MET ] C=256 128/128" in tail and len(tail) < 12_000


def test_http_modes_each_get_a_section_and_their_servers_flags(tmp_path, monkeypatch):
    """--http-modes graphs,graphs-mixed: each mode's server runs with that mode's flags and
    environment switch; both render, the first stays the targets' figure."""
    from infer.bench.gpu_http import server_command, server_step_kinds

    r = _report()
    mixed = {**r["http"], "mode": "graphs-mixed", "output_tok_s": 15_500.0, "ratio": 0.97,
             "offline_mode": "graphs", "step_kinds": {"decode replayed": 900,
                                                      "mixed replayed": 80},
             "cpu_cores": {"api_server": 0.41, "engine": 0.97, "clients": None},
             "concurrency": 64, "gpu_busy_pct": 71.6, "gpu_busy_samples": 25,
             "server_view": {"running_mean": 47.25, "waiting_mean": 0.5, "samples": 30,
                             "server_ttft_ms_mean": 9.0, "server_queue_ms_mean": 1.25,
                             "server_e2e_ms_mean": 210.0, "client_ttft_ms_mean": 80.5,
                             "client_e2e_ms_mean": 290.0}}  # fmt: skip
    r["http_modes"] = {"graphs": {**r["http"], "mode": "graphs"}, "graphs-mixed": mixed}
    r["targets"] = gpu.targets(r)
    md = gpu.render_markdown(r)
    assert "## Over HTTP: `infer serve` at 128x128@64 (graphs)" in md
    assert "## Over HTTP: `infer serve` at 128x128@64 (graphs-mixed)" in md
    assert "| http / offline | 0.97 |  |  |" in md
    assert "The offline graphs cell's prompts and engine settings (graphs-mixed's over HTTP)" in md
    assert "15,500 tok/s = 0.97x offline" in gpu.summary(r)
    assert "the server's steps (warm-up included): 900 decode replayed, 80 mixed replayed." in md
    # who set the pace: each side's cores over the load (the first mode measured none)
    assert md.count("Cores kept busy") == 1
    assert "(CPU seconds / wall): api server 0.41, engine 0.97, clients -." in md
    # what the server saw beside the clients (its /metrics): a batch short of C
    assert ("The load as the server saw it (its /metrics, 30 reads): 47.2 requests running and "
            "0.5 waiting on average, of 64 the clients keep in flight; mean time to first token "
            "9.0 ms at the server (queued 1.2 ms) against 80.5 ms at the clients; a request "
            "210 ms against 290 ms.") in md  # fmt: skip
    assert "The GPU ran kernels 72% of the load (nvidia-smi's utilization, 25 reads 0.1 s " \
           "apart)." in md  # fmt: skip
    log = "INFO captured 11 CUDA graphs\nINFO steps run: 812 decode replayed, 95 mixed eager\n"
    assert server_step_kinds(log) == {"decode replayed": 812, "mixed eager": 95}
    assert server_step_kinds("INFO shutting down\n") == {}
    assert _status(r["targets"])["HTTP"] == "MET"  # from r["http"]: 0.94x
    args = _args("--http-modes", "graphs,graphs-mixed,graphs-sync")
    assert args.http_modes == "graphs,graphs-mixed,graphs-sync"
    cmd = server_command(tmp_path, args, 8000, "graphs-sync")
    assert "--no-async-scheduling" in cmd and "--enforce-eager" not in cmd
    assert "--attention-backend" not in cmd  # triton: the server's own pick on a GPU
    cmd = server_command(tmp_path, args, 8000, "torch-eager")
    assert cmd[cmd.index("--attention-backend") + 1] == "torch"
    assert "--enforce-eager" in server_command(tmp_path, args, 8000, "eager")
    cmd = server_command(tmp_path, args, 8000, "graphs-stream8")
    assert cmd[cmd.index("--stream-interval") + 1] == "8"
    assert "--stream-interval" not in server_command(tmp_path, args, 8000, "graphs")
    cmd = server_command(tmp_path, args, 8000, "graphs-api4")
    assert cmd[cmd.index("--api-server-count") + 1] == "4"
    assert "--api-server-count" not in server_command(tmp_path, args, 8000, "graphs")
    off = {"INFER_TRITON_GEMV": "0", "INFER_MIXED_GRAPHS": "0", "INFER_TRITON_FUSED": "1",
           "INFER_MIXED_DECODE_ROWS": "1"}  # fmt: skip
    assert gpu.mode_environ("graphs-mixed") == off | {"INFER_MIXED_GRAPHS": "1"}
    assert gpu.mode_environ("graphs-tiles") == off | {"INFER_MIXED_DECODE_ROWS": "0"}
    assert gpu.mode_environ("graphs-mixed-tiles") == off | {
        "INFER_MIXED_GRAPHS": "1",
        "INFER_MIXED_DECODE_ROWS": "0",
    }
    assert gpu.mode_environ("graphs-compile") == off | {"INFER_TRITON_FUSED": "compile"}
    # a switch exported in the shell cannot turn the plain mode into another (and the fused
    # kernels' switch stays at its default, on) ...
    assert gpu.mode_environ("graphs") == off
    monkeypatch.setenv("INFER_MIXED_GRAPHS", "1")
    monkeypatch.setenv("INFER_TRITON_FUSED", "compile")
    assert gpu.mode_environ("graphs") == off
    # ... but the fused kernels switched off in the shell stay off in every mode but their own
    monkeypatch.setenv("INFER_TRITON_FUSED", "0")
    assert gpu.mode_environ("graphs-mixed") == off | {"INFER_MIXED_GRAPHS": "1",
                                                      "INFER_TRITON_FUSED": "0"}  # fmt: skip
    assert gpu.mode_environ("graphs-compile")["INFER_TRITON_FUSED"] == "compile"
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        server_command(tmp_path, args, 8000, "fast")


def test_options_and_quick_defaults():
    full, quick = _args(), _args("--quick", "--buckets", "1,2")
    # '' as gpu_check.sh passes it (its GPU_CHECK_BENCH_ARGS split into words, quotes kept)
    unparsed = _args("--http", '""', "--kernel-prefill", "''", "--profile", "1")
    assert (unparsed.http, unparsed.kernel_prefill, unparsed.profile) == ("", "", "1")
    assert gpu.ints(full.concurrency) == [1, 16, 64, 256]
    assert gpu.parse_loads(full.long) == [(1024, 128, 16)]
    assert gpu.parse_loads(quick.long) == [] and gpu.ints(quick.buckets) == [1, 2]
    assert gpu.parse_loads("512x64@4+8") == [(512, 64, 4), (512, 64, 8)]
    assert gpu.parse_loads("none") == []
    with pytest.raises(SystemExit, match="INxOUT@C"):
        gpu.parse_loads("512x64")


def test_llama_1b_shape_has_1_24b_parameters():
    assert gpu.llama_params(gpu.LLAMA_1B_SHAPE) == 1_235_814_400


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda(tmp_path, capsys):
    from infer.cli import main

    assert main(["bench", "gpu", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _reference_attention(q, k_cache, v_cache, block_tables, context_lens, *, block_size, scale,
                         num_splits=1, out=None, workspace=None):  # fmt: skip
    """Row by row through the block table, in float32: what the kernel must compute."""
    res = torch.empty_like(q) if out is None else out
    g = q.shape[1] // k_cache.shape[1]
    for r in range(q.shape[0]):
        n = int(context_lens[r])
        blocks = block_tables[r, : math.ceil(n / block_size)].long()
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        k = k_cache[slots].float().repeat_interleave(g, dim=1)  # [n, H, D]
        v = v_cache[slots].float().repeat_interleave(g, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[r].float(), k) * scale, dim=-1)
        res[r] = torch.einsum("hn,nhd->hd", w, v).to(res.dtype)
    return res


def test_kernel_section_against_a_reference_kernel():
    args = _args("--kernel-batches", "2,3", "--kernel-contexts", "40,64", "--kernel-torch-contexts",
                 "40", "--kernel-splits", "1,2", "--kernel-split-context", "64", "--kernel-reps",
                 "2", "--device", "cpu", "--kernel-max-gb", "0.00002")  # fmt: skip
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 16, "block_size": 16}
    logs: list[str] = []
    res = gpu_kernels.kernel_bench(
        args, shape, 10.0, logs.append, attn=_reference_attention, min_bytes=1
    )
    cells = {(row["batch"], row["context"]): row for row in res["rows"]}
    # 3 x 64 x 2 heads x 16 x 2 B x 2 = 24,576 bytes is over the 20 kB cap
    assert res["skipped_cases"] == ["3x64: 0.00 GB of K/V"]
    assert set(cells) == {(2, 40), (2, 64), (3, 40)}
    row = cells[(2, 40)]
    assert row["kv_bytes"] == 2 * 40 * 2 * 16 * 4 and row["copies"] >= 1
    assert row["max_abs_err"] < 0.02  # the torch gather + SDPA path agrees with the reference
    assert row["GBps"] > 0 and row["pct_of_read"] == row["GBps"] / 10.0
    assert "torch_ms" not in cells[(2, 64)]
    assert res["split"]["splits_ms"].keys() == {"1", "2"} and res["split"]["speedup"] > 0
    assert res["failures"] == 0 and len(logs) == 4


def test_the_mixed_step_cell_times_both_ways_of_attending_decodes():
    """The kernel section's mixed-step cell on the real kernels (the interpreter here): each
    prefill kernel with a mixed step's decodes in it or through the decode kernel, all four
    timed and giving the same attention; a case that cannot run is reported beside the
    others."""
    pytest.importorskip("triton")
    args = argparse.Namespace(device="cpu", kernel_reps=1, kernel_mixed="3x20+9,3x+9")
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 16, "block_size": 16}
    logs: list[str] = []
    res = gpu_kernels.mixed_attention(args, shape, logs.append)
    good, bad = res["cases"]
    assert good["case"] == "3x20+9" and good["max_abs_diff"] < 1e-5
    assert set(good["ms"]) == set(gpu_kernels.MIXED_VARIANTS) and min(good["ms"].values()) > 0
    assert good["speedup"]["grid"] > 0 and good["speedup"]["tiles"] > 0
    assert bad["error"].startswith("ValueError") and len(logs) == 2
    md = "\n".join(gpu_kernels.markdown({"mixed": res, "rows": []}))
    assert "| 3x20+9 |" in md and "| 3x+9 | failed: ValueError" in md


def test_kernel_section_skips_without_the_module(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "infer.runner.gpu.triton_attention", None)
    res = gpu_kernels.kernel_bench(_args("--device", "cpu"), {}, None, print)
    assert "not importable" in res["skipped"]


def test_the_whole_flow_on_a_tiny_model_on_the_cpu(tmp_path, capsys, monkeypatch):
    """Model build, roofline, the torch-eager engine with its buckets, a failing mode, the
    report files: what runs on a GPU, shrunk (kernels and transformers skipped)."""
    out = tmp_path / "out"
    tiny = ("--device", "cpu", "--tiny", "--model-dir", str(tmp_path / "model"), "--out",
            str(out), "--prompt-len", "16", "--output-len", "4", "--max-num-seqs", "8",
            "--kv-cache-memory", "16MiB", "--read-gib", "0.01", "--matmul-n", "64",
            "--skip-kernels", "--skip-hf")  # fmt: skip
    args = _args(
        *tiny, "--modes", "torch-eager,nonsense", "--bucket-modes", "torch-eager",
        "--concurrency", "1,4", "--long", "48x4@2", "--buckets", "1,3", "--bucket-steps", "3",
        "--profile", "3,1a", "--profile-mode", "torch-eager", "--profile-steps", "2",
    )  # fmt: skip
    assert gpu.run(args) == 1  # the unknown mode
    report = json.loads((out / "gpu.json").read_text())
    assert report["model"]["params"] == gpu.llama_params(gpu.TINY_SHAPE)
    assert not report["model"]["reused"]
    te = report["engine"]["torch-eager"]
    assert set(te["loads"]) == {"16x4@1", "16x4@4", "48x4@2"}
    assert te["loads"]["16x4@4"]["completed"] == 8  # 2 x C requests
    assert {b: v["batch"] for b, v in te["buckets"].items()} == {"1": 1, "3": 3}
    assert all(v["outputs_per_step_min"] == v["batch"] for v in te["buckets"].values())
    # Beside each bucket, the steps with a new prompt arriving before each (3 timed).
    assert {b: (v["batch"], v["steps"]) for b, v in te["arrivals"].items()} == {
        "1": (1, 3),
        "3": (3, 3),
    }
    assert all(v["ms"] > 0 and v["step_kinds"] == {} for v in te["arrivals"].values())
    assert "unknown mode" in report["engine"]["nonsense"]["error"]
    assert report["sections"]["engine torch-eager"]["status"] == "ok"
    assert report["roofline"]["weight_read_ms"] > 0
    md = (out / "gpu.md").read_text()
    assert "| torch-eager | 16x4@4 |" in md and "## Targets" in md
    assert "## A step with an arrival (B decoding + one new 16-token prompt" in md
    assert "| torch-eager | 3 | " in md
    prof = te["profile"]["3"]  # no GPU: the host's side only
    assert prof["steps"] == 2 and prof["top_host_calls"] and not prof["top_kernels"]
    assert not prof["arrivals"] and te["profile"]["1a"]["arrivals"]
    assert te["profile"]["1a"]["batch"] == 1
    assert "## Profile: torch-eager, a step with an arrival at batch 1" in md
    assert "Host side (the profiler's CPU events, self time)" in md
    assert "targets:" in capsys.readouterr().out
    # A second run (one load, nothing else) reuses the model folder; its HTTP modes take turns
    # (--http-repeats; the server runs stood in for: a server on a CPU takes a minute here)
    from infer.bench import gpu_http

    served = []

    def fake_http(model, args, load, vocab, offline, out, log, res, mode, tag):
        served.append((mode, tag))
        tok_s = {"torch-eager": [100.0, 300.0, 200.0], "eager": [50.0, 60.0, 70.0]}[mode]
        runs = sum(m == mode for m, _ in served)
        res.update(mode=mode, load="16x4@1", output_tok_s=tok_s[runs - 1], offline_tok_s=400.0,
                   ratio=tok_s[runs - 1] / 400.0, concurrency=1)  # fmt: skip
        return res

    monkeypatch.setattr(gpu_http, "http_section", fake_http)
    args = _args(*tiny, "--modes", "torch-eager", "--concurrency", "1", "--long", "none",
                 "--skip-buckets", "--profile", "", "--http", "1", "--http-modes",
                 "torch-eager,eager", "--http-repeats", "3")  # fmt: skip
    assert gpu.run(args) == 0
    report = json.loads((out / "gpu.json").read_text())
    assert report["model"]["reused"]
    assert served == [("torch-eager", "torch-eager"), ("eager", "eager"),
                      ("torch-eager", "torch-eager-2"), ("eager", "eager-2"),
                      ("torch-eager", "torch-eager-3"), ("eager", "eager-3")]  # fmt: skip
    first = report["http_modes"]["torch-eager"]
    assert first["runs_tok_s"] == [100.0, 300.0, 200.0] and first["median_tok_s"] == 200.0
    assert first["median_ratio"] == 0.5 and report["http"] is not None
    assert report["http_modes"]["eager"]["median_tok_s"] == 60.0
    target = next(t for t in report["targets"] if t["target"].startswith("HTTP"))
    assert target["measured"] == "median of 3 runs 200 / 400 = 0.50x"
    assert target["status"] == "MISS"
    md = (out / "gpu.md").read_text()
    assert "| torch-eager | 100, 300, 200 | 200 | 0.50 |" in md
    assert "6 server runs, the modes taking turns" in md


def test_runner_info_names_the_attention_path_and_the_graphs():
    from types import SimpleNamespace as NS

    graphs = NS(graphs={1: 0, 2: 0}, sizes=[1, 2], capture_seconds=1.5, capture_bytes=3 << 20)
    engine = NS(runner=NS(attention_backend="triton", cuda_step=NS(graphs=graphs)), model=None)
    info = gpu.runner_info(engine)
    assert info["runner.attention_backend"] == "'triton'"
    assert info["decode graphs"] == "2 captured for batch 1..2 in 1.5s, 3 MiB"
    engine.runner.cuda_step.graphs = None
    assert gpu.runner_info(engine)["decode graphs"] == "none (eager)"


def test_outside_a_checkout_the_kernel_section_says_it_needs_one(tmp_path, monkeypatch, capsys):
    """Without benchmarks/gpu_kernels.py (an installed package) the other sections run and the
    kernels section is skipped, its note in the log, the sections table and the kernel table."""
    monkeypatch.setattr(gpu, "kernel_benchmark", lambda: None)
    out = tmp_path / "out"
    args = _args("--device", "cpu", "--tiny", "--model-dir", str(tmp_path / "model"), "--out",
                 str(out), "--read-gib", "0.01", "--matmul-n", "64", "--skip-engine", "--skip-hf")  # fmt: skip
    assert gpu.run(args) == 0
    report = json.loads((out / "gpu.json").read_text())
    assert report["sections"]["roofline"]["status"] == "ok"
    assert report["sections"]["kernels"]["status"] == "skipped"
    assert "needs a source checkout" in report["sections"]["kernels"]["note"]
    md = (out / "gpu.md").read_text()
    assert "## Decode attention kernel" in md and "Skipped: the decode attention kernel" in md
    assert "needs a source checkout" in capsys.readouterr().out


def test_prefill_configurations_are_each_timed_against_the_engines():
    """The kernel section's prefill sweep: each configuration passed to the kernel while it is
    timed (the engine's first, marked), outputs compared with the engine configuration's, a
    configuration that fails reported, not fatal."""
    import types

    active: list[tuple] = []

    def engine_config(head_dim, dtype):
        return (64, 64, 4, 2)

    def attend(q, k_cache, v_cache, tables, qsl, past, max_len, *, block_size, scale, out, config):
        if config[2] == 8 and config[0] == 128:
            raise RuntimeError("out of shared memory")
        active.append(config)
        return out.fill_(config[0])  # each configuration's output: its BLOCK_M

    ta = types.SimpleNamespace(_prefill_config=engine_config, paged_prefill_attention=attend)
    args = argparse.Namespace(device="cpu", kernel_reps=2, kernel_prefill="2x16")
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 16, "block_size": 16}
    res = gpu_kernels.prefill_configs(args, shape, print, ta=ta)
    assert res["engine_config"] == [64, 64, 4, 2]
    (case,) = res["cases"]
    configs = case["configs"]
    assert list(configs) == ["64x64x4x2", "64x64x8x2", "128x64x8x2", "32x64x4x2"]
    assert configs["64x64x4x2"]["engine"] and not configs["64x64x8x2"]["engine"]
    assert "out of shared memory" in configs["128x64x8x2"]["error"]
    assert configs["32x64x4x2"]["max_abs_diff"] == 32.0 and configs["64x64x8x2"]["TFLOPs"] > 0
    assert {c[:3] for c in active} == {(64, 64, 4), (64, 64, 8), (32, 64, 4)}
    md = "\n".join(gpu_kernels.markdown({"prefill": res, "rows": []}))
    assert "| 2x16 | 64x64x4x2 (engine) |" in md and "failed: RuntimeError" in md


def test_the_matmul_sweep_times_every_shape_and_sums_a_decode_step(monkeypatch):
    """The kernel section's skinny-matmul sweep on the tiny model's shapes (times made up):
    every shape at every row count, the best candidate named, a failing shape reported without
    losing the rest, and a step's sums per row count only where every shape was timed."""
    pytest.importorskip("triton")
    from infer.runner.gpu import triton_gemv as tg

    real_sweep = tg.sweep
    by_n: dict[int, int] = {}

    def fake_time(fn, weights):  # (the kernels' own tests run them)
        n = weights[0].shape[0]
        by_n[n] = by_n.get(n, 0) + 1
        return 10.0 if by_n[n] == 1 else 4.0 + by_n[n]  # cuBLAS first, then 6, 7, ... us

    def sweep(weights, rows):
        if weights[0].shape[0] == gpu.TINY_SHAPE["vocab_size"] and rows == 16:
            raise RuntimeError("out of memory")
        by_n.clear()
        return real_sweep(weights, rows)

    monkeypatch.setattr(tg, "time_us", fake_time)
    monkeypatch.setattr(tg, "sweep", sweep)
    monkeypatch.setattr(tg, "CANDIDATES", (tg.GemvConfig("dot", 16, 64), tg.GemvConfig("row", 8, 64),
                                           tg.GemvConfig("dot", 16, 32, split_k=2)))  # fmt: skip
    args = argparse.Namespace(device="cpu", kernel_gemv_rows="1,16")
    res = gpu_kernels.gemv_sweep(args, gpu.TINY_SHAPE, 100.0, print, tg=tg)
    shapes = gpu_kernels.matmul_shapes(gpu.TINY_SHAPE)
    assert shapes["qkv"] == (64 + 2 * 32, 64, 2) and shapes["lm_head"] == (1024, 64, 1)
    assert [(r["name"], r["rows"]) for r in res["rows"]] == [
        (name, rows) for name in shapes for rows in (1, 16)
    ]
    ok = [r for r in res["rows"] if "error" not in r]
    assert len(ok) == 9 and "out of memory" in res["rows"][-1]["error"]
    for r in ok:
        assert r["cublas_us"] == 10.0 and r["best_us"] == 6.0
        assert r["best"] == str(tg.candidates_for(r["rows"])[0])
        assert len(r["candidates"]) == len(tg.candidates_for(r["rows"]))
        assert r["cublas_pct_of_read"] == pytest.approx(r["bytes"] / 10e3 / 100.0)
    (step,) = res["steps"]  # rows 16 lost its LM head: no sum
    weights = sum(n * k * count * 2 for n, k, count in shapes.values())
    assert step["rows"] == 1 and step["weights_bytes"] == weights
    assert step["cublas_us"] == 10.0 * 9 and step["picked_us"] == 6.0 * 9  # 2 layers x 4 + 1
    assert step["read_us"] == pytest.approx(weights / 100e3)
    md = "\n".join(gpu_kernels.gemv_markdown(res))
    assert "| qkv | 128x64 | 1 |" in md and "failed: RuntimeError: out of memory" in md
    assert "| 1 | 90 | 54 |" in md


def test_a_modes_switches_hold_while_its_loads_run(monkeypatch):
    """A mode's environment (``graphs-compile``: the fused kernels' switch, read at every
    forward pass) holds from the engine's start through its loads, and is gone afterwards."""
    import os
    from types import SimpleNamespace as NS

    from infer.bench import offline

    seen = []
    engine = NS(capacity=NS(num_tokens=64), close=lambda: seen.append("closed"))
    monkeypatch.setattr(gpu, "make_engine", lambda *a: seen.append(os.environ.get("X")) or engine)
    monkeypatch.setattr(gpu, "MODE_ENV", {"graphs-compile": {"X": "compile"}})

    def run_load(engine, c, n, pin, pout, seed):
        seen.append(os.environ.get("X"))
        return {"output_tok_s": 1.0, "itl_ms": {"p50": 1.0}, "ttft_ms": {"p50": 1.0},
                "wall_s": 1.0}  # fmt: skip

    monkeypatch.setattr(offline, "run_load", run_load)
    monkeypatch.delenv("X", raising=False)
    args = argparse.Namespace(prompt_len=4, requests_per_c=1, seed=0, device="cpu")
    res = gpu.engine_mode("m", "graphs-compile", args, [(4, 2, 1)], [], print)
    assert seen == ["compile"] * 4 + ["closed"]  # start, two warm-ups, the load
    assert res["loads"]["4x2@1"]["output_tok_s"] == 1.0 and "X" not in os.environ

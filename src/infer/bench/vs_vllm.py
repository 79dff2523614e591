"""infer vs vLLM over HTTP, both driven by vLLM's own load generator: ``infer bench vs-vllm``.

    infer bench vs-vllm [--peers infer,vllm] [--workloads 64x64,1024x128] [--runs 3]
                        [--infer-args "..."] [--offline] [--model DIR] [--out bench-results/vs_vllm]

(``python benchmarks/bench_vs_vllm.py`` runs the same.) The yardstick of serving speed.

``--peers infer,llamacpp`` (or ``infer,vllm,llamacpp``) runs llama.cpp's own ``llama-server``
(``--llamacpp-bin``, ``$LLAMACPP_BIN`` or the one on ``PATH``) on a GGUF of the model
(``--llamacpp-model``) under the same client: ``-np`` max-num-seqs slots sharing ``-c``
max-num-seqs * max-model-len tokens, ``-t``/``-tb`` every core, plus ``--llamacpp-args``. Its
output tokens are counted by request (completed * the cell's output length, see
:func:`parse_result`), as the client undercounts them; the report names each other peer in its
own table and targets.

``lora/INxOUT@C`` workloads with ``--lora-modules name=path ...`` (``--max-loras``, default all
of them; ``--max-lora-rank``, default 16) measure LoRA serving: each peer starts a second server
per round, after its base-model one, with ``--enable-lora --max-loras N --max-lora-rank R
--lora-modules ...`` (the same flags on both), and the client names one adapter per request at
random (``vllm bench serve --lora-modules name ...``, seeded: the same for both peers; the
warm-up goes to every adapter in turn). ``--workloads 64x64@16,lora/64x64@16`` thus shows what
the adapters cost each server, on the same prompts.

Both servers run on the same model folder (the ~110M bf16 Llama of ``infer bench engine``, or
``--model``), ``--max-num-seqs 64 --max-model-len 2048 --dtype bfloat16``, on the same port,
**one at a time**. The client is the outside one for both: ``vllm bench serve --backend openai
--endpoint /v1/completions --dataset-name random --ignore-eos --temperature 0``, from vLLM's
virtual environment (``$VLLM_VENV``, default ``~/peers/vllm``), ``--num-prompts 4*C
--max-concurrency C``. Workloads (``--workloads``): ``64x64`` (64 prompt tokens, 64 output
tokens) at C = 1, 16, 64 and ``1024x128`` at C = 16; ``INxOUT@C+C`` names other cells.

A *round* starts each peer in turn (the order alternates round by round, so a load that comes
and goes on a shared machine does not always hit the same peer), and for each cell runs a short
warm-up (C prompts of the cell's input length, 16 output tokens, other prompts) and then the
measured run. ``--runs N`` makes N rounds; the report keeps the median of each metric, and for
each cell also the median of the per-round ratios (infer over vLLM of the same round): on a
machine whose speed drifts, that pairing is the steadier figure. To pin one cell down, run it
alone with more rounds (``--workloads 1024x128@16 --runs 6``): its two servers then run minutes
apart, not the length of a whole round of cells. Prompts
depend only on ``--seed``, the round and the cell, so both peers get the same prompts; a round's
warm-up and measured prompts differ (nothing is reused from a prefix cache). The client's
endpoint ready-check is skipped (``--ready-check-timeout-sec 0``): the driver waits for
``/health`` itself, and the check would send the first measured prompt once more beforehand.

Recorded per cell: ``os.getloadavg()`` before the warm-up and before the measured run, and the
CPU that *other* processes used during the measured run (all busy CPU time in ``/proc/stat``
minus this driver, the client and the server's process group, in cores). Servers' and clients'
logs, vLLM's saved result JSON files, the versions and every exact command go to ``--out``.
Servers always stop (SIGTERM to the process group, SIGKILL after 60 s, also on Ctrl-C or
SIGTERM of this driver) and their port must be free before the next one starts.

``--offline`` also measures the offline engine (``LLM.generate``, ``max_num_seqs=16``, 64
prompts of 64 tokens, 64 output tokens) in a fresh process each round, right before infer's
server, to compare with infer over HTTP at C=16 (target: HTTP loses at most 5%).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from infer.bench.report import md_table

DEFAULT_WORKLOADS: dict[str, tuple[int, ...]] = {"64x64": (1, 16, 64), "1024x128": (16,)}
"""Workload (``INxOUT``) -> its concurrencies when named without ``@C``."""

PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
METRIC_PERCENTILES = "50,99"
METRICS = ("ttft", "tpot", "itl", "e2el")
HTTP_LOSS_TARGET = 0.05
LORA_TARGET_CELL = "lora/64x64@16"
"""8 adapters of rank 16, requests spread over them: infer >= 1.5x vLLM's output tok/s."""

PEER_LABELS = {"infer": "infer", "vllm": "vLLM", "llamacpp": "llama.cpp"}
"""The peers this driver runs, and how the report names each."""

COUNT_BY_REQUEST = frozenset({"llamacpp"})
"""Peers whose output tokens are counted as completed requests * the cell's output length (see
:func:`parse_result`), not as ``vllm bench serve`` counts them."""


def peer_label(peer: str) -> str:
    return PEER_LABELS.get(peer, peer)


def other_peers(peers: list[str]) -> list[str]:
    """The peers infer is compared with: every other one that ran, in order (vLLM if none)."""
    return [p for p in peers if p != "infer"] or ["vllm"]


@dataclass(frozen=True)
class Cell:
    """One measured cell: prompts of ``input_len`` tokens, ``output_len`` out, C in flight.

    With ``prefix_len`` the prompts share prefixes (``vllm bench serve``'s ``prefix_repetition``
    dataset): ``num_prefixes`` distinct ``prefix_len``-token prefixes, each prompt one of them
    followed by ``input_len`` unique tokens, as requests sharing long system prompts are."""

    input_len: int
    output_len: int
    concurrency: int
    prefix_len: int = 0
    num_prefixes: int = 0
    lora: bool = False
    """Requests spread over the LoRA adapters (``--lora-modules``), on a server started with
    them; written ``lora/INxOUT@C``."""

    @property
    def workload(self) -> str:
        base = f"{self.input_len}x{self.output_len}"
        if self.prefix_len:
            base = f"shared{self.prefix_len}/{self.num_prefixes}+{base}"
        return f"lora/{base}" if self.lora else base

    @property
    def key(self) -> str:
        return f"{self.workload}@{self.concurrency}"


def parse_workloads(spec: str) -> list[Cell]:
    """``"64x64,1024x128"`` -> the default cells of each; ``"64x64@1+16"`` -> C = 1 and 16;
    ``"shared512/4+32x64@16+64"`` -> 4 shared 512-token prefixes + 32 unique tokens, 64 out;
    ``"lora/64x64@16"`` -> requests spread over the LoRA adapters (``--lora-modules``)."""
    cells: list[Cell] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        lora = item.startswith("lora/")
        m = re.fullmatch(
            r"(?:shared(\d+)(?:/(\d+))?\+)?(\d+)x(\d+)(?:@(\d+(?:\+\d+)*))?",
            item.removeprefix("lora/"),
        )
        if not m:
            raise ValueError(
                f"bad workload {item!r}: write INxOUT, INxOUT@C, INxOUT@C+C, "
                "sharedPREFIX/NUM+INxOUT@C or lora/INxOUT@C"
            )
        prefix_len, num_prefixes = int(m[1] or 0), int(m[2] or (4 if m[1] else 0))
        name = f"{int(m[3])}x{int(m[4])}"
        if m[5]:
            concurrencies = [int(c) for c in m[5].split("+")]
        elif name in DEFAULT_WORKLOADS and not prefix_len and not lora:
            concurrencies = list(DEFAULT_WORKLOADS[name])
        else:
            raise ValueError(f"workload {item!r} has no default concurrency: write {item}@C")
        for c in concurrencies:
            cell = Cell(int(m[3]), int(m[4]), c, prefix_len, num_prefixes, lora)
            if c < 1 or cell.input_len < 1 or cell.output_len < 1:
                raise ValueError(f"bad workload {item!r}: lengths and C must be positive")
            if cell not in cells:
                cells.append(cell)
    if not cells:
        raise ValueError("no workload given")
    return cells


def cell_seed(base: int, round_idx: int, cell: Cell, warmup: bool) -> int:
    """The client's ``--seed`` (its random prompts): the same for every peer, new per round/cell."""
    return (
        base + 1000 * round_idx + 10 * cell.concurrency + (7 if warmup else 0) + cell.input_len
        + cell.prefix_len
    )  # fmt: skip


def client_command(
    vllm_bin: Path,
    cell: Cell,
    *,
    base_url: str,
    model_name: str,
    tokenizer: Path,
    num_prompts: int,
    seed: int,
    result_dir: Path,
    result_filename: str,
    output_len: int | None = None,
    detailed: bool = False,
    lora_modules: list[str] | None = None,
    lora_assignment: str | None = None,
) -> list[str]:
    """``vllm bench serve`` for one cell (``output_len`` overrides the cell's, for warm-ups;
    ``detailed``: each request's figures go in the result JSON too, ``--save-detailed``;
    ``lora_modules``: each request names one of these adapters as its model, at random (seeded
    by ``seed``, so the same for every peer) or as ``lora_assignment`` says)."""
    flags = [
        ("--backend", "openai"), ("--base-url", base_url), ("--endpoint", "/v1/completions"),
        ("--model", model_name), ("--tokenizer", tokenizer),
        *_dataset_flags(cell, output_len or cell.output_len),
        ("--ignore-eos",), ("--temperature", 0),
        ("--num-prompts", num_prompts), ("--max-concurrency", cell.concurrency), ("--seed", seed),
        ("--percentile-metrics", PERCENTILE_METRICS), ("--metric-percentiles", METRIC_PERCENTILES),
        ("--ready-check-timeout-sec", 0), ("--disable-tqdm",),
        ("--save-result",), ("--result-dir", result_dir), ("--result-filename", result_filename),
        *([("--save-detailed",)] if detailed else []),
        *([("--lora-modules", *lora_modules)] if lora_modules else []),
        *([("--lora-assignment", lora_assignment)] if lora_modules and lora_assignment else []),
    ]  # fmt: skip
    return [str(vllm_bin), "bench", "serve", *(str(x) for flag in flags for x in flag)]


def _dataset_flags(cell: Cell, output_len: int) -> list[tuple]:
    """The client's prompts: random ids, or shared prefixes + random suffixes."""
    if not cell.prefix_len:
        return [("--dataset-name", "random"), ("--random-input-len", cell.input_len),
                ("--random-output-len", output_len)]  # fmt: skip
    return [("--dataset-name", "prefix_repetition"),
            ("--prefix-repetition-prefix-len", cell.prefix_len),
            ("--prefix-repetition-suffix-len", cell.input_len),
            ("--prefix-repetition-num-prefixes", cell.num_prefixes),
            ("--prefix-repetition-output-len", output_len)]  # fmt: skip


def parse_result(data: dict, output_len: int | None = None) -> dict:
    """The figures of one ``vllm bench serve --save-result`` JSON that the report uses.

    ``output_len``: count output tokens by request, not as the client counted them: every
    completed request produced exactly ``output_len`` tokens (all cells run ``--ignore-eos``),
    so ``total_output_tokens`` is ``completed * output_len`` and output tok/s that over the
    duration; the client's own count stays as ``client_output_tokens``. For llama-server, whose
    ``usage`` (in the same last chunk as a ``choices`` entry) the client ignores: it re-tokenizes
    the streamed text instead, which undercounts. Where the JSON has each request's figures
    (``--save-detailed``), TPOT is recomputed the same way ((latency - TTFT) / (output_len - 1)
    per request: the client divides by its own count) and the first distinct errors are kept.
    """
    out = {
        "completed": int(data.get("completed", 0)),
        "failed": int(data.get("failed", 0) or 0),
        "num_prompts": data.get("num_prompts"),
        "duration_s": data.get("duration"),
        "total_input_tokens": data.get("total_input_tokens"),
        "total_output_tokens": data.get("total_output_tokens"),
        "output_tok_s": data.get("output_throughput"),
        "request_s": data.get("request_throughput"),
    }
    for m in METRICS:
        out[f"{m}_p50_ms"] = data.get(f"p50_{m}_ms", data.get(f"median_{m}_ms"))
        out[f"{m}_p99_ms"] = data.get(f"p99_{m}_ms")
        out[f"{m}_mean_ms"] = data.get(f"mean_{m}_ms")
    errors = [e for e in data.get("errors") or [] if isinstance(e, str) and e.strip()]
    if errors:
        out["errors"] = list(dict.fromkeys(e.strip().splitlines()[-1][:200] for e in errors))[:3]
    if output_len is not None:
        out.update(_count_by_request(data, output_len, out["completed"]))
    return out


def _count_by_request(data: dict, output_len: int, completed: int) -> dict:
    """Output tokens, tok/s and (with per-request figures) TPOT with ``output_len`` tokens
    for each completed request (see :func:`parse_result`)."""
    from infer.bench.metrics import percentile

    total = completed * output_len
    duration = data.get("duration")
    out: dict = {
        "client_output_tokens": data.get("total_output_tokens"),
        "total_output_tokens": total,
        "output_tok_s": total / duration if duration else None,
        "output_tokens_counted": "by request",
    }
    ttfts, latencies = data.get("ttfts"), data.get("latencies")
    errors = data.get("errors") or [""] * len(ttfts or [])
    if output_len > 1 and ttfts and latencies and len(ttfts) == len(latencies) == len(errors):
        tpots = [
            1000 * (lat - ttft) / (output_len - 1)
            for ttft, lat, err in zip(ttfts, latencies, errors, strict=True)
            if not err and ttft and ttft > 0
        ]
        if tpots:
            out["tpot_p50_ms"] = percentile(tpots, 50)
            out["tpot_p99_ms"] = percentile(tpots, 99)
            out["tpot_mean_ms"] = statistics.fmean(tpots)
            out["client_tpot_p50_ms"] = data.get("p50_tpot_ms", data.get("median_tpot_ms"))
    itls = data.get("itls")
    if itls and len(itls) == len(errors):
        # llama-server ends each stream with a chunk of its own that carries no token (the
        # finish reason and usage) right after the last one: its gap, ~0 ms, is no token's.
        gaps = [
            1000 * x for itl, err in zip(itls, errors, strict=True) if not err for x in itl[:-1]
        ]
        if gaps:
            out["itl_p50_ms"] = percentile(gaps, 50)
            out["itl_p99_ms"] = percentile(gaps, 99)
            out["itl_mean_ms"] = statistics.fmean(gaps)
            out["client_itl_p50_ms"] = data.get("p50_itl_ms", data.get("median_itl_ms"))
    return out


def median_result(runs: list[dict]) -> dict:
    """Per-metric median over the successful runs of one cell (and the list of their tok/s)."""
    ok = [r for r in runs if "error" not in r]
    out: dict = {"runs": len(runs), "ok_runs": len(ok)}
    if not ok:
        out["error"] = runs[0]["error"] if runs else "not run"
        return out
    for key, value in ok[0]["result"].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            vals = [r["result"][key] for r in ok if r["result"].get(key) is not None]
            out[key] = statistics.median(vals) if vals else None
    out["output_tok_s_runs"] = [r["result"]["output_tok_s"] for r in ok]
    out["other_cpu_cores_runs"] = [r.get("other_cpu_cores") for r in ok]
    return out


def _get(results: dict, peer: str, key: str, metric: str) -> float | None:
    row = results.get(peer, {}).get(key)
    if not row or "error" in row:
        return None
    return row.get(metric)


def check_targets(
    cells: dict, offline: dict | None = None, others: tuple[str, ...] | list[str] = ("vllm",)
) -> list[dict]:
    """The serving-speed targets, each ``pass``/``miss`` with its figure, or ``n/a``.

    ``cells``: ``{peer: {cell key: median row}}``; ``offline``: the offline engine's median row;
    ``others``: the peers infer's throughput and latency targets are held against, each in turn.
    """
    out: list[dict] = []

    def add(name: str, ok: bool | None, figure: str) -> None:
        status = "n/a" if ok is None else ("pass" if ok else "miss")
        out.append({"target": name, "status": status, "figure": figure})

    def ratio_target(key: str, need: float, other: str) -> None:
        a = _get(cells, "infer", key, "output_tok_s")
        b = _get(cells, other, key, "output_tok_s")
        name = f"{key}: infer output tok/s >= {need:g}x {peer_label(other)}'s"
        if a is None or b is None or b <= 0:
            add(name, None, "not measured")
        else:
            add(name, a / b >= need, f"{a / b:.2f}x ({a:.1f} vs {b:.1f} tok/s)")

    def le_target(key: str, metric: str, label: str, other: str) -> None:
        a = _get(cells, "infer", key, metric)
        b = _get(cells, other, key, metric)
        name = f"{key}: infer {label} <= {peer_label(other)}'s"
        if a is None or b is None:
            add(name, None, "not measured")
        else:
            add(name, a <= b, f"{a:.1f} vs {b:.1f} ms")

    for other in others:
        ratio_target("64x64@16", 2.0, other)
        ratio_target("64x64@64", 2.0, other)
        le_target("64x64@1", "tpot_p50_ms", "TPOT p50", other)
        ratio_target("1024x128@16", 1.5, other)
        le_target("1024x128@16", "ttft_p50_ms", "TTFT p50", other)
        if LORA_TARGET_CELL in cells.get("infer", {}):
            ratio_target(LORA_TARGET_CELL, 1.5, other)
    keys = sorted(
        {k for k in cells.get("infer", {}) if k.endswith(("@1", "@16"))} | {"64x64@1", "64x64@16"},
        key=_cell_order,
    )
    for key in keys:
        itl = _get(cells, "infer", key, "itl_p50_ms")
        tpot = _get(cells, "infer", key, "tpot_p50_ms")
        name = f"{key}: infer ITL p50 <= 1.2x its TPOT p50"
        if itl is None or tpot is None or tpot <= 0:
            add(name, None, "not measured")
        else:
            add(name, itl <= 1.2 * tpot, f"{itl / tpot:.2f}x ({itl:.1f} vs {tpot:.1f} ms)")
    if offline is not None:
        http = _get(cells, "infer", "64x64@16", "output_tok_s")
        off = offline.get("output_tok_s") if "error" not in offline else None
        name = f"64x64@16: infer over HTTP loses <= {100 * HTTP_LOSS_TARGET:.0f}% vs the offline engine"
        if http is None or not off:
            add(name, None, "not measured")
        else:
            loss = 1 - http / off
            add(
                name,
                loss <= HTTP_LOSS_TARGET,
                f"{100 * loss:+.1f}% ({http:.1f} vs {off:.1f} tok/s)",
            )
    return out


def paired_ratios(runs: list[dict], cell_keys: list[str], other: str = "vllm") -> dict:
    """Per cell, infer's output tok/s over ``other``'s *of the same round*, and their median.

    The peers of one round run minutes apart, the rounds maybe an hour apart; on a shared
    machine whose speed drifts, the ratio within a round is steadier than the ratio of the
    peers' medians over all rounds.
    """
    out: dict = {}
    for key in cell_keys:
        by_round: dict[int, dict[str, float]] = {}
        for r in runs:
            if r["cell"] == key and "error" not in r and r.get("result"):
                by_round.setdefault(r["round"], {})[r["peer"]] = r["result"]["output_tok_s"]
        ratios = [
            v["infer"] / v[other]
            for _, v in sorted(by_round.items())
            if v.get("infer") and v.get(other)
        ]
        if ratios:
            out[key] = {"runs": ratios, "median": statistics.median(ratios)}
    return out


def paired_http_loss(runs: list[dict], offline_rounds: list[dict]) -> dict | None:
    """1 - infer's 64x64@16 tok/s over HTTP / the offline engine's, round by round (the offline
    run goes right before infer's server), and the median; None without a pair."""
    offline = {r["round"]: r["result"]["output_tok_s"] for r in offline_rounds if r.get("result")}
    losses = [
        1 - r["result"]["output_tok_s"] / offline[r["round"]]
        for r in sorted(runs, key=lambda r: r["round"])
        if r["peer"] == "infer"
        and r["cell"] == "64x64@16"
        and r.get("result")
        and offline.get(r["round"])
    ]
    return {"runs": losses, "median": statistics.median(losses)} if losses else None


def _cell_order(key: str) -> tuple[int, ...]:
    """Plain cells first (by input, output, C), then shared-prefix ones (by prefix, count), then
    the LoRA ones in the same order."""
    cell = parse_workloads(key)[0]
    return (
        cell.lora, cell.prefix_len, cell.num_prefixes, cell.input_len, cell.output_len,
        cell.concurrency,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Servers


VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
}
"""Environment of vLLM's CPU build (server and ``vllm bench`` client): offline, 2 GiB of KV
(infer's CPU default too), OpenMP threads on cores 0-1."""


def vllm_venv() -> Path:
    """The virtual environment of vLLM's CPU build: ``$VLLM_VENV``, default ``~/peers/vllm``."""
    return Path(os.environ.get("VLLM_VENV", Path.home() / "peers" / "vllm"))


def llamacpp_bin() -> str:
    """llama.cpp's ``llama-server``: ``$LLAMACPP_BIN``, else the one on ``PATH``."""
    return os.environ.get("LLAMACPP_BIN") or shutil.which("llama-server") or "llama-server"


def llamacpp_version(binary: str | Path, timeout_s: float = 60) -> str | None:
    """What ``llama-server --version`` prints (its build number and commit, the compiler), or
    None where it cannot run."""
    try:
        r = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.SubprocessError):
        return None
    text = "\n".join(x.strip() for x in (r.stdout, r.stderr) if x.strip())
    return text or None


def server_command(
    peer: str,
    model: Path,
    port: int,
    dtype: str,
    max_seqs: int,
    extra: str = "",
    *,
    max_model_len: int = 1024,
    served_name: str = "m",
    llamacpp_binary: str | Path | None = None,
    threads: int | None = None,
) -> tuple[list[str], dict]:
    """The command line and environment that start ``peer`` on ``model``.

    ``infer`` and ``vllm`` serve a model folder in ``dtype``. ``llamacpp`` serves a GGUF file
    (``model``; its tensors' types are the file's, ``dtype`` does not apply) with ``llama-server``
    (``llamacpp_binary``, default :func:`llamacpp_bin`): ``max_seqs`` parallel slots sharing a
    context of ``max_seqs * max_model_len`` tokens (``max_model_len`` per slot), ``threads``
    (default: every core) for decoding and for prompts alike.
    """
    env = dict(os.environ)
    # infer and vLLM take the same serving flags, by the same names.
    serving_flags = ["--port", str(port), "--dtype", dtype, "--max-num-seqs", str(max_seqs),
                     "--max-model-len", str(max_model_len), "--served-model-name", served_name]  # fmt: skip
    if peer == "infer":
        cmd = [sys.executable, "-m", "infer.server", "--model", str(model), *serving_flags,
               "--no-access-log", *shlex.split(extra)]  # fmt: skip
        return cmd, env
    if peer == "vllm":
        env.update(VLLM_ENV)
        cmd = [str(vllm_venv() / "bin" / "vllm"), "serve", str(model), "--host", "127.0.0.1",
               *serving_flags, *shlex.split(extra)]  # fmt: skip
        return cmd, env
    if peer == "llamacpp":
        n = str(threads or os.cpu_count() or 1)
        cmd = [
            str(llamacpp_binary or llamacpp_bin()),
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            str(max_seqs),
            "-c",
            str(max_seqs * max_model_len),
            "-t",
            n,
            "-tb",
            n,
            "--alias",
            served_name,
            *shlex.split(extra),
        ]
        return cmd, env
    raise SystemExit(f"unknown peer {peer!r} (known: infer, vllm, llamacpp)")


# ---------------------------------------------------------------------------------------------
# Machine load


def _busy_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot (``/proc/stat``, all cores)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _group_procs(pgid: int) -> Iterator[tuple[Path, list[str]]]:
    """The ``/proc/<pid>`` folder and the ``stat`` fields after the command name (state first)
    of each live process of process group ``pgid``."""
    from infer.bench.online import stat_fields

    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        rest = stat_fields(text)
        if int(rest[2]) == pgid:
            yield stat.parent, rest


def _group_cpu_s(pgid: int | None) -> float:
    """CPU seconds of the live processes of process group ``pgid`` (with reaped children)."""
    if pgid is None:
        return 0.0
    total = sum(sum(int(x) for x in rest[11:15]) for _, rest in _group_procs(pgid))
    return total / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime, in clock ticks


def _involuntary_switches(status: str) -> int:
    """``nonvoluntary_ctxt_switches`` of one ``/proc/<pid>/task/<tid>/status`` text."""
    for line in status.splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def _group_preemptions(pgid: int | None) -> int:
    """Times the threads of process group ``pgid`` lost their core while runnable (the sum of
    their ``nonvoluntary_ctxt_switches``; threads that have exited are not counted)."""
    if pgid is None:
        return 0
    total = 0
    for proc, _ in _group_procs(pgid):
        for status in proc.glob("task/*/status"):
            try:
                total += _involuntary_switches(status.read_text())
            except OSError:  # the thread has just exited
                continue
    return total


def _own_cpu_s() -> float:
    """CPU seconds of this driver and its reaped children (the ``vllm bench`` clients)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class OtherLoad:
    """CPU used by processes other than ours (driver, client, server group) over a span, in cores."""

    def __init__(self, server_pgid: int | None) -> None:
        self.pgid = server_pgid
        self.t0 = time.perf_counter()
        self.busy0, self.own0, self.srv0 = _busy_cpu_s(), _own_cpu_s(), _group_cpu_s(server_pgid)
        self.pre0 = _group_preemptions(server_pgid)

    def server(self, duration_s: float | None) -> dict:
        """The server's own figures over the span, per second of the client's measured
        ``duration_s`` (the span also holds the client's start-up, when the server idles): its
        CPU in cores, and how often its threads were preempted (another process took their
        core while they could run). On a machine with as many cores as engine threads, each
        preemption stalls the engine's other threads too: the figure behind what the HTTP
        server and the client cost it."""
        cpu_s = max(_group_cpu_s(self.pgid) - self.srv0, 0.0)
        preempted = max(_group_preemptions(self.pgid) - self.pre0, 0)
        if not duration_s:
            return {}
        return {"server_cpu_cores": cpu_s / duration_s,
                "server_preempted_per_s": preempted / duration_s}  # fmt: skip

    def cores(self) -> float:
        wall = time.perf_counter() - self.t0
        busy = _busy_cpu_s() - self.busy0
        # A server process that exits unreaped takes its CPU time with it: never below zero.
        ours = (_own_cpu_s() - self.own0) + max(_group_cpu_s(self.pgid) - self.srv0, 0.0)
        return min(max(busy - ours, 0.0) / max(wall, 1e-9), float(os.cpu_count() or 1))


QUIET_CORES = 0.25
"""Other processes using more CPU than this (in cores) during a run mark it as disturbed."""


def wait_quiet(max_wait_s: float, pgid: int | None = None, sample_s: float = 5.0) -> dict | None:
    """Wait (at most ``max_wait_s``) until other processes use <= :data:`QUIET_CORES` of CPU.

    Samples ``sample_s`` seconds at a time, our own processes (and group ``pgid``) excluded.
    ``max_wait_s <= 0``: no sampling, None.
    """
    if max_wait_s <= 0:
        return None
    t0 = time.perf_counter()
    while True:
        probe = OtherLoad(pgid)
        time.sleep(sample_s)
        other = probe.cores()
        waited = time.perf_counter() - t0
        if other <= QUIET_CORES or waited >= max_wait_s:
            return {"other_cpu_cores": other, "waited_s": waited, "quiet": other <= QUIET_CORES}
        print(
            f"  machine busy: other processes use {other:.2f} cores; waiting "
            f"({waited:.0f}/{max_wait_s:.0f} s)",
            flush=True,
        )


# ---------------------------------------------------------------------------------------------
# Running


def run_logged(cmd: list[str], env: dict, log_path: Path, timeout_s: float) -> int:
    """Run ``cmd`` in its own process group, output to ``log_path``; killed on timeout or error."""
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.write(f"\n[killed after {timeout_s:.0f} s]\n")
            return -9
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def prefix_counters(base_url: str) -> tuple[float, float] | None:
    """``(queries, hits)`` of the server's prefix cache, in tokens, from its ``/metrics``
    (``vllm:prefix_cache_queries_total`` / ``..._hits_total``: the same names on both peers),
    or None where it has none."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    sums = {"queries": 0.0, "hits": 0.0}
    found = False
    for line in text.splitlines():
        for name in sums:
            if line.startswith(f"vllm:prefix_cache_{name}_total"):
                sums[name] += float(line.rsplit(" ", 1)[1])
                found = True
    return (sums["queries"], sums["hits"]) if found else None


def measure_cell(peer: str, cell: Cell, round_idx: int, ctx: dict, server_pgid: int | None) -> dict:
    """Warm-up then measured ``vllm bench serve`` for one cell; the parsed result and context."""
    args, out = ctx["args"], ctx["out"]
    stem = f"round{round_idx}-{peer}-{cell.workload.replace('/', '_')}-c{cell.concurrency}"
    by_request = peer in COUNT_BY_REQUEST
    common = {
        "base_url": ctx["base_url"],
        "model_name": ctx["served_name"],
        "tokenizer": ctx["model"],
        "result_dir": out / "results",
        "detailed": by_request,
    }
    names = ctx["lora_names"] if cell.lora else []
    # With adapters, the warm-up sends at least one request to each of them, in turn: none is
    # loaded for the first time during the measured run.
    n_warm = max(cell.concurrency, len(names))
    warm = client_command(
        ctx["vllm_bin"],
        cell,
        num_prompts=n_warm,
        seed=cell_seed(args.seed, round_idx, cell, warmup=True),
        result_filename=f"{stem}-warmup.json",
        output_len=min(args.warmup_output_len, cell.output_len),
        lora_modules=names,
        lora_assignment="round-robin" if names else None,
        **common,
    )
    n = args.num_prompts or 4 * cell.concurrency
    cmd = client_command(
        ctx["vllm_bin"],
        cell,
        num_prompts=n,
        seed=cell_seed(args.seed, round_idx, cell, warmup=False),
        result_filename=f"{stem}.json",
        lora_modules=names,
        **common,
    )
    row: dict = {
        "cell": cell.key,
        "round": round_idx,
        "peer": peer,
        "num_prompts": n,
        "load_before_warmup": list(os.getloadavg()),
        "warmup_command": shlex.join(warm),
        "command": shlex.join(cmd),
        "log": f"logs/{stem}.log",
        "result_file": f"results/{stem}.json",
    }
    rc = run_logged(warm, ctx["client_env"], out / "logs" / f"{stem}-warmup.log", args.cell_timeout)
    warm_path = out / "results" / f"{stem}-warmup.json"
    warm_ok = rc == 0 and warm_path.exists()
    if warm_ok:  # vllm bench exits 0 even when every request failed
        warm_ok = parse_result(json.loads(warm_path.read_text()))["completed"] == n_warm
    if not warm_ok:
        row["error"] = f"warm-up failed (client exit {rc}; see logs/{stem}-warmup.log)"
        return row
    row["quiet_wait"] = wait_quiet(args.wait_quiet, server_pgid)
    row["load_before"] = list(os.getloadavg())
    other = OtherLoad(server_pgid)
    cache_before = prefix_counters(ctx["base_url"])
    t0 = time.perf_counter()
    rc = run_logged(cmd, ctx["client_env"], out / "logs" / f"{stem}.log", args.cell_timeout)
    row["client_wall_s"] = time.perf_counter() - t0
    cache_after = prefix_counters(ctx["base_url"])
    if cache_before and cache_after and cache_after[0] > cache_before[0]:
        # the prefix cache's hit rate over the measured run (tokens), from the server's /metrics
        row["prefix_hit_rate"] = (cache_after[1] - cache_before[1]) / (
            cache_after[0] - cache_before[0]
        )
    row["other_cpu_cores"] = other.cores()
    path = out / "results" / f"{stem}.json"
    if rc != 0 or not path.exists():
        row["error"] = f"client exited {rc} (see {row['log']})"
        return row
    res = parse_result(json.loads(path.read_text()), cell.output_len if by_request else None)
    if "prefix_hit_rate" in row:
        res["prefix_hit_rate"] = row["prefix_hit_rate"]
    row["result"] = res
    row.update(other.server(res["duration_s"]))
    if res["failed"] or res["completed"] < n:
        row["error"] = f"{res['completed']}/{n} requests completed (see {row['log']})"
        if res.get("errors"):
            row["error"] += f": {'; '.join(res['errors'])}"
    return row


def _vllm_model_note(cfg: dict) -> str:
    folder = cfg.get("vllm_model")
    return f" (vLLM serving `{folder}` instead, under the same name)" if folder else ""


def peer_dtype(peer: str, args: argparse.Namespace) -> str:
    """The dtype ``peer`` serves in: ``--dtype``, or ``--vllm-dtype`` for vLLM where given."""
    return (args.vllm_dtype or args.dtype) if peer == "vllm" else args.dtype


def lora_server_args(modules: list[str], max_loras: int, max_rank: int) -> list[str]:
    """The flags that serve the adapters ``modules`` (``name=path``), the same for infer and
    vLLM."""
    return [
        "--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(max_rank),
        "--lora-modules", *modules,
    ]  # fmt: skip


def server_groups(cells: list[Cell]) -> list[tuple[bool, list[Cell]]]:
    """The cells each server of a round measures: the base model's on a plain server, then the
    LoRA cells on one started with the adapters (only the groups that have cells)."""
    groups = [(lora, [c for c in cells if c.lora == lora]) for lora in (False, True)]
    return [(lora, group) for lora, group in groups if group]


def run_peer_round(
    peer: str, round_idx: int, cells: list[Cell], ctx: dict, lora: bool = False
) -> dict:
    """Start ``peer``'s server (with the LoRA adapters if ``lora``), measure every cell, stop it
    (always)."""
    from infer.bench.online import serving

    args, out = ctx["args"], ctx["out"]
    extra = {"infer": args.infer_args, "vllm": args.vllm_args}.get(peer, "")
    if lora:
        extra = " ".join(x for x in (extra, shlex.join(ctx["lora_server_args"])) if x)
    model = ctx["vllm_model"] if peer == "vllm" and ctx["vllm_model"] else ctx["model"]
    if peer == "llamacpp":
        extra, model = args.llamacpp_args, ctx["llamacpp_model"]
    cmd, env = server_command(
        peer,
        model,
        args.port,
        peer_dtype(peer, args),
        args.max_num_seqs,
        extra,
        max_model_len=args.max_model_len,
        served_name=ctx["served_name"],
        llamacpp_binary=ctx.get("llamacpp_bin"),
        threads=ctx.get("llamacpp_threads"),
    )
    env_note = {k: env[k] for k in ctx["vllm_env"]} if peer == "vllm" else {}
    info: dict = {
        "server_command": shlex.join(cmd),
        "server_env": env_note,
        "server_log": f"logs/round{round_idx}-{peer}{'-lora' if lora else ''}-server.log",
        "cells": {},
    }
    if lora:
        info["lora"] = True
    print(f"[round {round_idx}] starting {peer}: {shlex.join(cmd)}", flush=True)
    log = out / info["server_log"]
    try:
        with serving(cmd, env, log, args.port, args.startup_timeout) as (proc, _, startup_s):
            info["startup_s"] = startup_s
            print(f"[round {round_idx}] {peer} healthy after {startup_s:.0f} s", flush=True)
            for cell in cells:
                row = measure_cell(peer, cell, round_idx, ctx, proc.pid)
                info["cells"][cell.key] = row
                print(f"[round {round_idx}] {peer} {cell.key}: {_one_line(row)}", flush=True)
                if proc.poll() is not None:
                    raise RuntimeError(f"{peer} server exited with {proc.returncode} mid-run")
    except Exception as e:  # noqa: BLE001 - a failed peer is reported; the other still runs
        info["error"] = f"{type(e).__name__}: {e}"
        print(f"[round {round_idx}] {peer} FAILED: {info['error']}", flush=True)
    return info


def _one_line(row: dict) -> str:
    if "error" in row and "result" not in row:
        return f"FAILED: {row['error']}"
    r = row["result"]
    text = (
        f"{r['output_tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.1f} ms, "
        f"TPOT p50 {r['tpot_p50_ms']:.1f} ms, ITL p50/p99 {r['itl_p50_ms']:.1f}/"
        f"{r['itl_p99_ms']:.1f} ms, {r['completed']}/{row['num_prompts']} done, "
        f"load {row['load_before'][0]:.2f}, other CPU {row['other_cpu_cores']:.2f} cores, "
        f"server {row.get('server_cpu_cores', 0):.2f} cores, preempted "
        f"{row.get('server_preempted_per_s', 0):.0f}/s"
        + (f", prefix hits {100 * r['prefix_hit_rate']:.0f}%" if "prefix_hit_rate" in r else "")
    )
    return text + (f" ({row['error']})" if "error" in row else "")


def run_offline_round(round_idx: int, ctx: dict) -> dict:
    """The offline engine at C=16 (64 prompts, 64/64) in a fresh process; its figures."""
    args, out = ctx["args"], ctx["out"]
    stem = f"round{round_idx}-offline"
    cmd = [
        sys.executable,
        "-m",
        "infer.bench.vs_vllm",
        "offline",
        "--model",
        str(ctx["model"]),
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--seed",
        str(cell_seed(args.seed, round_idx, Cell(64, 64, 16), warmup=False)),
        "--json",
        str(out / "results" / f"{stem}.json"),
    ]
    row: dict = {"command": shlex.join(cmd), "log": f"logs/{stem}.log"}
    row["quiet_wait"] = wait_quiet(args.wait_quiet)
    row["load_before"] = list(os.getloadavg())
    other = OtherLoad(None)
    rc = run_logged(cmd, dict(os.environ), out / "logs" / f"{stem}.log", args.cell_timeout)
    row["other_cpu_cores"] = other.cores()
    path = out / "results" / f"{stem}.json"
    if rc != 0 or not path.exists():
        row["error"] = f"offline run exited {rc} (see {row['log']})"
    else:
        row["result"] = json.loads(path.read_text())
    print(
        f"[round {round_idx}] offline 64x64@16: {row.get('result', row.get('error'))}", flush=True
    )
    return row


def offline_main(argv: list[str]) -> int:
    """``python -m infer.bench.vs_vllm offline ...``: one offline measurement, as JSON."""
    p = argparse.ArgumentParser(prog="python -m infer.bench.vs_vllm offline")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)

    import torch

    from infer import LLM
    from infer.bench.offline import greedy, prompt_vocab, random_prompts, timed_generate

    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=a.concurrency, max_model_len=a.max_model_len)
    vocab = prompt_vocab(llm.engine)
    gen = torch.Generator().manual_seed(a.seed)  # the warm-up's prompts, then the measured ones
    llm.generate(
        random_prompts(vocab, a.concurrency, a.input_len, gen), greedy(min(16, a.output_len))
    )
    batch = random_prompts(vocab, a.num_prompts, a.input_len, gen)
    tokens, wall = timed_generate(llm, batch, greedy(a.output_len))
    res = {
        "num_prompts": a.num_prompts,
        "max_num_seqs": a.concurrency,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "total_output_tokens": tokens,
        "duration_s": wall,
        "output_tok_s": tokens / wall,
    }
    Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return 0


# ---------------------------------------------------------------------------------------------
# Versions and the report


def versions(vllm_python: Path) -> dict:
    """infer (version, git commit, working-tree changes), torch, Python, CPU; vLLM's venv."""
    import torch

    import infer
    from infer.bench.report import cpu_model

    def git(*a: str) -> str | None:
        try:
            r = subprocess.run(
                ["git", *a],
                capture_output=True,
                text=True,
                timeout=10,
                cwd=Path(infer.__file__).resolve().parent,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.rstrip() if r.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    v: dict = {
        "infer": infer.__version__,
        "infer_git": git("describe", "--always", "--dirty", "--abbrev=10"),
        "infer_modified_files": [ln[3:] for ln in status.splitlines()] if status else [],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    code = "import importlib.metadata as m, platform; print(m.version('vllm'), m.version('torch'), platform.python_version())"
    try:
        r = subprocess.run(
            [str(vllm_python), "-c", code], capture_output=True, text=True, timeout=60
        )
        v["vllm"], v["vllm_torch"], v["vllm_python"] = r.stdout.split()
    except (OSError, subprocess.SubprocessError, ValueError):
        v["vllm"] = None
    return v


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _vllm_dtype_note(cfg: dict) -> str:
    vdt = cfg.get("vllm_dtype") or cfg["dtype"]
    return "" if vdt == cfg["dtype"] else f" (vLLM: `--dtype {vdt}`)"


def _loads(xs: list[float] | None) -> str:
    """``os.getloadavg()``'s three figures, as ``1.00/0.50/0.25``."""
    return "/".join(f"{x:.2f}" for x in xs or [])


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _config_line(cfg: dict, others: list[str]) -> str:
    """What each server ran with: the shared flags, each peer's own, the extra arguments."""
    flags = (
        f"`--dtype {cfg['dtype']} --max-num-seqs {cfg['max_num_seqs']} --max-model-len "
        f"{cfg['max_model_len']}`"
    )
    if "llamacpp" not in others:
        return (
            f"{flags} for both{_vllm_dtype_note(cfg)}{_vllm_model_note(cfg)}; infer extra args: "
            f"`{cfg['infer_args'] or '-'}`, vLLM extra args: `{cfg['vllm_args'] or '-'}`."
        )
    seqs, ctx_len, threads = cfg["max_num_seqs"], cfg["max_model_len"], cfg.get("llamacpp_threads")
    text = f"{flags} for infer"
    if "vllm" in others:
        text += f" and vLLM{_vllm_dtype_note(cfg)}{_vllm_model_note(cfg)}"
    text += (
        f"; llama.cpp's `llama-server` serves the GGUF `{cfg.get('llamacpp_model')}` (its own "
        f"tensor types) with `-np {seqs} -c {seqs * ctx_len} -t {threads} -tb {threads}`: "
        f"{seqs} slots of {ctx_len} tokens each; infer extra args: `{cfg['infer_args'] or '-'}`, "
    )
    if "vllm" in others:
        text += f"vLLM extra args: `{cfg['vllm_args'] or '-'}`, "
    return text + f"llama.cpp extra args: `{cfg.get('llamacpp_args') or '-'}`."


LLAMACPP_COUNT_NOTE = (
    "llama.cpp's output tokens are counted by request: every completed request produced "
    "exactly the cell's output length (`--ignore-eos`), so its tok/s is completed * OUT / the "
    "client's duration, and its TPOT per request (latency - TTFT) / (OUT - 1) (`vllm bench "
    "serve` ignores the `usage` llama-server sends in the same last chunk as a `choices` entry, "
    "re-tokenizes the streamed text and undercounts). Its ITL is the gap between streamed "
    "chunks, one per token, less the closing chunk without a token that ends each of "
    "llama-server's streams (a token that ends inside a UTF-8 character would go out with the "
    "next one)."
)


def _lora_note(cfg: dict) -> str:
    names = [m.split("=", 1)[0] for m in cfg["lora_modules"]]
    return (
        f"`lora/` cells: both servers started with `{cfg['lora_server_args']}` on top of the "
        f"flags above (a server of its own, after the base model's), each request naming one of "
        f"the {len(names)} adapters ({', '.join(names)}) as its model, at random (`vllm bench "
        f"serve --lora-modules {' '.join(names)}`, seeded: the same adapters in the same order "
        "for both peers); the warm-up sends at least one request to each adapter, in turn. The "
        "other cells are the base model on a server without adapters, on the same prompts."
    )


def _lora_cost(report: dict) -> list[str]:
    """Each peer's LoRA cells' output tok/s over its base model's on the same cell."""
    med = report["medians"]
    lines: list[str] = []
    for key in (c["key"] for c in report["cells"]):
        if not key.startswith("lora/"):
            continue
        base = key.removeprefix("lora/")
        parts = []
        for peer in report["config"]["peers"]:
            a, b = _get(med, peer, key, "output_tok_s"), _get(med, peer, base, "output_tok_s")
            if a and b:
                parts.append(f"{peer_label(peer)} {a / b:.0%} ({a:.1f} vs {b:.1f} tok/s)")
        if parts:
            lines.append(f"- {key}: {'; '.join(parts)}")
    if lines:
        lines = ["", "With adapters, as a share of the base model's output tok/s:", "", *lines]
    return lines


def _results_table(report: dict, other: str) -> list[str]:
    """The medians of every cell, infer beside ``other``, with their ratio."""
    med, o = report["medians"], peer_label(other)

    def cellv(peer: str, key: str, metric: str) -> str:
        row = med.get(peer, {}).get(key)
        return "-" if row is None else "failed" if "error" in row else _fmt(row.get(metric))

    def done(peer: str, key: str) -> str:
        if med.get(peer, {}).get(key) is None:
            return "-"
        runs = [r for r in report["runs"] if r["peer"] == peer and r["cell"] == key]
        bad = sum("error" in r for r in runs)
        return f"{len(runs) - bad}/{len(runs)} runs ok" + (" ⚠" if bad else "")

    rows, tails = [], []
    for key in (c["key"] for c in report["cells"]):
        a, b = _get(med, "infer", key, "output_tok_s"), _get(med, other, key, "output_tok_s")
        pairs = [f"{cellv('infer', key, m)} / {cellv(other, key, m)}"
                 for m in ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms")]  # fmt: skip
        rows.append([*key.split("@"), cellv("infer", key, "output_tok_s"),
                     cellv(other, key, "output_tok_s"), f"{a / b:.2f}x" if a and b else "-",
                     *pairs, f"{done('infer', key)} / {done(other, key)}"])  # fmt: skip
        hits = [_get(med, p, key, "prefix_hit_rate") for p in ("infer", other)]
        tails.append("" if hits[0] is None else
                     f" prefix cache hit rate {_pct(hits[0])} / {_pct(hits[1])}")  # fmt: skip
    header = ["workload", "C", "infer tok/s", f"{o} tok/s", f"infer / {o}"]
    header += [f"{m} infer / {o}" for m in ("TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms",
                                            "ITL p99 ms", "done")]  # fmt: skip
    lines = md_table(header, rows, "lrrrr")  # a shared-prefix cell's hit rate trails its row
    return lines[:2] + [line + tail for line, tail in zip(lines[2:], tails, strict=True)]


def render(report: dict) -> str:
    """The Markdown report of :func:`run`'s JSON."""
    cfg = report["config"]
    keys = [c["key"] for c in report["cells"]]
    others = other_peers(cfg["peers"])
    lines = [
        f"# infer vs {' and '.join(peer_label(o) for o in others)} over HTTP (`vllm bench "
        "serve`, same machine, same prompts)",
        "",
        f"{report['created']}. Model `{cfg['model']}` served as `{cfg['served_name']}`, "
        f"{_config_line(cfg, others)} Servers run one at a time; "
        f"{cfg['runs']} round(s), the peers' order alternating; medians over rounds. "
        f"Client: `vllm bench serve`, random prompts, `--ignore-eos --temperature 0`, "
        f"`--num-prompts {cfg['num_prompts'] or '4*C'} --max-concurrency C`; one warm-up run "
        f"(C prompts, {cfg['warmup_output_len']} output tokens) before each measured run. "
        "A `sharedP/N+INxOUT` workload is `vllm bench serve`'s `prefix_repetition` dataset: N "
        "distinct P-token prefixes, each prompt one of them + IN unique tokens.",
        "",
    ]
    if "llamacpp" in others:
        lines += [LLAMACPP_COUNT_NOTE, ""]
    if cfg.get("lora_modules"):
        lines += [_lora_note(cfg), ""]
    lines += ["## Results (medians)", ""]
    for i, other in enumerate(others):
        if len(others) > 1:
            lines += ([""] if i else []) + [f"infer vs {peer_label(other)}:", ""]
        lines += _results_table(report, other)
    lines += _lora_cost(report)
    if "offline" in report:
        off = report["offline"]["median"]
        lines += [
            "",
            f"Offline engine (`LLM.generate`, max_num_seqs=16, 64 prompts, 64x64): "
            f"{_fmt(off.get('output_tok_s'))} tok/s (runs: "
            f"{', '.join(_fmt(x) for x in off.get('output_tok_s_runs', []))}); "
            f"`--infer-args` do not apply to it.",
        ]
        loss = report["offline"].get("paired_loss")
        if loss and len(loss["runs"]) > 1:
            each = ", ".join(f"{100 * x:.1f}%" for x in loss["runs"])
            lines.append(
                f"HTTP's loss paired by round (each round's offline run against the infer server "
                f"that followed it): median {100 * loss['median']:.1f}% (rounds: {each})."
            )
    disturbed = [r for r in report["runs"] if (r.get("other_cpu_cores") or 0) > QUIET_CORES]
    if disturbed:
        lines += [
            "",
            f"⚠ {len(disturbed)} of {len(report['runs'])} measured runs had other processes "
            f"using more than {QUIET_CORES} cores (see *Every run*): figures from a busy machine.",
        ]
    by_peer = report.get("paired_ratios_by_peer") or {others[0]: report.get("paired_ratios")}
    for other in others:
        paired = by_peer.get(other) or {}
        if not any(len(v["runs"]) > 1 for v in paired.values()):
            continue
        lines += [
            "",
            f"Paired by round (infer / {peer_label(other)} of the same round, whose servers ran "
            "minutes apart; steadier than the ratio of medians when the machine's speed drifts "
            "between rounds):",
            "",
        ]
        for key in keys:
            if key in paired:
                p = paired[key]
                each = ", ".join(f"{x:.2f}" for x in p["runs"])
                lines.append(f"- {key}: median {p['median']:.2f}x (rounds: {each})")
    lines += ["", "## Targets", ""]
    for t in report["targets"]:
        mark = {"pass": "PASS", "miss": "MISS", "n/a": "n/a"}[t["status"]]
        lines.append(f"- **{mark}** {t['target']}: {t['figure']}")
    lines += [
        "",
        "## Every run",
        "",
        "Load: `os.getloadavg()` (1/5/15 min) before the warm-up and before the measured run; "
        "other CPU: cores busy with processes other than this driver, the client and the "
        "server during the measured run (from `/proc/stat`); ⚠ disturbed above "
        f"{QUIET_CORES} cores. Server CPU: the server's processes, in cores; preempted /s: how "
        "often per second one of its threads lost its core to another process while it could "
        "run (`nonvoluntary_ctxt_switches`), which on a machine with as many cores as engine "
        "threads stalls the engine's other threads too.",
        "",
    ]
    rows = []
    for r in report["runs"]:
        res = r.get("result", {})
        status = f"{res.get('completed', 0)}/{r.get('num_prompts', '?')}"
        status += f" ⚠ {r['error']}" if "error" in r else ""
        status += " ⚠ disturbed" if (r.get("other_cpu_cores") or 0) > QUIET_CORES else ""
        rows.append([
            r["round"], r["peer"], r["cell"], _fmt(res.get("output_tok_s")),
            _fmt(res.get("ttft_p50_ms")), _fmt(res.get("tpot_p50_ms")),
            f"{_fmt(res.get('itl_p50_ms'))} / {_fmt(res.get('itl_p99_ms'))}", status,
            _loads(r.get("load_before_warmup")), _loads(r.get("load_before")),
            _fmt(r.get("other_cpu_cores"), 2), _fmt(r.get("server_cpu_cores"), 2),
            _fmt(r.get("server_preempted_per_s"), 0),
        ])  # fmt: skip
    for rnd in report.get("offline", {}).get("rounds", []):
        res = rnd.get("result", {})
        rows.append([rnd["round"], "offline", "64x64@16", _fmt(res.get("output_tok_s")), "", "",
                     "", "⚠ " + rnd["error"] if "error" in rnd else "", "",
                     _loads(rnd.get("load_before")), _fmt(rnd.get("other_cpu_cores"), 2), "", ""])  # fmt: skip
    lines += md_table(
        "round | peer | cell | output tok/s | TTFT p50 | TPOT p50 | ITL p50 / p99 | done "
        "| load before warm-up | load before run | other CPU (cores) | server CPU (cores) "
        "| server preempted /s", rows, "rllrrrllllrrr",
    )  # fmt: skip
    v = report["versions"]
    lines += [
        "",
        "## Versions",
        "",
        f"- infer {v['infer']} (git {v.get('infer_git')}), torch {v['torch']} "
        f"({v['torch_threads']} threads), Python {v['python']}",
        f"- vLLM {v.get('vllm')} (torch {v.get('vllm_torch')}, Python {v.get('vllm_python')}), "
        f"venv `{cfg['vllm_venv']}`",
        *(
            [
                f"- llama.cpp: `{cfg.get('llamacpp_bin')}` (`--version`: "
                f"{'; '.join((v.get('llamacpp') or 'unknown').splitlines())}), GGUF "
                f"`{cfg.get('llamacpp_model')}`"
            ]
            if "llamacpp" in cfg["peers"]
            else []
        ),
        f"- CPU: {v['cpu']}, {v['cpus']} logical CPUs; {v['platform']}",
    ]
    if v.get("infer_modified_files"):
        lines.append(
            f"- infer working tree had uncommitted changes in: {', '.join(v['infer_modified_files'])}"
        )
    lines += ["", "## Commands", "", f"Driver: `{report['argv']}`", ""]
    for rnd in report["servers"]:
        kind = " LoRA" if rnd.get("lora") else ""
        lines.append(
            f"- round {rnd['round']} {rnd['peer']}{kind} server (log `{rnd['server_log']}`):"
        )
        env = " ".join(f"{k}={val}" for k, val in rnd["server_env"].items())
        lines.append(f"  `{(env + ' ') if env else ''}{rnd['server_command']}`")
        if "error" in rnd:
            lines.append(f"  failed: {rnd['error']}")
    first = [r for r in report["runs"] if r["round"] == 0 and "command" in r]
    if first:
        lines += [
            "",
            "Client commands of round 0 (later rounds differ only in `--seed` and file names; "
            f"all are in the JSON). Client environment: "
            f"`{' '.join(f'{k}={val}' for k, val in report['client_env'].items())}`",
            "",
        ]
        for r in first:
            lines.append(f"- {r['peer']} {r['cell']} warm-up: `{r['warmup_command']}`")
            lines.append(f"- {r['peer']} {r['cell']}: `{r['command']}`")
    for rnd in report.get("offline", {}).get("rounds", [])[:1]:
        lines.append(f"- offline (round 0): `{rnd['command']}`")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """``infer bench vs-vllm``: rounds of each peer in turn; ``vs_vllm.json`` + ``vs_vllm.md``."""
    from infer.bench.online import port_is_free
    from infer.bench.report import now_iso
    from infer.testing.bench_models import llama_100m

    cells = parse_workloads(args.workloads)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = set(peers) - set(PEER_LABELS)
    if unknown:
        raise SystemExit(
            f"unknown peer(s) {', '.join(sorted(unknown))} (known: {', '.join(PEER_LABELS)})"
        )
    lora_modules = list(getattr(args, "lora_modules", None) or [])
    if any(c.lora for c in cells) != bool(lora_modules):
        raise SystemExit(
            "lora/ workloads need --lora-modules name=path ..., and --lora-modules needs a "
            "lora/ workload (e.g. --workloads 64x64@16,lora/64x64@16)"
        )
    if lora_modules and "llamacpp" in peers:
        raise SystemExit("lora/ workloads run on infer and vLLM only")
    lora_names = [m.split("=", 1)[0] for m in lora_modules]
    if any("=" not in m for m in lora_modules) or len(set(lora_names)) != len(lora_names):
        raise SystemExit("--lora-modules takes distinct name=path pairs")
    max_loras = getattr(args, "max_loras", None) or len(lora_modules)
    max_lora_rank = getattr(args, "max_lora_rank", 16)
    gguf = binary = None
    if "llamacpp" in peers:
        if not args.llamacpp_model:
            raise SystemExit("--peers llamacpp needs --llamacpp-model FILE.gguf")
        gguf = Path(args.llamacpp_model).expanduser().resolve()
        if not gguf.is_file():
            raise SystemExit(f"--llamacpp-model {gguf}: no such file")
        binary = str(Path(args.llamacpp_bin).expanduser()) if args.llamacpp_bin else llamacpp_bin()
        if not (Path(binary).is_file() or shutil.which(binary)):
            raise SystemExit(
                f"llama-server not found ({binary}): give --llamacpp-bin or set $LLAMACPP_BIN"
            )
    threads = os.cpu_count() or 1
    venv = vllm_venv()
    vllm_bin = venv / "bin" / "vllm"
    if not vllm_bin.exists():
        raise SystemExit(f"{vllm_bin} not found: vllm bench serve is the client (set $VLLM_VENV)")
    if not port_is_free(args.port):
        raise SystemExit(f"port {args.port} is already in use; pick another with --port")
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "results").mkdir(parents=True, exist_ok=True)
    model = llama_100m(args.model).resolve()
    client_env = dict(os.environ) | VLLM_ENV
    ctx = {
        "args": args,
        "out": out,
        "model": model,
        "served_name": args.served_name or model.name,
        "vllm_model": Path(args.vllm_model).resolve() if args.vllm_model else None,
        "llamacpp_model": gguf,
        "llamacpp_bin": binary,
        "llamacpp_threads": threads,
        "base_url": f"http://127.0.0.1:{args.port}",
        "vllm_bin": vllm_bin,
        "vllm_env": VLLM_ENV,
        "client_env": client_env,
        "lora_names": lora_names,
        "lora_server_args": lora_server_args(lora_modules, max_loras, max_lora_rank),
    }
    report: dict = {
        "schema": "infer.bench.vs_vllm/1",
        "created": now_iso(),
        "argv": shlex.join([sys.executable, *sys.argv]),
        "config": {
            "model": str(model),
            "served_name": ctx["served_name"],
            "vllm_model": args.vllm_model and str(ctx["vllm_model"]),
            "peers": peers,
            "dtype": args.dtype,
            "vllm_dtype": peer_dtype("vllm", args),
            "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len,
            "runs": args.runs,
            "seed": args.seed,
            "num_prompts": args.num_prompts,
            "warmup_output_len": args.warmup_output_len,
            "wait_quiet_s": args.wait_quiet,
            "infer_args": args.infer_args,
            "vllm_args": args.vllm_args,
            "offline": args.offline,
            "vllm_venv": str(venv),
            "port": args.port,
            **(
                {
                    "lora_modules": lora_modules,
                    "max_loras": max_loras,
                    "max_lora_rank": max_lora_rank,
                    "lora_server_args": shlex.join(ctx["lora_server_args"]),
                }
                if lora_modules
                else {}
            ),
            **(
                {
                    "llamacpp_model": str(gguf),
                    "llamacpp_bin": binary,
                    "llamacpp_args": args.llamacpp_args,
                    "llamacpp_threads": threads,
                }
                if gguf
                else {}
            ),
        },
        "cells": [{"key": c.key, **dataclasses.asdict(c)} for c in cells],
        "versions": versions(venv / "bin" / "python")
        | ({"llamacpp": llamacpp_version(binary)} if binary else {}),
        "client_env": VLLM_ENV,
        "servers": [],
        "runs": [],
    }
    if args.offline:
        report["offline"] = {"rounds": []}

    def on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
        raise SystemExit(143)  # unwinds through every finally: servers get stopped

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    t_start = time.perf_counter()
    try:
        for r in range(args.runs):
            order = peers if r % 2 == 0 else peers[::-1]
            for peer in order:
                if args.offline and peer == "infer":
                    report["offline"]["rounds"].append({"round": r, **run_offline_round(r, ctx)})
                for lora, group in server_groups(cells):
                    info = run_peer_round(peer, r, group, ctx, lora=lora)
                    rows = info.pop("cells")
                    report["servers"].append({"round": r, "peer": peer, **info})
                    report["runs"].extend(rows.values())
                    if "error" in info:
                        for c in group:
                            if c.key not in rows:
                                report["runs"].append(
                                    {
                                        "cell": c.key,
                                        "round": r,
                                        "peer": peer,
                                        "error": info["error"],
                                    }
                                )
            if args.offline and "infer" not in peers:
                report["offline"]["rounds"].append({"round": r, **run_offline_round(r, ctx)})
    finally:
        signal.signal(signal.SIGTERM, previous)
        report["wall_s"] = time.perf_counter() - t_start
        finish(report, out)
    failed = [r for r in report["runs"] if "error" in r]
    failed += [r for r in report.get("offline", {}).get("rounds", []) if "error" in r]
    return 1 if failed else 0


def finish(report: dict, out: Path) -> None:
    """Medians, targets; write ``vs_vllm.json`` and ``vs_vllm.md`` (also after an interruption)."""
    med: dict = {}
    for peer in report["config"]["peers"]:
        for c in report["cells"]:
            runs = [r for r in report["runs"] if r["peer"] == peer and r["cell"] == c["key"]]
            if runs:
                med.setdefault(peer, {})[c["key"]] = median_result(runs)
    report["medians"] = med
    keys = [c["key"] for c in report["cells"]]
    others = other_peers(report["config"]["peers"])
    by_peer = {other: paired_ratios(report["runs"], keys, other) for other in others}
    report["paired_ratios"] = by_peer[others[0]]
    if others != ["vllm"]:
        report["paired_ratios_by_peer"] = by_peer
    offline = None
    if "offline" in report:
        ok = [r["result"] for r in report["offline"]["rounds"] if "result" in r]
        offline = {"error": "no offline run succeeded"}
        if ok:
            offline = {
                "output_tok_s": statistics.median(x["output_tok_s"] for x in ok),
                "output_tok_s_runs": [x["output_tok_s"] for x in ok],
            }
        report["offline"]["median"] = offline
        report["offline"]["paired_loss"] = paired_http_loss(
            report["runs"], report["offline"]["rounds"]
        )
    (out / "vs_vllm.json").write_text(json.dumps(report, indent=1) + "\n")  # first: kept if
    report["targets"] = check_targets(med, offline, others)  # anything below fails
    (out / "vs_vllm.json").write_text(json.dumps(report, indent=1) + "\n")
    md = render(report)
    (out / "vs_vllm.md").write_text(md)
    print("\n" + md, flush=True)
    print(f"report: {out / 'vs_vllm.md'} (+ vs_vllm.json, logs/, results/)", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["offline"]:
        sys.exit(offline_main(sys.argv[2:]))
    sys.exit("usage: python -m infer.bench.vs_vllm offline ... (the driver is infer bench vs-vllm)")

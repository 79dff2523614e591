"""One GPU, one process, every number the CUDA path is judged by: ``infer bench gpu``.

    infer bench gpu [--out bench-results/gpu] [--quick] [--modes graphs,graphs-sync,eager,...]
                    [--concurrency 1,16,64,256] [--skip-buckets] [--skip-kernels] [--skip-hf]

(``python benchmarks/bench_gpu.py`` runs the same; ``scripts/gpu_check.sh`` runs it on a lent
machine after the GPU tests.) Sections, each timed, printed as it finishes and written to
``gpu.json`` / ``gpu.md`` under ``--out`` straight away, so a run cut short keeps what it had:

1. **model**: a random-weight bf16 Llama of Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 query
   / 8 KV heads of 64, MLP 8192, vocab 128256, tied embeddings: 1.24B parameters), built on the
   GPU once into ``~/.cache/infer/bench/llama-1b-shape`` with a BPE tokenizer (``--model DIR``
   uses another folder).
2. **roofline**: HBM read rate (a sum over a 4 GiB bf16 tensor, median), bf16 matmul TFLOP/s, and
   the weight-read limit of one decode step (weight bytes / read rate).
3. **engine**: the offline engine per ``--modes`` (``graphs``: Triton paged attention, CUDA
   graphs and async scheduling; ``graphs-sync``: the same, each step waiting for the one
   before; ``eager``: Triton, no graphs; ``torch-eager``: gather + SDPA, no graphs, the old
   path), one engine per mode, closed loop at C = ``--concurrency`` on 128-token prompts / 128
   greedy tokens (2C requests, C in flight) and 1024 / 128 at C = 16: output tok/s, ITL and
   TTFT p50. Then, per ``--bucket-modes``, the time of a pure decode step at batch sizes
   ``--buckets`` (B requests decoding, ``engine.step()`` timed, median).
4. **kernels**: ``infer.runner.gpu.triton_attention.paged_decode_attention`` on the model's
   heads at batch x context, K/V bytes read per call against the measured read rate, today's
   torch path (index_select gather + masked SDPA) beside it, and split-K at batch 1, 8k. A
   kernel micro-benchmark, outside the package: ``benchmarks/gpu_kernels.py`` of the source
   checkout (:func:`kernel_benchmark`; the ``--kernel-*`` flags are the CLI's); run outside a checkout,
   the section is skipped with a note saying so.
4b. **http** (``--http C``): the graphs cell at C over HTTP (``infer serve``), beside the offline
   figure (:mod:`infer.bench.gpu_http`).
5. **hf**: transformers' own continuous batching (``generate_batch``, a persistent manager) on
   the same prompts: tok/s, and infer (graphs) / transformers.

An exception in one section (or one mode) is recorded in the report and the rest runs. The
report ends with the CUDA targets, each MET / MISS / N/A.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from infer.bench.online import GpuUtilPoller
from infer.bench.report import md_table, num
from infer.runner.gpu.timing import sync as _sync
from infer.runner.gpu.timing import time_ms

LLAMA_1B_DIR = Path.home() / ".cache/infer/bench/llama-1b-shape"
TINY_DIR = Path.home() / ".cache/infer/bench/llama-tiny-gpu-bench"

# Llama 3.2 1B's shape (no llama3 rope scaling: plain rope at theta 500k).
LLAMA_1B_SHAPE: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}
# ``--tiny``: the same code path in seconds on a CPU (a dry run of the whole flow).
TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}

MODES: dict[str, dict[str, Any]] = {
    "graphs": {"attention_backend": "triton", "enforce_eager": False},
    # graphs without async scheduling: each step waits for the one before (what it buys)
    "graphs-sync": {
        "attention_backend": "triton",
        "enforce_eager": False,
        "async_scheduling": False,
    },
    "eager": {"attention_backend": "triton", "enforce_eager": True},
    "torch-eager": {"attention_backend": "torch", "enforce_eager": True},
    # graphs with the skinny Triton matmuls for decode batches of <= 16 rows (triton_gemv.py)
    "graphs-gemv": {"attention_backend": "triton", "enforce_eager": False},
    # graphs for mixed steps too (prompt chunks beside decodes), by token bucket (cuda_step.py)
    "graphs-mixed": {"attention_backend": "triton", "enforce_eager": False},
    # graphs / graphs-mixed with a mixed step's decodes in the prefill kernel's query tiles,
    # not through the decode kernel (cuda_step.py's INFER_MIXED_DECODE_ROWS)
    "graphs-tiles": {"attention_backend": "triton", "enforce_eager": False},
    "graphs-mixed-tiles": {"attention_backend": "triton", "enforce_eager": False},
    # graphs with torch.compile's kernels for the norms and the activation (compiled_ops.py)
    "graphs-compile": {"attention_backend": "triton", "enforce_eager": False},
    # graphs, a request's tokens sent 8 at a time (--stream-interval 8): over HTTP, what the
    # server's work per streamed token costs
    "graphs-stream8": {"attention_backend": "triton", "enforce_eager": False, "stream_interval": 8},
    # graphs, four API server processes over the engine (--api-server-count 4): over HTTP,
    # whether one server process's CPU is the bound (offline: the same as graphs)
    "graphs-api4": {"attention_backend": "triton", "enforce_eager": False},
}
# Modes with server flags of their own (none of the engine's settings).
MODE_SERVER_FLAGS: dict[str, list[str]] = {"graphs-api4": ["--api-server-count", "4"]}
# Modes that are an environment switch over their engine settings (set while the engine starts).
MODE_ENV: dict[str, dict[str, str]] = {
    "graphs-gemv": {"INFER_TRITON_GEMV": "1"},
    "graphs-mixed": {"INFER_MIXED_GRAPHS": "1"},
    "graphs-tiles": {"INFER_MIXED_DECODE_ROWS": "0"},
    "graphs-mixed-tiles": {"INFER_MIXED_GRAPHS": "1", "INFER_MIXED_DECODE_ROWS": "0"},
    "graphs-compile": {"INFER_TRITON_FUSED": "compile"},
}
# Switches that are a setting of their own beside the mode that sets them, with their default:
# outside that mode they keep the shell's value (INFER_TRITON_FUSED=0 exported: every mode
# without the fused kernels) unless it is another mode's.
SWITCH_DEFAULTS: dict[str, str] = {"INFER_TRITON_FUSED": "1", "INFER_MIXED_DECODE_ROWS": "1"}


def mode_environ(mode: str) -> dict[str, str]:
    """The environment switches while ``mode``'s engine runs: its own (MODE_ENV) on, every
    other mode's off, so a switch exported in the shell cannot turn one mode into another."""
    env = {}
    for switches in MODE_ENV.values():
        for key, on in switches.items():
            shell = os.environ.get(key)
            keep = key in SWITCH_DEFAULTS and shell is not None and shell != on
            env[key] = shell if keep else SWITCH_DEFAULTS.get(key, "0")
    return env | MODE_ENV.get(mode, {})


def mode_server_flags(mode: str) -> list[str]:
    """``infer serve`` flags for a mode's engine settings (its environment is MODE_ENV's)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (choices: {', '.join(MODES)})")
    settings = MODES[mode]
    # triton is what the server picks on a GPU by itself (and, left unsaid, a CPU run's server
    # keeps its own kernels)
    flags = []
    if settings["attention_backend"] != "triton":
        flags += ["--attention-backend", settings["attention_backend"]]
    if settings.get("enforce_eager"):
        flags.append("--enforce-eager")
    if settings.get("async_scheduling") is False:
        flags.append("--no-async-scheduling")
    if settings.get("stream_interval", 1) != 1:
        flags += ["--stream-interval", str(settings["stream_interval"])]
    return flags + MODE_SERVER_FLAGS.get(mode, [])


# Defaults of the list options: (full run, --quick). An explicit flag wins over both.
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "concurrency": ("1,16,64,256", "1,64,256"),
    "long": ("1024x128@16", ""),
    "requests_per_c": (2, 1),
    "buckets": ("1,8,32,128,256", "1,32,256"),
    "bucket_steps": (20, 12),
    "hf_prompts": ("1,16,64,256", "64,256"),
    "hf_c1_tokens": (32, 16),
}

# The CUDA targets (H100 figures for the tok/s ones).
TARGET_B1_RATIO = 1.5
TARGET_C256_TOKS = 40_000.0
TARGET_C64_TOKS = 15_000.0
TARGET_VS_HF = 10.0
TARGET_HTTP_RATIO = 0.9
TARGET_ATTN_ROOF = 0.70
TARGET_SPLIT_SPEEDUP = 4.0


class _Interrupted(BaseException):
    """SIGTERM (``timeout``): finish the report with what there is, then stop."""


def kernel_benchmark() -> Any:
    """``benchmarks/gpu_kernels.py`` of the source checkout this package runs from (the kernels
    section: its flags, its run, its table), or None outside a checkout."""
    from infer.bench.cli import checkout_benchmark

    return checkout_benchmark("gpu_kernels")


KERNELS_NEED_CHECKOUT = (
    "the decode attention kernel benchmark needs a source checkout (benchmarks/gpu_kernels.py, "
    "outside the package): run infer bench gpu from one"
)


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the list options left unset from :data:`DEFAULTS` and the kernel benchmark's (full,
    or ``--quick``)."""
    kernels = kernel_benchmark()
    for name, (full, quick) in (DEFAULTS | (kernels.DEFAULTS if kernels else {})).items():
        if getattr(args, name, None) is None:
            setattr(args, name, quick if args.quick else full)
    # An empty list written '' inside GPU_CHECK_BENCH_ARGS (which the script splits into words
    # without parsing quotes) reaches us as the two quote characters: none, as meant.
    for name, value in vars(args).items():
        if isinstance(value, str) and value.strip() in ("''", '""'):
            setattr(args, name, "")
    return args


def profile_cell(cell: str | int) -> tuple[int, bool]:
    """A ``--profile`` entry: ``256`` (pure decode at batch 256) or ``64a`` (batch 64 with an
    arrival before every step) -> (batch, arrivals)."""
    text = str(cell).strip()
    arrivals = text.endswith("a")
    return int(text.removesuffix("a")), arrivals


def ints(text: str | int) -> list[int]:
    """``"1,16,64"`` -> ``[1, 16, 64]`` (empty text: none)."""
    return [int(x) for x in str(text).split(",") if x.strip()]


def parse_loads(text: str) -> list[tuple[int, int, int]]:
    """``"1024x128@16,512x64@4+8"`` -> ``[(1024, 128, 16), (512, 64, 4), (512, 64, 8)]``."""
    loads: list[tuple[int, int, int]] = []
    if text.strip().lower() == "none":  # as the help's "(default | --quick's default)" says
        return loads
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        shape, _, cs = item.partition("@")
        pin, _, pout = shape.partition("x")
        if not (cs and pout):
            raise SystemExit(f"--long {item!r}: write INxOUT@C (e.g. 1024x128@16)")
        loads += [(int(pin), int(pout), int(c)) for c in cs.split("+")]
    return loads


def load_key(prompt_len: int, output_len: int, c: int) -> str:
    return f"{prompt_len}x{output_len}@{c}"


# ---- helpers ------------------------------------------------------------------------------------
def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a missing or broken package is just absent here
        return None


def llama_params(cfg: dict) -> int:
    """Parameters of a Llama with ``cfg`` (a config.json dict): embeddings (once when tied),
    attention, MLP and norms."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    emb = cfg["vocab_size"] * h
    attn = h * heads * d + 2 * h * kv_heads * d + heads * d * h
    mlp = 3 * h * cfg["intermediate_size"]
    total = emb + layers * (attn + mlp + 2 * h) + h
    return total if cfg.get("tie_word_embeddings", False) else total + emb


# ---- 1. model -----------------------------------------------------------------------------------
def build_model(out: Path, shape: dict, device: torch.device) -> dict:
    """Build (or reuse) a random bf16 Llama of ``shape`` with a BPE tokenizer in ``out``."""
    info: dict[str, Any] = {"path": str(out)}
    if (out / "config.json").exists():
        info["reused"] = True
        return info
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from infer.data.train_tokenizer import train_bpe_tokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t = time.perf_counter()
    # The model's vocab is larger than the tokenizer's (the corpus gives the 1B's ~9k tokens, the
    # tiny model's half on purpose): prompts are ids below the tokenizer's size, outputs any id.
    tok = train_bpe_tokenizer(tmp, vocab_size=min(shape["vocab_size"] // 2, 32000))
    info["tokenizer_s"] = time.perf_counter() - t
    shape = dict(shape)
    theta = shape.pop("rope_theta")
    cfg = LlamaConfig(
        **shape,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        initializer_range=0.02,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    t = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    _sync(device)
    info["init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    model.save_pretrained(tmp)
    info["save_s"] = time.perf_counter() - t
    del model
    _free(device)
    tmp.rename(out)
    info["reused"] = False
    return info


def describe_model(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    params = llama_params(cfg)
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    )
    shape = {k: cfg.get(k) for k in keys}
    if not shape["head_dim"]:
        shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    from infer.model.tokenizer import load_tokenizer

    return {
        "params": params,
        "weight_bytes": 2 * params,
        "shape": shape,
        "tokenizer_vocab": len(load_tokenizer(path)),
    }


# ---- 2. roofline --------------------------------------------------------------------------------
def roofline(device: torch.device, read_bytes: int, matmul_n: int, reps: int = 10) -> dict:
    x = torch.ones(read_bytes // 2, dtype=torch.bfloat16, device=device)
    read = time_ms(x.sum, device, reps)
    del x
    _free(device)
    n = matmul_n
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    mm = time_ms(functools.partial(torch.matmul, a, b), device, reps)
    del a, b
    _free(device)
    med = statistics.median(read)
    return {
        "read_bytes": read_bytes,
        "read_ms": med,
        "read_GBps": read_bytes / (med / 1000) / 1e9,
        "read_GBps_best": read_bytes / (min(read) / 1000) / 1e9,
        "matmul_n": n,
        "matmul_TFLOPs": 2 * n**3 / (statistics.median(mm) / 1000) / 1e12,
    }


# ---- 3. engine ----------------------------------------------------------------------------------
def make_engine(model: Path, mode: str, args: argparse.Namespace):
    """The offline engine of ``mode`` (:data:`MODES`) with the run's engine flags."""
    from infer.bench.offline import make_engine as offline_engine
    from infer.bench.offline import patched_environ

    kw: dict[str, Any] = {
        "dtype": "bfloat16",
        "device": args.device,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        **MODES[mode],
    }
    if args.kv_cache_memory:
        kw["kv_cache_memory"] = args.kv_cache_memory
    with patched_environ(mode_environ(mode)):
        return offline_engine(model, **kw)


def runner_info(engine: Any) -> dict[str, str]:
    """What the runner says about its attention backend and CUDA graphs (attribute names that
    mention them), to show which path actually ran."""
    words = ("graph", "backend", "eager", "triton", "attention")
    found = {}
    for obj_name in ("runner", "model"):
        obj = getattr(engine, obj_name, None)
        for k, v in (vars(obj) if obj is not None else {}).items():
            if any(w in k.lower() for w in words) and not isinstance(v, torch.nn.Module):
                found[f"{obj_name}.{k}"] = repr(v)[:120]
    step = getattr(getattr(engine, "runner", None), "cuda_step", None)
    if step is not None:
        found["runner.cuda_step"] = type(step).__name__
        for key, name, unit in (("graphs", "decode graphs", "batch"),
                                ("mixed_graphs", "mixed graphs", "tokens")):  # fmt: skip
            graphs = getattr(step, key, None)
            found[name] = (
                "none (eager)"
                if graphs is None
                else (
                    f"{len(getattr(graphs, 'graphs', {}))} captured for {unit} "
                    f"{getattr(graphs, 'sizes', ['?'])[0]}..{getattr(graphs, 'sizes', ['?'])[-1]}"
                    f" in {getattr(graphs, 'capture_seconds', 0):.1f}s, "
                    f"{getattr(graphs, 'capture_bytes', 0) / 2**20:.0f} MiB"
                )
            )
        if getattr(step, "warm_up_passes", 0):
            found["kernel warm-up"] = (
                f"{step.warm_up_passes} forward passes in {step.warm_up_seconds:.1f}s"
            )
        picks = getattr(step, "gemv_picks", None)
        if picks:
            found["skinny matmuls"] = "; ".join(picks)
    return found


@contextlib.contextmanager
def _decoding(engine: Any, batch: int, steps: int, prompt_len: int, seed: int):
    """``batch`` requests decoding in ``engine`` (prompts prefilled, first replays done): a
    pure decode batch for the body to step; aborted on the way out."""
    from infer.bench.offline import greedy, prompt_vocab, random_prompts

    params = greedy(steps + 64)
    ids = [f"bucket{batch}-{i}" for i in range(batch)]
    prompts = random_prompts(prompt_vocab(engine), batch, prompt_len, seed)
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    try:
        for _ in range(10_000):
            for out in engine.step():
                if out.num_output_tokens >= 1:
                    started.add(out.request_id)
            if len(started) == batch:
                break
        if len(started) != batch:
            raise RuntimeError(f"only {len(started)} of {batch} requests started decoding")
        for _ in range(3):  # the bucket's first replays (or captures)
            engine.step()
        sched = engine.scheduler
        if sched.num_waiting or sched.num_running != batch:
            raise RuntimeError(
                f"not a pure decode batch: {sched.num_running} running, {sched.num_waiting} waiting"
            )
        yield
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()


def decode_step_ms(engine: Any, batch: int, steps: int, prompt_len: int, seed: int) -> dict:
    """Median time of ``engine.step()`` with exactly ``batch`` requests decoding (their prompts
    prefilled first), then the requests are aborted."""
    times, rows = [], []
    device = engine.device
    with _decoding(engine, batch, steps, prompt_len, seed):
        for _ in range(steps):
            _sync(device)
            t = time.perf_counter()
            outs = engine.step()
            _sync(device)
            times.append((time.perf_counter() - t) * 1000)
            rows.append(len(outs))
    return {
        "batch": batch,
        "ms": statistics.median(times),
        "ms_min": min(times),
        "steps": steps,
        "outputs_per_step_min": min(rows),
    }


def arrival_step_ms(engine: Any, batch: int, steps: int, prompt_len: int, seed: int) -> dict:
    """Median time of ``engine.step()`` with ``batch`` requests decoding and one new request
    (``prompt_len`` tokens, one output token) added before every step: the steady state of
    staggered arrivals, as a server sees them, where each step holds a prompt chunk beside the
    decodes (a mixed step). With the step kinds it ran as (replayed, padded, eager).

    An arrival needs a free slot: at ``max_num_seqs`` the batch is one request smaller (the
    result's ``batch`` says so). An arrival still waiting after its step raises: that step
    was not the one meant."""
    device = engine.device
    batch, arrive = _arrivals(engine, batch, steps, prompt_len, seed)
    times = []
    with _decoding(engine, batch, steps, prompt_len, seed):
        kinds_before = _step_kinds(engine)
        for i in range(steps):
            arrive(i)
            _sync(device)
            t = time.perf_counter()
            engine.step()
            _sync(device)
            times.append((time.perf_counter() - t) * 1000)
            if engine.scheduler.num_waiting:
                raise RuntimeError(f"an arrival waited past its step at batch {batch}")
        kinds = _step_kinds_since(engine, kinds_before)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "ms": statistics.median(times),
        "steps": steps,
        "step_kinds": kinds,
    }


def _arrivals(engine: Any, batch: int, steps: int, prompt_len: int, seed: int):
    """``(batch, arrive)`` for ``steps`` steps with an arrival: the batch left a free slot
    below ``max_num_seqs``, and ``arrive(i)`` adds the i-th new request (``prompt_len``
    tokens, one output token)."""
    from infer.bench.offline import greedy, prompt_vocab, random_prompts

    batch = min(batch, engine.scheduler.config.max_num_seqs - 1)
    if batch < 1:
        raise ValueError("a step with an arrival needs max_num_seqs >= 2")
    prompts = random_prompts(prompt_vocab(engine), steps, prompt_len, seed + 1)

    def arrive(i: int) -> None:
        engine.add_request(f"arrival{batch}-{seed}-{i}", prompts[i], greedy(1))

    return batch, arrive


HOST_PARTS = ("schedule", "prepare", "forward", "sample", "update")


def profile_decode(
    engine: Any, batch: int, steps: int, prompt_len: int, seed: int, arrivals: bool = False
) -> dict:
    """Where a pure decode step's time goes at ``batch`` (with ``arrivals``: a step with an
    arrival, as :func:`arrival_step_ms` makes them): ``torch.profiler`` over ``steps``
    steps gives the GPU's busy time per step (the sum of its kernels' durations), its idle
    share of the wall time, kernels per step and the top kernels; the engine's own counters
    split the host's time (schedule, prepare, forward launch, sample incl. the wait for the
    GPU, update + detokenization)."""
    from torch.profiler import ProfilerActivity, profile

    device = engine.device
    arrive = None
    if arrivals:
        batch, arrive = _arrivals(engine, batch, steps, prompt_len, seed)
    with _decoding(engine, batch, steps, prompt_len, seed):
        before = {k: getattr(engine.step_times, k) for k in HOST_PARTS}
        _sync(device)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            t = time.perf_counter()
            for i in range(steps):
                if arrive is not None:
                    arrive(i)
                engine.step()
            _sync(device)
            wall_ms = (time.perf_counter() - t) * 1000 / steps
        host = {k: (getattr(engine.step_times, k) - before[k]) * 1000 / steps for k in HOST_PARTS}
    kernels, host_calls = [], []
    for evt in prof.key_averages():
        dev_us = getattr(evt, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "self_cuda_time_total", 0)
        if str(getattr(evt, "device_type", "")).endswith("CUDA") and dev_us > 0:
            kernels.append((evt.key, evt.count, dev_us))
        elif getattr(evt, "self_cpu_time_total", 0) > 0:
            # the host's own time per op or runtime call (cudaGraphLaunch, an event's wait, a
            # copy): what the host's "forward" and "sample" shares are made of
            host_calls.append((evt.key, evt.count, evt.self_cpu_time_total))
    kernels.sort(key=lambda k: -k[2])
    host_calls.sort(key=lambda k: -k[2])
    busy_ms = sum(k[2] for k in kernels) / 1000 / steps
    return {
        "batch": batch,
        "arrivals": arrivals,
        "steps": steps,
        "wall_ms": wall_ms,
        "gpu_busy_ms": busy_ms,
        "gpu_idle_share": max(0.0, 1 - busy_ms / wall_ms) if wall_ms else None,
        "kernels_per_step": sum(k[1] for k in kernels) / steps,
        "host_ms": host,
        "top_kernels": [
            {"name": name[:90], "per_step": n / steps, "us_per_step": us / steps}
            for name, n, us in kernels[:12]
        ],
        "top_host_calls": [
            {"name": name[:90], "per_step": n / steps, "us_per_step": us / steps}
            for name, n, us in host_calls[:10]
        ],
    }


@contextlib.contextmanager
def _cell(res: dict, table: str, key: str, name: str, log: Callable[[str], None]):
    """The body measures ``res[table][key]``; if it raises, the error goes there instead and is
    counted in ``res["failures"]``, logged as ``name: FAILED ...``: one failed cell must not
    lose the rest."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - recorded, the next cell runs
        res["failures"] += 1
        res.setdefault(table, {})[key] = {"error": f"{type(e).__name__}: {e}"}
        log(f"{name}: FAILED {type(e).__name__}: {e}")


def _step_kinds(engine: Any) -> dict[str, int]:
    """The GPU step's counts of steps by how they ran (none on the torch path)."""
    step = getattr(getattr(engine, "runner", None), "cuda_step", None)
    return dict(getattr(step, "step_kinds", {}))


def _step_kinds_since(engine: Any, before: dict[str, int]) -> dict[str, int]:
    """The steps run since ``before`` (a :func:`_step_kinds`), by kind, kinds with none left out."""
    kinds = {k: v - before.get(k, 0) for k, v in _step_kinds(engine).items()}
    return {k: v for k, v in kinds.items() if v}


def engine_mode(
    model: Path,
    mode: str,
    args: argparse.Namespace,
    loads: list,
    buckets: list,
    log: Callable[[str], None],
    res: dict | None = None,
    profile_buckets: list | None = None,
) -> dict:
    """One mode: build the engine, warm it, run every load and (for bucket modes) the decode
    buckets, filling ``res`` as it goes (a run cut short keeps what it had); the engine is freed
    on the way out. The mode's environment (:func:`mode_environ`) holds throughout: some
    switches are read at start-up, the fused kernels' at every forward pass."""
    from infer.bench.offline import patched_environ, run_load
    from infer.engine.heap import freeze_startup_heap

    with patched_environ(mode_environ(mode)):
        res = {} if res is None else res
        profile_buckets = profile_buckets or []
        res.update(settings=MODES[mode], loads={}, buckets={}, failures=0)
        t = time.perf_counter()
        engine = make_engine(model, mode, args)
        try:
            res["startup_s"] = time.perf_counter() - t
            res["runner_info"] = runner_info(engine)
            res["kv_tokens"] = engine.capacity.num_tokens
            log(f"{mode}: engine up in {res['startup_s']:.1f}s ({res['kv_tokens']} KV tokens)")
            if "skinny matmuls" in res["runner_info"]:
                log(f"{mode}: skinny matmuls: {res['runner_info']['skinny matmuls']}")
            t = time.perf_counter()
            run_load(engine, 4, 4, args.prompt_len, 8, seed=99)
            biggest = max((c for _, _, c in loads), default=1)
            run_load(engine, biggest, biggest, args.prompt_len, 4, seed=98)
            res["warmup_s"] = time.perf_counter() - t
            # As the server's engine process does once built: full collections would walk the
            # start-up heap every so often, a stall of milliseconds in the middle of a step.
            freeze_startup_heap()
            with GpuUtilPoller() as gpu_util:  # (nvidia-smi: none on a CPU)
                for pin, pout, c in loads:
                    key = load_key(pin, pout, c)
                    n = max(args.requests_per_c * c, 2 if c == 1 else c)
                    with _cell(res, "loads", key, f"{mode} {key}", log):
                        kinds_before = _step_kinds(engine)
                        start = time.perf_counter()
                        res["loads"][key] = row = run_load(engine, c, n, pin, pout, seed=args.seed)
                        row.update(gpu_util.report(start, time.perf_counter(), log))
                        row["step_kinds"] = _step_kinds_since(engine, kinds_before)
                        busy = row["gpu_busy_pct"]
                        log(
                            f"{mode} {key}: {row['output_tok_s']:,.0f} tok/s, ITL p50 "
                            f"{row['itl_ms']['p50']:.2f} ms, TTFT p50 "
                            f"{row['ttft_ms']['p50']:.0f} ms ({row['wall_s']:.1f}s)"
                            + (f"; GPU busy {busy:.0f}%" if busy is not None else "")
                            + "".join(f"; {v} {k}" for k, v in row["step_kinds"].items())
                        )
            for b in buckets:
                with _cell(res, "buckets", str(b), f"{mode} bucket {b}", log):
                    res["buckets"][str(b)] = r = decode_step_ms(
                        engine, b, args.bucket_steps, args.prompt_len, seed=1000 + b
                    )
                    log(f"{mode} decode step at batch {b}: {r['ms']:.3f} ms")
                with _cell(res, "arrivals", str(b), f"{mode} arrivals at batch {b}", log):
                    res.setdefault("arrivals", {})[str(b)] = r = arrival_step_ms(
                        engine, b, args.bucket_steps, args.prompt_len, seed=3000 + b
                    )
                    log(f"{mode} step with an arrival at batch {b}: {r['ms']:.3f} ms; "
                        + ", ".join(f"{v} {k}" for k, v in r["step_kinds"].items()))  # fmt: skip
            for cell in profile_buckets:
                with _cell(res, "profile", str(cell), f"{mode} profile {cell}", log):
                    b, arrivals = profile_cell(cell)
                    res.setdefault("profile", {})[str(cell)] = r = profile_decode(
                        engine, b, args.profile_steps, args.prompt_len, seed=2000 + b,
                        arrivals=arrivals,
                    )  # fmt: skip
                    log(
                        f"{mode} profile at {cell}: {r['wall_ms']:.3f} ms/step, GPU busy "
                        f"{r['gpu_busy_ms']:.3f} ms ({r['kernels_per_step']:.0f} kernels), host "
                        + " ".join(f"{k} {v:.2f}" for k, v in r["host_ms"].items())
                    )
        finally:
            gc.unfreeze()
            engine.close()
            del engine
            _free(torch.device(args.device))
        return res


# ---- 5. transformers ----------------------------------------------------------------------------
def hf_bench(
    model: Path,
    vocab: int,
    args: argparse.Namespace,
    log: Callable[[str], None],
    res: dict | None = None,
) -> dict:
    """transformers' continuous batching (``generate_batch``) on the engine's prompts, with a
    persistent manager sized for the largest count, warmed up once; fills ``res``."""
    res = {} if res is None else res
    import inspect

    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    from infer.bench.offline import random_prompts

    device = torch.device(args.device)
    counts = ints(args.hf_prompts)
    t = time.perf_counter()
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.bfloat16, attn_implementation="sdpa", device_map=str(device)
        )
    except Exception:  # noqa: BLE001 - older versions / no accelerate: load, then move
        hf = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).to(device)
    hf.eval()
    res.update(version=transformers.__version__, load_s=time.perf_counter() - t)
    sig = inspect.signature(hf.generate_batch).parameters
    kw: dict[str, Any] = {}
    if "persistent_manager" in sig:
        kw["persistent_manager"] = True
    if "continuous_batching_config" in sig:
        try:
            from transformers import ContinuousBatchingConfig
        except ImportError:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        fields = inspect.signature(ContinuousBatchingConfig).parameters
        opts = {"max_requests_per_batch": max(counts)}
        kw["continuous_batching_config"] = ContinuousBatchingConfig(
            **{k: v for k, v in opts.items() if k in fields}
        )
    res["options"] = {k: repr(v)[:200] for k, v in kw.items()}
    # Its warnings (the persistent manager's, once a call) would fill the console's tail.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    def gen_config(n_new: int) -> GenerationConfig:
        # eos None: transformers disables it (-1), so every request runs to max_new_tokens.
        return GenerationConfig(
            max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0
        )

    prompts = random_prompts(vocab, max(counts), args.prompt_len, args.seed)
    t = time.perf_counter()
    hf.generate_batch(inputs=prompts[: max(counts)], generation_config=gen_config(4), **kw)
    res["warmup_s"] = time.perf_counter() - t
    res["attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
    res["rows"] = {}
    try:
        for n in counts:
            n_new = args.hf_c1_tokens if n == 1 else args.output_len
            _sync(device)
            t = time.perf_counter()
            outs = hf.generate_batch(inputs=prompts[:n], generation_config=gen_config(n_new), **kw)
            _sync(device)
            wall = time.perf_counter() - t
            tokens = sum(len(o.generated_tokens) for o in outs.values())
            errors = [o.error for o in outs.values() if getattr(o, "error", None)]
            res["rows"][str(n)] = row = {
                "prompts": n,
                "max_new_tokens": n_new,
                "tokens": tokens,
                "wall_s": wall,
                "tok_s": tokens / wall,
                "errors": errors[:3],
            }
            log(
                f"transformers generate_batch {n} prompts x {n_new}: {row['tok_s']:,.0f} tok/s "
                f"({tokens} tokens in {wall:.1f}s)"
            )
    finally:
        destroy = getattr(hf, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            with contextlib.suppress(Exception):
                destroy()
        del hf
        _free(device)
    return res


# ---- targets and the report ---------------------------------------------------------------------
def _get(d: Any, *keys: Any) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _status(ok: bool | None) -> str:
    return "N/A" if ok is None else ("MET" if ok else "MISS")


def http_medians(report: dict) -> None:
    """With ``--http-repeats``: each mode's runs' output tok/s, their median and its ratio to
    the offline figure, written into the mode's first run (the dict the targets and the report
    read)."""
    by_mode: dict[str, list[dict]] = {}
    for res in report.get("http_runs") or []:
        by_mode.setdefault(res.get("mode", "graphs"), []).append(res)
    for runs in by_mode.values():
        first, done = runs[0], [r for r in runs if "output_tok_s" in r]
        if not done:
            continue
        offline = next((r["offline_tok_s"] for r in done if r.get("offline_tok_s")), None)
        first["runs_tok_s"] = [r["output_tok_s"] for r in done]
        first["runs_failed"] = len(runs) - len(done)
        first["median_tok_s"] = statistics.median(first["runs_tok_s"])
        first["median_ratio"] = first["median_tok_s"] / offline if offline else None
        first.setdefault("offline_tok_s", offline)


def targets(report: dict) -> list[dict]:
    """The CUDA targets with the measured value and MET / MISS (N/A: not measured)."""
    p, o = report.get("prompt_len", 128), report.get("output_len", 128)
    graphs = _get(report, "engine", "graphs") or {}
    limit = _get(report, "roofline", "weight_read_ms")
    rows: list[dict] = []

    def add(target: str, measured: str | None, ok: bool | None) -> None:
        rows.append({"target": target, "measured": measured, "status": _status(ok)})

    itl1 = _get(graphs, "loads", load_key(p, o, 1), "itl_ms", "p50")
    ratio = itl1 / limit if itl1 and limit else None
    add(
        f"batch-1 decode step <= {TARGET_B1_RATIO}x weight-read limit (graphs, C=1 ITL p50)",
        ratio and f"{itl1:.3f} ms = {ratio:.2f}x {limit:.3f} ms",
        None if ratio is None else ratio <= TARGET_B1_RATIO,
    )
    for c, want in ((256, TARGET_C256_TOKS), (64, TARGET_C64_TOKS)):
        toks = _get(graphs, "loads", load_key(p, o, c), "output_tok_s")
        add(
            f"C={c} {p}/{o} >= {want:,.0f} tok/s (graphs; an H100 figure)",
            toks and f"{toks:,.0f} tok/s",
            None if toks is None else toks >= want,
        )

    g_b = _get(graphs, "buckets") or {}
    e_b = _get(report, "engine", "eager", "buckets") or {}
    pairs = sorted(
        (int(b), g["ms"], e_b[b]["ms"])
        for b, g in g_b.items()
        if "ms" in g and "ms" in (e_b.get(b) or {})
    )
    worst = max(pairs, key=lambda x: x[1] / x[2]) if pairs else None
    add(
        "graphs faster than eager at every decode bucket",
        worst
        and f"{len(pairs)} buckets; worst graphs/eager {worst[1] / worst[2]:.2f} at "
        f"batch {worst[0]}",
        None if worst is None else all(g < e for _, g, e in pairs),
    )

    for n in (64, 256):
        ours = _get(graphs, "loads", load_key(p, o, n), "output_tok_s")
        theirs = _get(report, "hf", "rows", str(n), "tok_s")
        r = ours / theirs if ours and theirs else None
        add(
            f">= {TARGET_VS_HF:.0f}x transformers generate_batch at {n} (tok/s)",
            r and f"{ours:,.0f} / {theirs:,.0f} = {r:.1f}x",
            None if r is None else r >= TARGET_VS_HF,
        )

    cells = [
        row
        for row in _get(report, "kernels", "rows") or []
        if "pct_of_read" in row and 16 <= row["batch"] <= 256 and 512 <= row["context"] <= 8192
    ]
    low = min(cells, key=lambda x: x["pct_of_read"]) if cells else None
    add(
        f"decode attention >= {100 * TARGET_ATTN_ROOF:.0f}% of the read rate (batch 16-256, "
        "context 512-8192)",
        low
        and f"{len(cells)} cells; lowest {100 * low['pct_of_read']:.0f}% at "
        f"{low['batch']}x{low['context']}",
        None if low is None else low["pct_of_read"] >= TARGET_ATTN_ROOF,
    )

    http = report.get("http") or {}
    ratio = http.get("median_ratio") or http.get("ratio")
    runs = http.get("runs_tok_s") or []
    of = (
        f"{len(runs)} of {len(runs) + http['runs_failed']}"
        if http.get("runs_failed")
        else len(runs)
    )
    figure = (f"median of {of} runs {http['median_tok_s']:,.0f}" if http.get("median_ratio")
              else f"{http.get('output_tok_s', 0):,.0f}")  # fmt: skip
    add(
        f"HTTP (infer serve) within 10% of the offline engine at C={http.get('concurrency', 64)}"
        " (tok/s)",
        ratio and f"{figure} / {http['offline_tok_s']:,.0f} = {ratio:.2f}x",
        None if ratio is None else ratio >= TARGET_HTTP_RATIO,
    )

    split = _get(report, "kernels", "split") or {}
    sp = split.get("speedup")
    add(
        f"batch 1 at {split.get('context', 8192)}: split-K >= {TARGET_SPLIT_SPEEDUP:.0f}x "
        "one split",
        sp and f"{sp:.2f}x (best: {split['best_split']} splits)",
        None if sp is None else sp >= TARGET_SPLIT_SPEEDUP,
    )
    return rows


def _f(x: Any, fmt: str = ".2f", none: str = "-") -> str:
    return num(x, fmt, none)


def _ratio(a: float | None, b: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return format(a / b, fmt) + suffix if a and b else "-"


def _last_line(text: str | None, width: int = 160) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1][:width] if lines else ""


def _engine_markdown(eng: dict, roof: dict, p: int, o: int) -> list[str]:
    """The offline engine's tables: loads per mode, start-up per mode, decode buckets."""
    base = _get(eng, "torch-eager", "loads") or {}
    rows: list[list[Any]] = []
    for mode, res in eng.items():
        if "error" in res and not res.get("loads"):
            rows.append([mode, "-", f"failed: {_last_line(res['error'], 120)}", *[""] * 6])
        for key, row in res.get("loads", {}).items():
            if "error" in row:
                rows.append([mode, key, f"failed: {row['error'][:120]}", *[""] * 6])
                continue
            tok_s = row["output_tok_s"]
            kinds = ", ".join(f"{v} {k}" for k, v in (row.get("step_kinds") or {}).items())
            rows.append([mode, key, f"{tok_s:,.0f}",
                         _ratio(tok_s, _get(base, key, "output_tok_s"), suffix="x"),
                         f"{row['itl_ms']['p50']:.2f}", f"{row['ttft_ms']['p50']:.0f}",
                         f"{row['mean_step_ms']:.2f}", _f(row.get("gpu_busy_pct"), ".0f"),
                         kinds or "-"])  # fmt: skip
    lines = ["", "## Offline engine, closed loop (C in flight, greedy, ignore_eos)", ""]
    lines += md_table("mode | PxO@C | output tok/s | vs torch-eager | ITL p50 ms | TTFT p50 ms "
                      "| mean step ms | GPU busy % | steps (GPU step: replayed / padded / eager)",
                      rows, "llrrrrrrl")  # fmt: skip
    if any(_get(res, "loads", k, "gpu_busy_pct") is not None
           for res in eng.values() for k in res.get("loads") or {}):  # fmt: skip
        lines += ["", "GPU busy: nvidia-smi's utilization (the share of time a kernel ran), "
                  "sampled every 0.1 s over the load; well under 100 with the host's work "
                  "overlapping the GPU's means the host sets the pace."]  # fmt: skip
    rows = []
    lim = roof.get("weight_read_ms")
    for mode, res in eng.items():
        itl = _get(res, "loads", load_key(p, o, 1), "itl_ms", "p50")
        ratio = f"{itl:.3f} / {lim:.3f} ms = {itl / lim:.2f}x" if itl and lim else "-"
        info = "; ".join(f"{k}={v}" for k, v in (res.get("runner_info") or {}).items())
        rows.append([mode, _f(res.get("startup_s"), ".1f"), _f(res.get("warmup_s"), ".1f"),
                     ratio, info[:300]])  # fmt: skip
    lines += [""] + md_table("mode | engine start s | warm-up s | C=1 ITL p50 / weight-read limit "
                             "| runner", rows, "lrrr")  # fmt: skip
    modes = [mo for mo, res in eng.items() if res.get("buckets")]
    if modes:
        rows = []
        for b in sorted({int(b) for mo in modes for b in eng[mo]["buckets"]}):
            got = [eng[mo]["buckets"].get(str(b), {}) for mo in modes]
            cells = [_f(g.get("ms"), ".3f", "failed" if "error" in g else "-") for g in got]
            g, e = (_get(eng, mo, "buckets", str(b), "ms") for mo in ("graphs", "eager"))
            rows.append([b, *cells, _ratio(g, e)])
        lines += ["", "## Decode step per batch size (pure decode, `engine.step()`, median ms)"]
        lines += [""] + md_table(["batch", *modes, "graphs / eager"], rows, "r" * 9)
    return lines + arrivals_markdown(eng, p) + profile_markdown(eng)


def arrivals_markdown(eng: dict, prompt_len: int) -> list[str]:
    """The steps with an arrival beside each bucket's pure decode step, per mode."""
    rows = []
    for mode, res in eng.items():
        for b, r in (res.get("arrivals") or {}).items():
            if "error" in r:
                rows.append([mode, b, f"failed: {r['error'][:100]}", "", "", ""])
                continue
            decode = _get(res, "buckets", b, "ms")
            kinds = ", ".join(f"{v} {k}" for k, v in r["step_kinds"].items())
            if r["batch"] != int(b):  # a slot kept free for the arrivals
                b = f"{b} ({r['batch']} decoding)"
            rows.append([mode, b, f"{r['ms']:.3f}", _f(decode, ".3f"), _ratio(r["ms"], decode),
                         kinds or "-"])  # fmt: skip
    if not rows:
        return []
    return [
        "",
        f"## A step with an arrival (B decoding + one new {prompt_len}-token prompt a step, "
        "median ms)",
        "",
        *md_table(
            "mode | batch | with an arrival | pure decode | ratio | steps ran as", rows, "lrrrrl"
        ),  # fmt: skip
    ]


def _http_runs_markdown(r: dict) -> list[str]:
    """``--http-repeats``: every run's tok/s, mode by mode, beside the median."""
    firsts = [h for h in (r.get("http_modes") or {}).values() or [r.get("http") or {}]
              if h.get("runs_tok_s")]  # fmt: skip
    if not r.get("http_runs") or not firsts:
        return []
    rows = [[h.get("mode", "graphs"), ", ".join(f"{t:,.0f}" for t in h["runs_tok_s"]),
             _f(h.get("median_tok_s"), ",.0f"), _f(h.get("median_ratio"))]
            for h in firsts]  # fmt: skip
    return ["", "## Over HTTP: the modes in alternation", "",
            f"{len(r['http_runs'])} server runs, the modes taking turns (`--http-repeats`); "
            "each mode's figure is its median.", ""] + md_table(
        "mode | runs, output tok/s | median tok/s | median / offline", rows, "lrrr")  # fmt: skip


def _http_markdown(http: dict) -> list[str]:
    mode = f" ({http['mode']})" if http.get("mode") else ""
    lines = ["", f"## Over HTTP: `infer serve` at {http.get('load', '-')}{mode}", ""]
    if "output_tok_s" not in http:
        return lines + ["Did not run to the end: see the sections table."]
    lines.append(
        f"The offline {http.get('offline_mode', 'graphs')} cell's prompts and engine settings "
        f"({http.get('mode', 'graphs')}'s over HTTP), streamed completions "
        "(token-id prompts, usage counted), C in flight; server up in "
        f"{_f(http.get('server_start_s'), '.1f')} s."
    )
    rows = [
        ["http", _f(http["output_tok_s"], ",.0f"), _f(http.get("ttft_ms_p50"), ".0f"),
         _f(http.get("itl_ms_p50"))],
        ["offline", _f(http.get("offline_tok_s"), ",.0f"), "", ""],
        ["http / offline", _f(http.get("ratio")), "", ""],
    ]  # fmt: skip
    lines += [""] + md_table(" | output tok/s | TTFT p50 ms | ITL p50 ms", rows, "lrrr")
    kinds = ", ".join(f"{v} {k}" for k, v in (http.get("step_kinds") or {}).items())
    lines += ["", f"{http.get('client_processes', 1)} client processes; "
              f"{_f(http.get('tokens_per_event'))} tokens per streamed event; server flags "
              f"`{http.get('server_args') or '(defaults)'}`; the server's steps (warm-up "
              f"included): {kinds or '-'}."]  # fmt: skip
    cores = http.get("cpu_cores") or {}
    if cores:
        busy = ", ".join(f"{name.replace('_', ' ')} {_f(cores.get(name))}"
                         for name in ("api_server", "engine", "clients"))  # fmt: skip
        if cores.get("api_servers"):
            busy = busy.replace("api server", f"api servers ({cores['api_servers']}, summed)")
        lines += ["", f"Cores kept busy while the load ran (CPU seconds / wall): {busy}."]
    if http.get("gpu_busy_pct") is not None:
        lines += ["", f"The GPU ran kernels {http['gpu_busy_pct']:.0f}% of the load "
                  f"(nvidia-smi's utilization, {http.get('gpu_busy_samples', '-')} reads "
                  "0.1 s apart)."]  # fmt: skip
    view = http.get("server_view") or {}
    if view.get("samples"):
        lines += ["", f"The load as the server saw it (its /metrics, {view['samples']} reads): "
                  f"{_f(view.get('running_mean'), '.1f')} requests running and "
                  f"{_f(view.get('waiting_mean'), '.1f')} waiting on average, of "
                  f"{http.get('concurrency', '-')} the clients keep in flight; mean time to first "
                  f"token {_f(view.get('server_ttft_ms_mean'), '.1f')} ms at the server (queued "
                  f"{_f(view.get('server_queue_ms_mean'), '.1f')} ms) against "
                  f"{_f(view.get('client_ttft_ms_mean'), '.1f')} ms at the clients; a request "
                  f"{_f(view.get('server_e2e_ms_mean'), '.0f')} ms against "
                  f"{_f(view.get('client_e2e_ms_mean'), '.0f')} ms."]  # fmt: skip
    for name, prof in (http.get("profile") or {}).items():
        if not isinstance(prof, dict) or not prof.get("samples"):
            lines += ["", f"py-spy, {name}: {(prof or {}).get('error', 'no samples')}"]
            continue
        lines += ["", f"py-spy, {name} ({prof['samples']} samples): share of samples", ""]
        pairs = zip(prof["self"][:12], prof["inclusive"][:12], strict=False)
        table = [[f"{100 * a:.1f}% {fa}", f"{100 * b:.1f}% {fb}"] for (a, fa), (b, fb) in pairs]
        lines += md_table("self | inclusive", table, "ll")
    return lines


def _hf_markdown(r: dict, hf: dict, p: int, o: int) -> list[str]:
    graphs = _get(r, "engine", "graphs", "loads") or {}
    rows = []
    for n, row in hf["rows"].items():
        ours = _get(graphs, load_key(p, o, int(n)), "output_tok_s")
        rows.append([n, row["max_new_tokens"], row["tokens"], f"{row['wall_s']:.1f}",
                     f"{row['tok_s']:,.0f}", _f(ours, ",.0f"), _ratio(ours, row["tok_s"], ".1f")])  # fmt: skip
    lines = [
        "",
        f"## transformers {hf.get('version')} `generate_batch` (persistent manager)",
        "",
        f"The same {p}-token prompts, greedy, attention `{hf.get('attn_implementation')}`, "
        f"options {hf.get('options')}. infer's cells keep C in flight over "
        f"{r.get('requests_per_c', 2)}xC requests.",
        "",
    ]
    return lines + md_table("prompts | new tokens | tokens | s | tok/s | infer graphs tok/s "
                            "| infer / transformers", rows, "r" * 7)  # fmt: skip


def render_markdown(r: dict) -> str:
    """``gpu.md`` of a report (the JSON of :func:`run`)."""
    m, model, roof = r.get("machine", {}), r.get("model", {}), r.get("roofline", {})
    eng, kern, hf = r.get("engine", {}), r.get("kernels", {}), r.get("hf", {})
    p, o = r.get("prompt_len", 128), r.get("output_len", 128)
    built = "reused" if model.get("reused") else f"built in {_f(model.get('build_s'), '.1f')} s"
    lines = [
        "# infer on one GPU: `infer bench gpu`",
        "",
        f"Device: **{m.get('device', '?')}**; torch {m.get('torch')} (CUDA {m.get('cuda')}), "
        f"triton {m.get('triton')}, transformers {m.get('transformers')}, python "
        f"{m.get('python')}. Total {_f(r.get('total_s'), '.0f')} s.",
        "",
        f"Model: `{model.get('path', '?')}`: {model.get('params', 0) / 1e9:.3f}B parameters, "
        f"{model.get('weight_bytes', 0) / 1e9:.2f} GB in bf16 ({built}); tokenizer vocab "
        f"{model.get('tokenizer_vocab', '?')}.",
        "",
        "## Sections",
        "",
    ]
    rows = [[name, s["status"], f"{s['seconds']:.1f}", _last_line(s.get("error") or s.get("note"))]
            for name, s in r.get("sections", {}).items()]  # fmt: skip
    lines += md_table("section | status | seconds | note", rows, "llr")
    if roof:
        lines += [
            "",
            "## Roofline (same run)",
            "",
            f"- HBM read: {_f(roof.get('read_GBps'), ',.0f')} GB/s (median; best "
            f"{_f(roof.get('read_GBps_best'), ',.0f')}), a sum over "
            f"{roof.get('read_bytes', 0) / 2**30:.1f} GiB of bf16",
            f"- bf16 matmul {roof.get('matmul_n')}^3: {_f(roof.get('matmul_TFLOPs'), '.0f')} "
            "TFLOP/s",
            f"- weight-read limit of one decode step (weight bytes / read rate): "
            f"{_f(roof.get('weight_read_ms'), '.3f')} ms",
        ]
    lines += _engine_markdown(eng, roof, p, o) if eng else []
    for http in (r.get("http_modes") or {}).values() or ([r["http"]] if r.get("http") else []):
        lines += _http_markdown(http)
    lines += _http_runs_markdown(r)
    if kern and (kernels := kernel_benchmark()) is not None:
        lines += kernels.markdown(kern)
    elif kern:
        note = kern.get("skipped") or KERNELS_NEED_CHECKOUT
        lines += ["", "## Decode attention kernel", "", f"Skipped: {note}"]
    if hf.get("rows"):
        lines += _hf_markdown(r, hf, p, o)
    elif "error" in hf:
        lines += ["", f"transformers generate_batch failed: {_last_line(hf['error'])}"]
    rows = [[t["target"], t["measured"] or "-", f"**{t['status']}**"]
            for t in r.get("targets") or targets(r)]  # fmt: skip
    return (
        "\n".join([*lines, "", "## Targets", "", *md_table("target | measured | status", rows)])
        + "\n"
    )


def profile_markdown(eng: dict) -> list[str]:
    """The ``--profile`` tables: per mode and batch, the step's wall time against the GPU's
    busy time, the host's split, and the top kernels."""
    lines: list[str] = []
    for mode, res in eng.items():
        for b, p in (res.get("profile") or {}).items():
            if "error" in p:
                lines += ["", f"## Profile: {mode}, batch {b}: failed: {p['error'][:200]}"]
                continue
            lines += [
                "",
                f"## Profile: {mode}, "
                + ("a step with an arrival" if p.get("arrivals") else "decode")
                + f" at batch {p['batch']} (torch.profiler, {p['steps']} steps)",
                "",
                f"- wall {p['wall_ms']:.3f} ms/step; GPU busy {p['gpu_busy_ms']:.3f} ms "
                f"(idle {100 * (p['gpu_idle_share'] or 0):.0f}%); "
                f"{p['kernels_per_step']:.0f} kernels per step",
                "- host ms/step: " + ", ".join(f"{k} {v:.3f}" for k, v in p["host_ms"].items()),
                "",
            ]
            rows = [[k["name"], f"{k['per_step']:.1f}", f"{k['us_per_step']:.1f}"]
                    for k in p["top_kernels"]]  # fmt: skip
            lines += md_table("kernel | calls/step | us/step", rows, "lrr")
            rows = [[k["name"], f"{k['per_step']:.1f}", f"{k['us_per_step']:.1f}"]
                    for k in p.get("top_host_calls") or []]  # fmt: skip
            if rows:
                lines += ["", "Host side (the profiler's CPU events, self time):", ""]
                lines += md_table("op or runtime call | calls/step | host us/step", rows, "lrr")
    return lines


def summary(r: dict) -> str:
    """A compact tail for the console (the device tool shows the last 12,000 characters)."""
    m, roof = r.get("machine", {}), r.get("roofline", {})
    lines = [
        "",
        "=" * 30 + " infer bench gpu: summary " + "=" * 30,
        f"{m.get('device')} | torch {m.get('torch')} triton {m.get('triton')} transformers "
        f"{m.get('transformers')} | total {_f(r.get('total_s'), '.0f')} s",
    ]
    if roof:
        lines.append(
            f"read {_f(roof.get('read_GBps'), ',.0f')} GB/s, bf16 matmul "
            f"{_f(roof.get('matmul_TFLOPs'), '.0f')} TFLOP/s, weight-read limit "
            f"{_f(roof.get('weight_read_ms'), '.3f')} ms"
        )
    for name, s in r.get("sections", {}).items():
        note = _last_line(s.get("error") or s.get("note"), 200)
        lines.append(
            f"  {name}: {s['status']} in {s['seconds']:.1f}s" + (f" -- {note}" if note else "")
        )
    for mode, res in r.get("engine", {}).items():
        cells = [
            f"{k} {v['output_tok_s']:,.0f}"
            for k, v in res.get("loads", {}).items()
            if "output_tok_s" in v
        ]
        buckets = [f"{b}:{v['ms']:.2f}" for b, v in res.get("buckets", {}).items() if "ms" in v]
        if "error" in res and not cells:
            lines.append(f"  {mode}: failed -- {_last_line(res['error'], 200)}")
            continue
        line = f"  {mode}: tok/s " + ", ".join(cells)
        lines.append(line + (f" | step ms at batch {' '.join(buckets)}" if buckets else ""))
        for b, p in (res.get("profile") or {}).items():
            if "wall_ms" in p:
                top = "; ".join(
                    f"{k['name'][:40]} {k['us_per_step']:.0f}us" for k in p["top_kernels"][:4]
                )
                lines.append(
                    f"    profile b={b}: wall {p['wall_ms']:.2f} ms, GPU busy "
                    f"{p['gpu_busy_ms']:.2f} ms, {p['kernels_per_step']:.0f} kernels; host "
                    + " ".join(f"{k} {v:.2f}" for k, v in p["host_ms"].items())
                    + f" | top: {top}"
                )
    for http in (r.get("http_modes") or {}).values() or [r.get("http") or {}]:
        if "output_tok_s" in http:
            lines.append(
                f"  http {http['load']}{' ' + http['mode'] if http.get('mode') else ''}: "
                f"{http['output_tok_s']:,.0f} tok/s"
                + (f" = {http['ratio']:.2f}x offline" if http.get("ratio") else "")
                + (
                    f"; median of {len(http['runs_tok_s'])} runs {http['median_tok_s']:,.0f}"
                    if http.get("runs_tok_s")
                    else ""
                )  # fmt: skip
            )
    for n, row in (_get(r, "hf", "rows") or {}).items():
        lines.append(f"  transformers generate_batch {n} prompts: {row['tok_s']:,.0f} tok/s")
    lines.append("targets:")
    for t in r.get("targets") or []:
        lines.append(f"  [{t['status']:4}] {t['target']}: {t['measured'] or '-'}")
    return "\n".join(lines)


# ---- the run ------------------------------------------------------------------------------------
class _Sections:
    """Runs each section, times it, records errors, and rewrites the report after each."""

    def __init__(self, report: dict, out: Path) -> None:
        self.report, self.out = report, out

    def write(self) -> None:
        http_medians(self.report)  # (also of the runs so far, when a limit cuts the repeats)
        self.report["targets"] = targets(self.report)
        (self.out / "gpu.json").write_text(json.dumps(self.report, indent=2, default=str))
        (self.out / "gpu.md").write_text(render_markdown(self.report))

    def run(self, name: str, fn: Callable[[], Any], device: torch.device) -> Any:
        print(f"== {name} ...", flush=True)
        t = time.perf_counter()
        entry: dict[str, Any] = {"status": "ok"}
        result = None
        try:
            result = fn()
            if isinstance(result, dict) and "skipped" in result:
                entry.update(status="skipped", note=result["skipped"])
            elif isinstance(result, dict) and result.get("failures"):
                entry.update(status="partial", note=f"{result['failures']} cell(s) failed")
        except _Interrupted:
            entry.update(status="interrupted", error="stopped by SIGTERM (timeout)")
            raise
        except Exception as e:  # noqa: BLE001 - the other sections still run
            entry.update(status="error", error=traceback.format_exc()[-2000:])
            print(f"!! {name} failed: {type(e).__name__}: {e}", flush=True)
        finally:
            entry["seconds"] = time.perf_counter() - t
            self.report["sections"][name] = entry
            _free(device)
            self.write()
            print(f"== {name}: {entry['status']} in {entry['seconds']:.1f}s", flush=True)
        return result


def _log(msg: str) -> None:
    print(f"   {msg}", flush=True)


def run(args: argparse.Namespace) -> int:
    """``infer bench gpu``: every section in turn; writes ``gpu.json`` and ``gpu.md``.

    Exit status: 0 when every section ran, 1 when one failed (or a cell of one), 2 without
    CUDA, 3 when stopped by SIGTERM (the report then holds what was measured)."""
    args = resolve_args(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "infer bench gpu needs a CUDA GPU, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}). Run it on a GPU machine (scripts/gpu_check.sh).",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "machine": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": _version("triton"),
            "transformers": _version("transformers"),
            "python": platform.python_version(),
            "host": platform.node(),
        },
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "requests_per_c": args.requests_per_c,
        "sections": {},
    }
    sections = _Sections(report, out)

    def on_term(signum: int, frame: Any) -> None:
        raise _Interrupted()

    previous = signal.signal(signal.SIGTERM, on_term)
    interrupted = False
    try:
        _run_sections(args, device, report, sections)
    except _Interrupted:
        interrupted = True
        print("!! stopped by SIGTERM: the report holds what was measured", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        report["total_s"] = time.perf_counter() - t_start
        sections.write()
        print(summary(report), flush=True)
        print(f"report: {out / 'gpu.md'} and {out / 'gpu.json'}", flush=True)
    if interrupted:
        return 3
    failed = any(s["status"] in ("error", "partial") for s in report["sections"].values())
    return 1 if failed or any("error" in res for res in report.get("engine", {}).values()) else 0


def _run_sections(
    args: argparse.Namespace, device: torch.device, report: dict, sections: _Sections
) -> None:
    out_dir = sections.out
    if args.model:
        model_dir = Path(args.model)
    elif args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        model_dir = TINY_DIR if args.tiny else LLAMA_1B_DIR
    shape = TINY_SHAPE if args.tiny else LLAMA_1B_SHAPE

    def model_section() -> dict:
        t = time.perf_counter()
        info = {"path": str(model_dir), "reused": True}
        if not args.model:
            info = build_model(model_dir, shape, device)
        info["build_s"] = time.perf_counter() - t
        info.update(describe_model(model_dir))
        report["model"] = info
        _log(
            f"{info['params'] / 1e9:.3f}B parameters, {info['weight_bytes'] / 1e9:.2f} GB, "
            f"{'reused' if info['reused'] else 'built'} in {info['build_s']:.1f}s"
        )
        return info

    model = sections.run("model", model_section, device)
    if model is None:
        return  # nothing else can run without it

    if not args.skip_roofline:

        def roof_section() -> dict:
            gib = (
                args.read_gib
                if args.read_gib is not None
                else (4.0 if device.type == "cuda" else 0.25)
            )
            n = args.matmul_n or (8192 if device.type == "cuda" else 1024)
            roof = roofline(device, int(gib * 2**30), n)
            roof["weight_read_ms"] = model["weight_bytes"] / (roof["read_GBps"] * 1e9) * 1000
            report["roofline"] = roof
            _log(
                f"read {roof['read_GBps']:,.0f} GB/s, bf16 matmul {roof['matmul_TFLOPs']:.0f} "
                f"TFLOP/s, weight-read limit {roof['weight_read_ms']:.3f} ms"
            )
            return roof

        sections.run("roofline", roof_section, device)

    if not args.skip_engine:
        loads = [(args.prompt_len, args.output_len, c) for c in ints(args.concurrency)]
        loads += parse_loads(args.long)
        bucket_modes = set() if args.skip_buckets else set(args.bucket_modes.split(","))
        report["engine"] = {}
        for mode in [m for m in args.modes.split(",") if m]:
            if mode not in MODES:
                report["engine"][mode] = {"error": f"unknown mode (choices: {', '.join(MODES)})"}
                continue
            buckets = ints(args.buckets) if mode in bucket_modes else []
            profiled = (
                [c.strip() for c in args.profile.split(",") if c.strip()]
                if args.profile and mode == args.profile_mode
                else []
            )

            def mode_section(
                mode: str = mode, buckets: list = buckets, profiled: list = profiled
            ) -> dict:
                res = report["engine"][mode] = {}
                try:
                    return engine_mode(model_dir, mode, args, loads, buckets, _log, res, profiled)
                except Exception:
                    res["error"] = traceback.format_exc()[-2000:]
                    raise

            sections.run(f"engine {mode}", mode_section, device)

    if args.http and not args.skip_engine:
        http_modes = list(dict.fromkeys(m for m in args.http_modes.split(",") if m))
        repeats = max(1, getattr(args, "http_repeats", 1))
        runs = [(rep, i, m) for rep in range(repeats) for i, m in enumerate(http_modes)]
        for rep, i, http_mode in runs:  # (the modes in alternation, run after run)

            def http_section(mode: str = http_mode, first: bool = i == 0, rep: int = rep) -> dict:
                from infer.bench.gpu_http import http_section as run_http

                c = int(args.http)
                load = (args.prompt_len, args.output_len, c)
                offline_mode = mode  # its own offline cell, else the graphs one's (named)
                offline = _get(report, "engine", mode, "loads", load_key(*load))
                if offline is None:
                    offline_mode = "graphs"
                    offline = _get(report, "engine", "graphs", "loads", load_key(*load))
                vocab = min(model["shape"]["vocab_size"], model["tokenizer_vocab"])
                res: dict = {"offline_mode": offline_mode}
                if rep == 0 and first:  # the targets' figure (with the later runs' median)
                    report["http"] = res
                if rep == 0 and len(http_modes) > 1:
                    report.setdefault("http_modes", {})[mode] = res
                if repeats > 1:
                    report.setdefault("http_runs", []).append(res)
                tag = mode if rep == 0 else f"{mode}-{rep + 1}"
                return run_http(model_dir, args, load, vocab, offline, out_dir, _log, res, mode,
                                tag=tag)  # fmt: skip

            suffix = f" #{rep + 1}" if repeats > 1 else ""
            sections.run(f"http {http_mode}{suffix}", http_section, device)
        http_medians(report)

    if not args.skip_kernels:

        def kernel_section() -> dict:
            res = report["kernels"] = {}
            kernels = kernel_benchmark()
            if kernels is None:
                _log(f"kernels: {KERNELS_NEED_CHECKOUT}")
                res["skipped"] = KERNELS_NEED_CHECKOUT
                return res
            read = _get(report, "roofline", "read_GBps")
            return kernels.section(args, model, read, _log, res)

        sections.run("kernels", kernel_section, device)

    if not args.skip_hf:

        def hf_section() -> dict:
            vocab = min(model["shape"]["vocab_size"], model["tokenizer_vocab"])
            res = report["hf"] = {}
            try:
                return hf_bench(model_dir, vocab, args, _log, res)
            except Exception:
                res["error"] = traceback.format_exc()[-2000:]
                raise

        sections.run("transformers generate_batch", hf_section, device)

"""``infer bench serve``: run the serving workloads against a server and build the report.

Works against any OpenAI-compatible server. The flow per run: ask ``/v1/models`` for the model
id and context length, calibrate words-per-token from the server's own usage count (when no local
tokenizer is given), then per workload: build the seeded requests, send 2 warm-up requests, replay
the arrival process, summarise. :func:`save_report` writes JSON, markdown and PNGs.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from infer.bench import DEFAULT_OUT
from infer.bench.client import (
    Endpoint,
    RequestRecord,
    api_base,
    build_payload,
    fetch_engine_stats,
    fetch_models,
    new_client,
    reachable,
    reset_prefix_cache,
    run_workload,
    stats_delta,
    stream_request,
)
from infer.bench.metrics import SLO, summarize
from infer.bench.report import (
    SCHEMA,
    collect_environment,
    cross_workload_table,
    lost_note,
    now_iso,
    render_markdown,
    save_json,
    slug,
    workload_table,
)
from infer.bench.workloads import (
    DEFAULT_WORDS_PER_TOKEN,
    RemoteTokenCounter,
    TextSource,
    build_requests,
    resolve_workloads,
    scale_workload,
    tokenizer_counter,
)

# Chosen so that the five workloads finish in well under 15 minutes on 2 CPU cores with a ~100M
# model (~40 tok/s alone, a few hundred tok/s batched): half the requests, half the lengths.
CPU_DEFAULT_SCALE = 0.5
GPU_DEFAULT_SCALE = 1.0


def default_scale() -> float:
    """1.0 when this machine has a CUDA GPU (the server is likely on it), else 0.5."""
    try:
        import torch

        if torch.cuda.is_available():
            return GPU_DEFAULT_SCALE
    except ImportError:
        pass
    return CPU_DEFAULT_SCALE


@dataclass(frozen=True)
class ServeBenchConfig:
    """Options of one ``infer bench serve`` run (stored in the report's ``config``)."""

    server: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id of /v1/models
    workload: str = "all"
    seed: int = 42
    scale: float | None = None  # None: default_scale()
    rate_scale: float = 1.0
    endpoint: Endpoint = "completions"
    slo: str | None = None
    tokenizer: str | None = None  # local HF tokenizer folder for exact prompt lengths
    server_tokenize: bool = True  # else use the server's /tokenize when it has one
    reset_cache: bool = True  # POST /reset_prefix_cache before each workload (when supported)
    max_model_len: int | None = None  # None: from /v1/models when the server says
    warmup: int = 2
    ignore_eos: bool = True
    timeout_s: float = 600.0
    label: str | None = None
    server_flags: str | None = None  # recorded as given (the ablation fills it)
    progress: bool = True
    verbose: bool = True


def local_tokenizer(*candidates: str | None) -> str | None:
    """The first candidate that is a local folder with tokenizer files (the server's model id or
    the ``root`` it reports, when client and server share a machine)."""
    for c in candidates:
        if not c:
            continue
        p = Path(c)
        if (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file():
            return str(p)
    return None


async def calibrate_words_per_token(
    server: str, model: str, endpoint: Endpoint, source: TextSource, seed: int
) -> float | None:
    """Words per token of the server's tokenizer, from one request's ``usage.prompt_tokens``."""
    text = source.passage(160, random.Random(f"{seed}:calibrate"))
    payload = build_payload(model, text, 2, endpoint, ignore_eos=True)
    async with new_client(120.0) as client:
        rec = await stream_request(
            client, api_base(server), payload, RequestRecord(-100, 0, 2, 0.0), endpoint
        )
    if not rec.success or not rec.prompt_tokens:
        return None
    return len(text.split()) / rec.prompt_tokens


async def run_serving_benchmark(cfg: ServeBenchConfig) -> dict:
    """Run the configured workloads and return the report dict (nothing written)."""
    slo = SLO.parse(cfg.slo)
    scale = cfg.scale if cfg.scale is not None else default_scale()
    problem = await reachable(cfg.server)
    if problem:
        raise ConnectionError(f"cannot reach a server at {cfg.server}: {problem}")
    models = await fetch_models(cfg.server)
    model = cfg.model or (models[0]["id"] if models else None)
    if not model:
        raise RuntimeError(f"no --model given and {cfg.server}/v1/models lists none")
    entry = next((m for m in models if m.get("id") == model), models[0] if models else {})
    max_model_len = cfg.max_model_len or entry.get("max_model_len")

    # Exact prompt lengths with, in order: --tokenizer, the model folder when it is on this
    # machine, the server's /tokenize; otherwise words calibrated by the server's usage.
    tokenizer = cfg.tokenizer or local_tokenizer(model, entry.get("root"))
    counter: Callable[[str], int] | None = tokenizer_counter(tokenizer) if tokenizer else None
    if counter is None and cfg.server_tokenize:
        counter = RemoteTokenCounter.probe(cfg.server, model)
        tokenizer = f"{cfg.server} /tokenize" if counter else None
    source = TextSource(count_tokens=counter)
    wpt: float | None = None
    if counter is None:
        wpt = await calibrate_words_per_token(cfg.server, model, cfg.endpoint, source, cfg.seed)
        source.words_per_token = wpt or DEFAULT_WORDS_PER_TOKEN

    config = asdict(cfg) | {
        "model": model,
        "scale": scale,
        "max_model_len": max_model_len,
        "tokenizer": tokenizer,
        "words_per_token": None if counter else source.words_per_token,
        "words_per_token_calibrated": wpt is not None,
    }
    report: dict = {
        "schema": SCHEMA,
        "label": cfg.label or model.rstrip("/").split("/")[-1],
        "created": now_iso(),
        "config": config,
        "environment": collect_environment(),
        "server_info": {"models": models},
        "workloads": {},
    }
    for base_spec in resolve_workloads(cfg.workload):
        spec = scale_workload(base_spec, scale, cfg.rate_scale)
        wl = build_requests(spec, cfg.seed, source, max_model_len)
        warm_rng = random.Random(f"{cfg.seed}:warmup:{spec.name}")
        warm_prompts = tuple(source.passage(32, warm_rng) for _ in range(cfg.warmup))
        cache_reset = await reset_prefix_cache(cfg.server) if cfg.reset_cache else False
        stats_before = await fetch_engine_stats(cfg.server)
        run = await run_workload(
            wl,
            cfg.server,
            model,
            cfg.endpoint,
            cfg.ignore_eos,
            warmup_prompts=warm_prompts,
            timeout_s=cfg.timeout_s,
            progress=cfg.progress,
        )
        metrics = summarize(run.records, run.duration_s, slo)
        server_stats = stats_delta(stats_before, await fetch_engine_stats(cfg.server))
        report["workloads"][spec.name] = {
            "spec": spec.describe(),
            "notes": list(wl.notes),
            "metrics": metrics.to_dict(),
            "warmup_errors": [r.error for r in run.warmup if not r.success],
            "server_stats": server_stats,  # counter deltas (warm-ups included), infer servers
            "prefix_cache_reset": cache_reset,  # started with a cold prefix cache
            "requests": [r.to_dict() for r in run.records],
        }
        if cfg.verbose:
            print(f"\n### {spec.name}\n")
            print(workload_table([(report["label"], metrics)]))
            errors = [r.error for r in run.records if r.error]
            note = lost_note(report["label"], metrics, errors)
            if note:
                print(note)
    if cfg.verbose and len(report["workloads"]) > 1:
        from infer.bench.report import report_metrics

        print("\n## Cross-workload comparison\n")
        print(cross_workload_table(report_metrics(report)))
    return report


def run_serving_benchmark_sync(cfg: ServeBenchConfig) -> dict:
    return asyncio.run(run_serving_benchmark(cfg))


def save_report(report: dict, out_dir: str | Path = DEFAULT_OUT, plots: bool = True) -> Path:
    """Write ``<out_dir>/<stamp>_<label>/report.{json,md}`` (+ PNGs); returns the JSON path."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = Path(out_dir) / f"serve_{stamp}_{slug(report['label'])}"
    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    if plots:
        from infer.bench.plots import write_report_plots

        made = write_report_plots(report, folder)
    path = save_json(report, folder / "report.json")
    (folder / "report.md").write_text(render_markdown(report, made))
    return path

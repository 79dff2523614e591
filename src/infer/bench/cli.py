"""``infer bench``: the package's tools (serve, compare, client, ablation, results, engine,
vs-vllm, decode-curve, kernels, router, disagg, gpu) and the checkout's studies (:data:`STUDIES`).

Registered by :mod:`infer.cli`. Building the parser imports nothing from the ``bench`` extra;
each command checks for the extra first (:func:`infer.bench.require_bench_extra`) and imports
what it needs when it runs. Every command writes under ``./bench-results`` by default
(:data:`infer.bench.DEFAULT_OUT`), never into the source tree.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

from infer.bench import DEFAULT_OUT, INSTALL_HINT, require_bench_extra
from infer.bench.workloads import WORKLOADS


def needs_bench_extra(cmd: Callable[[argparse.Namespace], int]) -> Callable:
    """Run ``cmd`` only when the ``bench`` extra is installed (else exit 2 naming it)."""

    @functools.wraps(cmd)
    def wrapper(args: argparse.Namespace) -> int:
        require_bench_extra()
        return cmd(args)

    return wrapper


MODEL_HELP = "model folder (default: a random-init ~100M Llama, built once)"

# The flags many commands share, by name: what ``add_common`` adds.
_COMMON: dict[str, dict] = {
    "model": {"default": None, "help": MODEL_HELP},
    "dtype": {"default": "bfloat16"},
    "concurrency": {"help": "requests kept in flight"},
    "runs": {"type": int, "help": "runs per case; the median is kept"},
    "prompt_len": {"type": int},
    "output_len": {"type": int},
    "port": {"type": int},
    "seed": {"type": int, "default": 0},
    "out": {"help": "report folder"},
}


def add_common(p: argparse.ArgumentParser, **defaults: object) -> None:
    """Add the shared flags named as keywords, in that order, each with the given default
    (``model=True``, ``dtype=True``, ``seed=True``: the usual one; ``out="engine"``: the
    folder ``./bench-results/engine``, ``out=""``: ``./bench-results`` itself)."""
    for name, default in defaults.items():
        kw = dict(_COMMON[name])
        if name == "out":
            default = f"{DEFAULT_OUT}/{default}" if default else DEFAULT_OUT
        if default is not True:
            kw["default"] = default
        p.add_argument("--" + name.replace("_", "-"), **kw)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):  # (NaN fails the first test)
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _slo(text: str) -> str:
    """``--slo`` checked as it is read (the bounds are parsed again where they are used)."""
    from infer.bench.metrics import SLO

    try:
        SLO.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags ``infer bench serve`` and ``ablation`` share (:func:`_serve_config`)."""
    p.add_argument(
        "--workload", default="all", choices=["all", *WORKLOADS], help="which workload(s) to run"
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--scale",
        type=_positive_float,
        default=None,
        help="shrink request counts and lengths (default: 1.0 with a CUDA GPU here, else 0.5)",
    )
    p.add_argument("--rate-scale", type=_positive_float, default=1.0, help="multiply arrival rates")
    p.add_argument(
        "--slo", type=_slo, default=None, help="goodput bounds, e.g. ttft_ms=2000,tpot_ms=100"
    )
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer folder for exact prompt lengths (default: the model folder when "
        "the server's model id or root is one here, else the server's /tokenize, else words "
        "calibrated by the server's usage)",
    )
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per workload")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``infer bench serve`` (also used by ``benchmarks/bench_serving.py``)."""
    p.add_argument("--server", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model id to request (default: first listed)")
    add_workload_args(p)
    p.add_argument(
        "--no-server-tokenize",
        action="store_true",
        help="never use the server's /tokenize for prompt lengths (words calibrated instead)",
    )
    p.add_argument(
        "--no-reset-cache",
        action="store_true",
        help="do not POST /reset_prefix_cache before each workload",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="clip requests to this context")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--label", default=None, help="run label (default: the model id)")
    p.add_argument("--server-flags", default=None, help="server flags, recorded in the report")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"report folder (default: ./{DEFAULT_OUT})")
    p.add_argument("--no-save", action="store_true", help="print tables only")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def add_gpu_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``infer bench gpu`` (:mod:`infer.bench.gpu`; also ``benchmarks/bench_gpu.py``).
    List options left unset take the full run's default, or ``--quick``'s (``full | quick``)."""
    p.add_argument("--out", default=f"{DEFAULT_OUT}/gpu", help="report folder (gpu.md, gpu.json)")
    p.add_argument("--model", default=None, help="model folder (default: the 1B-shape Llama)")
    p.add_argument(
        "--model-dir",
        default=None,
        help="where the 1B-shape Llama is built once and reused "
        "(default ~/.cache/infer/bench/llama-1b-shape)",
    )
    p.add_argument("--quick", action="store_true", help="fewer cells, the same targets")
    p.add_argument(
        "--modes",
        default="graphs,graphs-sync,eager,torch-eager",
        help="engines: graphs (triton + CUDA graphs + async scheduling), graphs-sync (without "
        "async scheduling), eager (triton, enforce_eager), torch-eager (torch attention, "
        "enforce_eager: the old path); and switches over graphs: graphs-gemv (skinny Triton "
        "matmuls for small decode batches), graphs-mixed (mixed steps padded and replayed), "
        "graphs-tiles / graphs-mixed-tiles (a mixed step's decodes in the prefill kernel's "
        "tiles), graphs-compile (torch.compile's norm and activation kernels)",
    )
    p.add_argument(
        "--concurrency", default=None, help="C of the PxO loads (1,16,64,256 | 1,64,256)"
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--long",
        default=None,
        help="more loads, INxOUT@C[+C], comma-separated (1024x128@16 | none)",
    )
    p.add_argument("--requests-per-c", type=int, default=None, help="requests per load / C (2 | 1)")
    p.add_argument("--buckets", default=None, help="decode batch sizes (1,8,32,128,256 | 1,32,256)")
    p.add_argument("--bucket-modes", default="graphs,eager", help="modes whose buckets are timed")
    p.add_argument(
        "--bucket-steps", type=int, default=None, help="steps timed per bucket (20 | 12)"
    )
    p.add_argument("--skip-buckets", action="store_true")
    p.add_argument(
        "--profile",
        default="1,256",
        help="decode batch sizes profiled with torch.profiler: GPU busy time, idle share, "
        "kernels per step, top kernels, host split; B followed by 'a' (64a): a step with an "
        "arrival at batch B ('' for none)",
    )
    p.add_argument("--profile-mode", default="graphs", help="the mode whose steps are profiled")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument(
        "--http",
        default="64",
        help="C of the PxO load also sent over HTTP to `infer serve` (same engine settings), "
        "next to the offline figure ('' for none)",
    )
    p.add_argument(
        "--http-modes",
        default="graphs",
        help="engine modes served over HTTP one after another, each beside its own offline "
        "cell (e.g. 'graphs,graphs-mixed'); the first is the targets' figure",
    )
    p.add_argument(
        "--http-clients",
        type=int,
        default=4,
        help="client processes sharing the HTTP load's streams (one Python process reads a few "
        "thousand events a second: fewer than a GPU server sends at C=64)",
    )
    p.add_argument(
        "--http-repeats",
        type=int,
        default=1,
        help="runs of the HTTP modes in alternation (graphs, graphs-mixed, graphs, ...): each "
        "mode's median is its figure (one server's run-to-run spread can be as large as a "
        "switch's effect)",
    )
    p.add_argument(
        "--http-server-args",
        default="",
        help="more `infer serve` flags for the HTTP section's server (e.g. "
        "'--no-async-scheduling'), to measure a setting over HTTP",
    )
    p.add_argument(
        "--http-profile",
        type=float,
        default=0.0,
        help="seconds of py-spy on the HTTP server's two processes during its load (0: none; "
        "py-spy from $INFER_PY_SPY or the PATH)",
    )
    p.add_argument("--skip-roofline", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-hf", action="store_true", help="no transformers generate_batch")
    p.add_argument("--hf-prompts", default=None, help="generate_batch sizes (1,16,64,256 | 64,256)")
    p.add_argument(
        "--hf-c1-tokens",
        type=int,
        default=None,
        help="new tokens of the 1-prompt generate_batch, which is slow (32 | 16)",
    )
    # The decode attention kernel section (benchmarks/gpu_kernels.py, run from a checkout):
    p.add_argument("--kernel-batches", default=None, help="(16,64,256 | 16,256)")
    p.add_argument("--kernel-contexts", default=None, help="(512,2048,8192 | 512,8192)")
    p.add_argument(
        "--kernel-torch-contexts",
        default=None,
        help="contexts also timed on the torch path (512,2048 | 2048)",
    )
    p.add_argument(
        "--kernel-splits", default=None, help="num_splits at batch 1 (1,2,4,8,16,32 | 1,4,16)"
    )
    p.add_argument("--kernel-split-context", type=int, default=8192)
    p.add_argument("--kernel-reps", type=int, default=None, help="timed samples (20 | 10)")
    p.add_argument("--kernel-max-gb", type=float, default=20.0, help="skip larger K/V caches")
    p.add_argument(
        "--kernel-prefill",
        default=None,
        help="prompts (SxL) for the prefill kernel's configurations (4x2048,1x8192 | 4x2048; "
        "'' for none)",
    )
    p.add_argument(
        "--kernel-mixed",
        default=None,
        help="mixed steps' attention, BxL+P: B decodes at context L beside a P-token prompt "
        "(16x512+128,64x512+128,64x2048+128,1x16384+511 | 64x512+128,1x16384+511; '' for none)",
    )
    p.add_argument(
        "--kernel-gemv-rows",
        default=None,
        help="rows of the model's matmuls timed with cuBLAS and the skinny Triton kernels "
        "(1,16 | 1; '' for none)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="8GiB", help="KV budget of each engine")
    p.add_argument("--read-gib", type=float, default=None, help="roofline read size (4 on CUDA)")
    p.add_argument("--matmul-n", type=int, default=None, help="roofline matmul size (8192 on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    # A dry run of the whole flow on a machine without a GPU: --device cpu --tiny.
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)


def _serve_config(args: argparse.Namespace, **fields):
    """The ``ServeBenchConfig`` of the workload flags ``serve`` and ``ablation`` share, plus
    ``fields``."""
    from infer.bench.serve import ServeBenchConfig

    return ServeBenchConfig(
        workload=args.workload,
        seed=args.seed,
        scale=args.scale,
        rate_scale=args.rate_scale,
        endpoint=args.endpoint,
        slo=args.slo,
        tokenizer=args.tokenizer,
        warmup=args.warmup,
        timeout_s=args.timeout,
        progress=not args.no_progress,
        **fields,
    )


@needs_bench_extra
def cmd_serve(args: argparse.Namespace) -> int:
    from infer.bench.serve import run_serving_benchmark_sync, save_report

    cfg = _serve_config(
        args,
        server=args.server,
        model=args.model,
        server_tokenize=not args.no_server_tokenize,
        reset_cache=not args.no_reset_cache,
        max_model_len=args.max_model_len,
        ignore_eos=not args.no_ignore_eos,
        label=args.label,
        server_flags=args.server_flags,
    )
    try:
        report = run_serving_benchmark_sync(cfg)
    except (ConnectionError, RuntimeError) as e:
        print(f"infer bench serve: {e}", file=sys.stderr)
        return 2
    report["config"]["argv"] = sys.argv[1:]
    if not args.no_save:
        path = save_report(report, args.out, plots=not args.no_plots)
        print(f"\nreport: {path}\nmarkdown: {path.with_suffix('.md')}")
    lost = sum(
        w["metrics"]["configured"] - w["metrics"]["completed"] for w in report["workloads"].values()
    )
    return 1 if lost else 0


@needs_bench_extra
def cmd_compare(args: argparse.Namespace) -> int:
    from infer.bench.compare import compare_markdown
    from infer.bench.report import load_report

    try:
        reports = [load_report(p) for p in args.reports]
        text = compare_markdown(reports, against=args.against)
    except ValueError as e:
        print(f"infer bench compare: {e}", file=sys.stderr)
        return 2
    if args.plots:
        from infer.bench.plots import write_compare_plots

        made = write_compare_plots(reports, args.plots)
        rel = Path(args.plots)
        if args.out:
            try:
                rel = Path(args.plots).resolve().relative_to(Path(args.out).resolve().parent)
            except ValueError:
                rel = Path(args.plots).resolve()
        text += "\n## Plots\n\n" + "".join(f"![{n}]({rel / f})\n\n" for n, f in made.items())
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return 0


@needs_bench_extra
def cmd_client(args: argparse.Namespace) -> int:
    import asyncio

    from infer.bench.client import fetch_models, reachable
    from infer.bench.client_suite import run_client_suite

    problem = asyncio.run(reachable(args.server))
    if problem:  # (as bench serve: one line, not the client library's traceback)
        print(f"infer bench client: cannot reach a server at {args.server}: {problem}",
              file=sys.stderr)  # fmt: skip
        return 2
    prefix_tokens = args.prefix_tokens
    models = asyncio.run(fetch_models(args.server))
    limit = next((m.get("max_model_len") for m in models if m.get("max_model_len")), None)
    if limit and prefix_tokens > limit * 0.7:
        prefix_tokens = int(limit * 0.7)  # room for the template, the suffix and word drift
        print(f"prefix shortened to ~{prefix_tokens} tokens (server max_model_len={limit})")
    tests = ("caching", "batching") if args.test == "all" else (args.test,)
    result = run_client_suite(
        args.server,
        args.model,
        endpoint=args.endpoint,
        prefix_tokens=prefix_tokens,
        num_warm=args.num_warm,
        batch_sizes=[int(x) for x in args.batch_sizes.split(",") if x],
        max_tokens=args.max_tokens,
        seed=args.seed,
        tests=tests,
    )
    print(result["markdown"])
    if not args.no_save:
        from infer.bench.report import collect_environment, now_iso, slug

        result["environment"] = collect_environment()
        result["created"] = now_iso()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"client_{now_iso().replace(':', '').replace('+0000', '')}_{slug(result['model'])}"
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / f"{stem}.md").write_text(result["markdown"] + "\n")
        print(f"report: {out / stem}.json")
    # Lost requests fail the run (as bench serve): a cold request that failed, or a batch's.
    cache = result.get("caching") or {}
    failed = cache.get("status", "ok") != "ok" or any(
        b["success_rate"] < 1 for b in result.get("batching", [])
    )
    if failed:
        print("infer bench client: some requests failed (see the report)", file=sys.stderr)
    return 1 if failed else 0


@needs_bench_extra
def cmd_ablation(args: argparse.Namespace) -> int:
    from infer.bench.ablation import run_ablation

    cfg = _serve_config(args)
    try:
        log, failed = run_ablation(
            args.model,
            cfg,
            out_dir=args.out,
            server_args=args.server_args,
            chunk=args.chunk,
            kv_tokens=args.kv_tokens,
            rungs=args.rungs.split(",") if args.rungs else None,
            startup_timeout_s=args.startup_timeout,
            compile_flag=args.compile_flag,
        )
    except ValueError as e:  # a bad option (an unknown rung): one line
        print(f"infer bench ablation: {e}", file=sys.stderr)
        return 2
    print(f"\nablation log: {log}")
    if failed:
        print(f"rungs that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


@needs_bench_extra
def cmd_results(args: argparse.Namespace) -> int:
    from infer.bench.results import build_results

    text = build_results(args.reports, args.out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out} (fill in the Reading lines)")
    return 0


def _offline_bench(module: str, func: str = "run") -> Callable[[argparse.Namespace], int]:
    """``infer.bench.<module>.<func>`` (engine, prefix, ...), imported when the command runs."""

    @needs_bench_extra
    def cmd(args: argparse.Namespace) -> int:
        import importlib

        return int(getattr(importlib.import_module(f"infer.bench.{module}"), func)(args) or 0)

    return cmd


def checkout_benchmark(name: str):
    """``benchmarks/<name>`` (a file or a folder) of the source checkout this package runs
    from, imported as ``benchmarks.<name>``: the studies that reproduce one report each and the
    kernel micro-benchmarks live beside their reports, outside the package. The checkout's root
    goes on ``sys.path`` (first), so processes a study spawns import it too. None when the
    package is not run from a checkout."""
    import importlib
    from pathlib import Path

    import infer

    root = Path(infer.__file__).resolve().parents[2]
    if not (root / "benchmarks" / "__init__.py").is_file():
        return None
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"benchmarks.{name}")


# Studies: one report each, their code and flags in the checkout's benchmarks/bench_<name>.py.
STUDIES = {
    "quant": "int8 weights / int8 and fp8 KV: decode speed, perplexity, capacity",
    "int4": "4-bit weights: batch-1 decode vs the memory's read rate, perplexity",
    "moe": "mixture of experts: batch-1 decode vs a dense model of the active bytes",
    "lora": "LoRA adapters: output tok/s with requests spread over adapters vs base",
    "spec": "speculative decoding: n-gram and draft-model proposals vs plain decoding",
    "structured": "structured outputs: grammar compile / mask cost, throughput, TTFT",
    "embed": "embeddings: LLM.embed (cold and prefix-cached) vs transformers' forward pass",
    "rerank": "cross-encoder reranking: LLM.score (query prefix shared) vs transformers",
    "gguf": "GGUF files: perplexity per type, batch-1 decode beside llama.cpp on one file",
    "prefix": "prefix caching in wall-clock time on a ~100M Llama",
    "micro": "engine micro-benchmarks on the toy NanoGPT, no HTTP",
    "overload": "429 latency of a full server under a burst",
    "dashboard": "what the live view costs; its screenshots",
    "tensor-parallel": "throughput at tensor_parallel_size 1, 2, ... and all-reduce cost",
}


def study_module(name: str):
    """The checkout's ``benchmarks/bench_<name>.py`` (``-`` in ``name`` as ``_``), or None
    outside a checkout."""
    return checkout_benchmark("bench_" + name.replace("-", "_"))


def cmd_study(args: argparse.Namespace) -> int:
    """``infer bench <study> ARGS``: the study's ``run(build_parser().parse_args(ARGS))``,
    after checking for the ``bench`` extra unless the study sets ``NEEDS_BENCH_EXTRA = False``.
    """
    name = args.bench_command
    module = study_module(name)
    if module is None:
        print(f"infer bench {name} reproduces a committed report: run it from a source "
              f"checkout (benchmarks/bench_{name.replace('-', '_')}.py)", file=sys.stderr)  # fmt: skip
        return 2
    if getattr(module, "NEEDS_BENCH_EXTRA", True):
        require_bench_extra(f"infer bench {name}")
    return int(module.run(module.build_parser().parse_args(args.study_argv)) or 0)


@needs_bench_extra
def cmd_kernels(args: argparse.Namespace) -> int:
    """``infer bench kernels``: ``benchmarks/kernels.py`` of the checkout (it compares this
    tree's kernel sources with a git revision's, so it needs the checkout anyway)."""
    module = checkout_benchmark("kernels")
    if module is None:
        print(
            "infer bench kernels compares this tree's C++ kernel sources with another "
            "revision's: run it from a source checkout (benchmarks/kernels.py)",
            file=sys.stderr,
        )
        return 2
    return int(module.run(args) or 0)


def cmd_gpu(args: argparse.Namespace) -> int:
    """``infer bench gpu``: needs CUDA, not the ``bench`` extra (it uses no HTTP client, SDK
    or plots), so a bare GPU machine runs it with infer's runtime dependencies alone."""
    from infer.bench.gpu import run

    return run(args)


def register(subparsers) -> None:
    """Add ``bench`` and its sub-commands to the ``infer`` parser."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks: serving, client, micro, ablation, engine (needs the bench extra)",
        description=f"Benchmarks (needs the bench extra: {INSTALL_HINT}). Reports go to "
        f"./{DEFAULT_OUT} unless --out says otherwise.",
    )
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = sub.add_parser("serve", help="run the serving workloads against a server")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    cmp = sub.add_parser("compare", help="phase-vs-phase delta tables of serving reports")
    cmp.add_argument(
        "reports",
        nargs="+",
        help="report.json files, or the folders holding them (a run's, or the --out folder of "
        "one run), oldest first",
    )
    cmp.add_argument("--against", choices=["previous", "first"], default="previous")
    cmp.add_argument("--out", default=None, help="also write the markdown here")
    cmp.add_argument("--plots", default=None, help="folder for comparison PNGs")
    cmp.set_defaults(func=cmd_compare)

    cl = sub.add_parser(
        "client",
        help="client-side suite (openai SDK): cold vs warm prefix, sequential vs concurrent",
    )
    cl.add_argument("--server", default="http://127.0.0.1:8000")
    cl.add_argument("--model", default=None)
    cl.add_argument("--test", choices=["all", "caching", "batching"], default="all")
    cl.add_argument("--endpoint", choices=["completions", "chat"], default="chat")
    cl.add_argument("--prefix-tokens", type=int, default=1024, help="long prefix length (approx.)")
    cl.add_argument("--num-warm", type=int, default=3)
    cl.add_argument("--batch-sizes", default="1,2,4,8,12")
    cl.add_argument("--max-tokens", type=int, default=50)
    add_common(cl, seed=True, out="")
    cl.add_argument("--no-save", action="store_true")
    cl.set_defaults(func=cmd_client)

    ab = sub.add_parser("ablation", help="start infer serve per rung and run the workloads")
    ab.add_argument("--model", required=True, help="checkpoint folder or built-in name")
    add_workload_args(ab)
    ab.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 512 x scale)")
    ab.add_argument("--kv-tokens", type=int, default=None,
                    help="KV budget of every rung in tokens (default 8 x the model's context)")  # fmt: skip
    ab.add_argument(
        "--server-args",
        default="",
        help='extra flags for every infer serve, e.g. --server-args="--dtype bfloat16"',
    )
    ab.add_argument("--rungs", default=None, help="comma-separated subset of rung names")
    ab.add_argument(
        "--compile-flag",
        default=None,
        metavar="FLAG",
        help="add a last rung, +compiled_decode, passing FLAG to infer serve (write it with =: "
        "--compile-flag=--my-flag); without it there is no such rung",
    )
    ab.add_argument("--startup-timeout", type=float, default=600.0)
    ab.add_argument("--out", default=DEFAULT_OUT)
    ab.add_argument("--no-progress", action="store_true")
    ab.set_defaults(func=cmd_ablation)

    rs = sub.add_parser("results", help="stitch the latest reports into a RESULTS.md skeleton")
    rs.add_argument("--reports", default=DEFAULT_OUT, help="folder of saved reports")
    rs.add_argument("--out", default=f"{DEFAULT_OUT}/RESULTS.md")
    rs.set_defaults(func=cmd_results)

    en = sub.add_parser("engine", help="offline engine tok/s on a ~100M Llama, with roofline")
    add_common(
        en, model=True, concurrency="1,16,64", runs=3, prompt_len=64, output_len=64, out="engine"
    )
    en.add_argument("--dtypes", default="bfloat16,float32")
    en.set_defaults(func=_offline_bench("engine"))

    vs = sub.add_parser(
        "vs-vllm",
        help="infer vs vLLM (or llama.cpp's llama-server) over HTTP, all driven by vllm bench "
        "serve (the serving yardstick)",
    )
    add_common(vs, model=True, dtype=True, port=8321, out="vs_vllm")
    vs.add_argument(
        "--peers",
        default="infer,vllm",
        help="servers to run, one at a time: infer, vllm, llamacpp (comma-separated)",
    )
    vs.add_argument(
        "--workloads",
        default="64x64,1024x128",
        help="INxOUT (default C: 64x64 -> 1,16,64; 1024x128 -> 16) or INxOUT@C+C, comma-separated",
    )
    vs.add_argument("--runs", type=int, default=3, help="rounds; the median of each metric is kept")
    vs.add_argument("--num-prompts", type=int, default=None, help="prompts per run (default 4*C)")
    vs.add_argument("--warmup-output-len", type=int, default=16,
                    help="output tokens of the warm-up run (C prompts) before each cell")  # fmt: skip
    vs.add_argument(
        "--vllm-dtype",
        default=None,
        help="vLLM's dtype where it differs from --dtype (float32 on a CPU without AVX-512, "
        "where vLLM's bf16 matmuls are slow)",
    )
    vs.add_argument("--max-num-seqs", type=int, default=64)
    vs.add_argument("--max-model-len", type=int, default=2048)
    vs.add_argument("--served-name", default=None, help="served model name (default: folder name)")
    vs.add_argument("--seed", type=int, default=0, help="base seed of the random prompts")
    vs.add_argument(
        "--infer-args",
        default="",
        help='extra infer serve flags (write with =: --infer-args="--torch-threads 1")',
    )
    vs.add_argument("--vllm-args", default="", help="extra vllm serve flags (write with =)")
    vs.add_argument(
        "--vllm-model",
        default=None,
        help="the folder vLLM serves where it differs from --model (a checkpoint quantized ahead "
        "of time in vLLM's format, against infer quantizing --model at load)",
    )
    vs.add_argument(
        "--llamacpp-model",
        default=None,
        metavar="GGUF",
        help="the GGUF file llama-server serves (needed with --peers ...,llamacpp): --model "
        "converted, e.g. by benchmarks/make_gguf.py, and quantized with llama-quantize",
    )
    vs.add_argument(
        "--llamacpp-bin",
        default=None,
        help="llama.cpp's llama-server binary (default: $LLAMACPP_BIN, or llama-server on PATH)",
    )
    vs.add_argument("--llamacpp-args", default="", help="extra llama-server flags (write with =)")
    vs.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) for the lora/INxOUT@C workloads: both servers get "
        "--enable-lora --max-loras --max-lora-rank --lora-modules, and each request names one "
        "of the adapters, at random",
    )
    vs.add_argument(
        "--max-loras", type=int, default=None, help="adapters resident at once (default: all)"
    )
    vs.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank")
    vs.add_argument(
        "--offline",
        action="store_true",
        help="also the offline engine at C=16 on 64x64 (LLM.generate), vs infer over HTTP",
    )
    vs.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each run, wait up to S seconds for other processes to use <= 0.25 cores",
    )
    vs.add_argument("--startup-timeout", type=float, default=600.0)
    vs.add_argument("--cell-timeout", type=float, default=1800.0, help="seconds per client run")
    vs.set_defaults(func=_offline_bench("vs_vllm"))

    dc = sub.add_parser(
        "decode-curve", help="decode step time vs context length, and the attention share"
    )
    add_common(dc, model=True, dtype=True, seed=True, out="decode_curve")
    dc.add_argument("--batch", type=int, default=16, help="sequences decoding together")
    dc.add_argument("--kv-cache-dtype", default="auto", help="auto | int8 | fp8")
    dc.add_argument("--quantization", default=None, help="weights: int8 | fp8")
    dc.add_argument("--contexts", default="128,256,512,1024,2048,4096")
    dc.add_argument("--steps", type=int, default=8, help="decode steps per timed block")
    dc.add_argument("--repeats", type=int, default=3, help="real/no-op block pairs per context")
    dc.add_argument("--max-model-len", type=int, default=4352)
    dc.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each context, wait up to S s for other processes to quiet down")  # fmt: skip
    dc.set_defaults(func=_offline_bench("decode_curve"))

    kn = sub.add_parser(
        "kernels", help="this tree's C++ CPU kernels vs another revision's, side by side"
    )
    kn.add_argument("--against", default="HEAD", help="git revision or folder of kernel sources")
    kn.add_argument("--cases", default="linear,decode,prefill",
                    help="linear, int4, decode, prefill, step")  # fmt: skip
    kn.add_argument("--rows", default="1,16,33,64,256", help="linear, int4: rows of x")
    kn.add_argument("--decode", default="16x128,16x1024,64x128", help="sequences x tokens")
    kn.add_argument("--prefill", default="1x1024,16x64", help="sequences x tokens")
    kn.add_argument("--step", default="16x96", help="step: sequences x prompt tokens")
    kn.add_argument("--step-count", type=int, default=200, help="step: decode steps in all")
    kn.add_argument("--model", default=None, help="step: " + MODEL_HELP)
    kn.add_argument("--repeats", type=int, default=9, help="turns; each side's minimum is kept")
    add_common(kn, seed=True, out="kernels")
    kn.set_defaults(func=cmd_kernels)

    from infer.bench.router import add_parser as add_router

    add_router(sub)
    from infer.bench.disagg import add_parser as add_disagg

    add_disagg(sub)
    for name, help_ in STUDIES.items():  # every flag goes to the study's own parser
        study = sub.add_parser(name, help=help_, add_help=False, prefix_chars="\0")
        study.add_argument("study_argv", nargs=argparse.REMAINDER)
        study.set_defaults(func=cmd_study)
    gp = sub.add_parser(
        "gpu",
        help="one CUDA GPU: a 1B-shape Llama's roofline, engine modes (CUDA graphs / eager / "
        "torch), decode buckets, the Triton attention kernel, transformers' generate_batch",
    )
    add_gpu_args(gp)
    gp.set_defaults(func=cmd_gpu)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m infer.bench.cli`` (same as ``infer bench``)."""
    parser = argparse.ArgumentParser(prog="infer")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

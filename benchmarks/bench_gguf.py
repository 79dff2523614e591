"""GGUF files as llama.cpp users have them: what each type costs in quality, and batch-1 decode
beside llama.cpp on the same file: ``infer bench gguf``.

    infer bench gguf --llama-cpp SRC [--types Q8_0,Q6_K,Q4_K_M,Q4_0]
                     [--decode-model FILE.gguf] [--rounds 3] [--out bench-results/gguf]
    infer bench gguf --no-quality --activations-model FILE.gguf [--rounds 4]
    infer bench gguf --no-quality --q6k-model FILE.gguf [--rounds 4]
    infer bench gguf --no-quality --dequantize-model FILE.gguf [--rounds 4]

``SRC`` is llama.cpp's source tree with ``build/bin/llama-quantize`` (and ``llama-server`` for
the decode part), e.g. ``vendor/llama.cpp`` of the ``llama-cpp-python`` sdist built as
docs/benchmarks.md says.

- **Quality**: the built-in ``small`` (trained, held-out text) written to GGUF by llama.cpp's
  own converter (``benchmarks/make_gguf.py``, F32), then ``llama-quantize``'d to each type.
  Held-out perplexity (8 windows of 1,000 tokens, from the engine's prompt logprobs) of the
  folder, and of each file: in float32 (every weight dequantized: llama.cpp's exact values),
  in bf16 with bf16 activations and ``--no-gguf-int8`` (4-bit layers in the int4 kernel, the
  others dequantized to bf16), with bf16 activations (the others in int8 per channel), and as
  served by default (int8 activations: 4-, 5- and 6-bit layers in the w4a8 kernel, the
  others in int8 per channel).
- **Decode** (``--decode-model``): batch-1 decode of 128 tokens after a 12-token prompt,
  rounds alternating between ``llama-server`` (1 slot, every core, its own ``timings`` of
  the completion: ms per generated token) and infer's offline engine (the default,
  ``--no-gguf-int8-activations``, and both off: ms per token from the difference of a 136-
  and an 8-token run).
  Medians of each round's runs; the machines here are shared, so read the rounds side by
  side.
- **Activations** (``--activations-model``; no llama.cpp needed): infer's default (int8
  activations, the w4a8 kernel) against ``--no-gguf-int8-activations`` on one file, both
  engines in one process and measured in turns (so a slow spell of the machine hits both):
  batch-1 decode (ms per token from a 56- and an 8-token run, the median of 3 a round), a
  512-token prefill, and a decode step of 16 sequences; the weights each holds.
- **Q6_K** (``--q6k-model``; no llama.cpp needed): the default (Q6_K layers, and a Q6_K
  vocabulary projection, held as stored: 6.5625 bits a weight in the w4a8 kernel) against the
  same engine with them in int8 per channel (as before they were kept), measured as above.
- **Dequantized** (``--dequantize-model``; no llama.cpp needed): the default (layers held as
  stored where the CPU kernels run them) against ``--gguf-dequantize`` (every layer dequantized
  to bf16 at load), measured as above: on AVX2 CPUs the 4-bit kernel wins batch-1 decode and
  loses batches to the bf16 one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from infer.bench.cli import add_common
from infer.bench.report import machine_line, md_table, offline_machine, save_report

NEEDS_BENCH_EXTRA = False
PROMPT = "The quick brown fox jumps over the lazy dog and then"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer bench gguf",
        description="GGUF files: perplexity per type, batch-1 decode beside llama.cpp",
    )
    p.add_argument("--llama-cpp", type=Path, default=None,
                   help="llama.cpp's built source tree (required)")  # fmt: skip
    p.add_argument("--types", default="Q8_0,Q6_K,Q4_K_M,Q4_0", help="llama-quantize types")
    p.add_argument("--decode-model", type=Path, default=None, help="a GGUF file to decode")
    p.add_argument("--activations-model", type=Path, default=None,
                   help="a GGUF file: int8 against bf16 activations, in one process")  # fmt: skip
    p.add_argument("--q6k-model", type=Path, default=None,
                   help="a GGUF file: Q6_K as stored against int8 per channel, in one process")  # fmt: skip
    p.add_argument("--dequantize-model", type=Path, default=None,
                   help="a GGUF file: held as stored against --gguf-dequantize, in one process")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--windows", type=int, default=8, help="held-out windows of 1,000 tokens")
    p.add_argument("--no-quality", dest="quality", action="store_false",
                   help="skip the perplexity part")  # fmt: skip
    add_common(p, out="gguf")
    return p


# --------------------------------------------------------------------------- quality


def perplexity(model: Path, windows, **options) -> tuple[float, dict]:
    """Held-out perplexity of ``model`` served with ``options``, and what the engine held."""
    from infer import LLM, SamplingParams

    with LLM(str(model), max_model_len=1024, **options) as llm:
        outs = llm.generate([w.tolist() for w in windows],
                            SamplingParams(max_tokens=1, prompt_logprobs=0))  # fmt: skip
        nll = [-lp.logprob for o in outs for lp in o.prompt_logprobs[1:]]
        backend = llm.engine.backend
        held = {"int4": sum(m.bits == 4 for m in backend.kept_int4),
                "int5": sum(m.bits == 5 for m in backend.kept_int4),
                "int6": sum(m.bits == 6 for m in backend.kept_int4),
                "int8": len(backend.checkpoint_int8),
                "weights_mib": round(llm.engine.weights_bytes / 2**20, 2)}  # fmt: skip
    return math.exp(sum(nll) / len(nll)), held


def quality(args: argparse.Namespace, small: Path, work: Path) -> list[dict]:
    from benchmarks.make_gguf import main as make_gguf
    from infer.bench.offline import held_out_windows

    windows = held_out_windows(small, max_windows=args.windows, context=1000)
    f32 = work / "small-f32.gguf"
    make_gguf([str(args.llama_cpp), str(small), str(f32), "--outtype", "f32"])
    rows = []
    for label, options in (("bf16", {"dtype": "bfloat16"}), ("float32", {"dtype": "float32"})):
        ppl, held = perplexity(small, windows, **options)
        rows.append({"model": "folder", "served": label, "ppl": ppl, **held})
    quantize = args.llama_cpp / "build" / "bin" / "llama-quantize"
    for kind in args.types.split(","):
        file = work / f"small-{kind}.gguf"
        subprocess.run([str(quantize), str(f32), str(file), kind], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        for label, options in (
            ("float32 (exact)", {"dtype": "float32"}),
            (
                "bf16, --no-gguf-int8 --no-gguf-int8-activations",
                {"dtype": "bfloat16", "gguf_int8": False, "gguf_int8_activations": False},
            ),
            (
                "bf16, --no-gguf-int8-activations",
                {"dtype": "bfloat16", "gguf_int8_activations": False},
            ),
            ("bf16 (default)", {"dtype": "bfloat16"}),
        ):
            ppl, held = perplexity(file, windows, **options)
            rows.append({"model": kind, "served": label, "ppl": ppl, **held})
            print(rows[-1], flush=True)
    return rows


# --------------------------------------------------------------------------- decode


def llama_server_decode(args: argparse.Namespace, model: Path, runs: int = 3) -> float:
    """Median ms per generated token of ``llama-server`` (1 slot, every core) on ``model``."""
    server = args.llama_cpp / "build" / "bin" / "llama-server"
    port = 18080 + os.getpid() % 1000
    threads = str(os.cpu_count())
    proc = subprocess.Popen([str(server), "-m", str(model), "--host", "127.0.0.1", "--port",
                             str(port), "-np", "1", "-c", "512", "-t", threads, "-tb", threads],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        body = json.dumps({"prompt": PROMPT, "n_predict": 128, "ignore_eos": True,
                           "temperature": 0, "cache_prompt": False}).encode()  # fmt: skip
        per_token = []
        for _ in range(runs):
            request = urllib.request.Request(url + "/completion", body,
                                             {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(request, timeout=600) as r:
                per_token.append(json.load(r)["timings"]["predicted_per_token_ms"])
        return statistics.median(per_token)
    finally:
        proc.terminate()
        proc.wait()


def infer_decode(model: Path, runs: int = 3, **options) -> tuple[float, float]:
    """(median ms per token of a batch-1 decode, weights MiB) of infer's offline engine."""
    from infer import LLM, SamplingParams

    with LLM(str(model), dtype="bfloat16", max_model_len=512, **options) as llm:

        def run(n: int) -> float:
            t0 = time.perf_counter()
            llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            return time.perf_counter() - t0

        run(8)
        per_token = [(run(136) - run(8)) / 128 * 1000 for _ in range(runs)]
        return statistics.median(per_token), llm.engine.weights_bytes / 2**20


DECODE_VARIANTS = (
    ("infer (default)", {}),
    ("infer --no-gguf-int8-activations", {"gguf_int8_activations": False}),
    (
        "infer --no-gguf-int8 --no-gguf-int8-activations",
        {"gguf_int8": False, "gguf_int8_activations": False},
    ),
)


def decode(args: argparse.Namespace) -> list[dict]:
    rows = []
    for r in range(1, args.rounds + 1):
        rows.append({"round": r, "engine": "llama.cpp (llama-server)",
                     "ms": llama_server_decode(args, args.decode_model)})  # fmt: skip
        for label, options in DECODE_VARIANTS:
            ms, mib = infer_decode(args.decode_model, **options)
            rows.append({"round": r, "engine": label, "ms": ms, "weights_mib": mib})
        print(rows[-1 - len(DECODE_VARIANTS) :], flush=True)
    return rows


ACTIVATION_SETTINGS = {
    "int8 activations (default)": ({"gguf_int8_activations": True}, False),
    "--no-gguf-int8-activations": ({"gguf_int8_activations": False}, False),
}
Q6K_SETTINGS = {  # label: (engine options, Q6_K held in int8 per channel)
    "Q6_K as stored (default)": ({}, False),
    "Q6_K in int8 per channel": ({}, True),
}
DEQUANTIZE_SETTINGS = {
    "held as stored (default)": ({}, False),
    "--gguf-dequantize": ({"gguf_dequantize": True}, False),
}


def _engine(model: Path, options: dict, q6k_int8: bool):
    """An engine on ``model``; ``q6k_int8``: its Q6_K tensors are not unpacked, so they are
    held in int8 per channel (the layout before they were kept as stored)."""
    from unittest import mock

    from infer import LLM

    if not q6k_int8:
        return LLM(str(model), dtype="bfloat16", max_model_len=1024, **options)
    with mock.patch("infer.model.gguf_checkpoint.unpack_q6k", return_value=None):
        return LLM(str(model), dtype="bfloat16", max_model_len=1024, **options)


def in_turns(model: Path, settings: dict, rounds: int) -> list[dict]:
    """Rows per round and setting: batch-1 decode ms / token, 512-token prefill ms, ms per
    decode step of 16 sequences, weights MiB; every setting's engine in one process, measured
    in turns (see the module doc)."""
    import random

    from infer import SamplingParams

    llms = {label: _engine(model, *setting) for label, setting in settings.items()}
    rng = random.Random(0)
    vocab = min(llm.engine.spec.vocab_size for llm in llms.values())

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    def seconds(llm, prompts: list[list[int]], tokens: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        return time.perf_counter() - t0

    for llm in llms.values():
        seconds(llm, [prompt(8)], 4)
    rows = []
    for r in range(1, rounds + 1):
        order = list(llms.items()) if r % 2 else list(llms.items())[::-1]
        decode = {label: [] for label in llms}
        for i in range(6):  # batch-1 decode: the two engines in turns, a median of 3 each
            label, llm = order[i % 2]
            ms = (seconds(llm, [prompt(8)], 56) - seconds(llm, [prompt(8)], 8)) / 48 * 1000
            decode[label].append(ms)
        for label, llm in order:
            decode_ms = statistics.median(decode[label])
            prefill_ms = seconds(llm, [prompt(512)], 1) * 1000
            batch = [prompt(8) for _ in range(16)]
            step_ms = (seconds(llm, batch, 40) - seconds(llm, batch, 8)) / 32 * 1000
            rows.append({"round": r, "setting": label, "decode_ms": decode_ms,
                         "prefill_ms": prefill_ms, "step16_ms": step_ms,
                         "weights_mib": llm.engine.weights_bytes / 2**20})  # fmt: skip
            print(rows[-1], flush=True)
    for llm in llms.values():
        llm.close()
    return rows


# --------------------------------------------------------------------------- report


def markdown(report: dict) -> str:
    lines = ["# GGUF files: quality per type, batch-1 decode beside llama.cpp", "",
             machine_line(report["machine"]), ""]  # fmt: skip
    q = report["quality"]
    base = next((r["ppl"] for r in q if r["served"] == "float32"), 1.0)
    if q:
        lines += ["Held-out perplexity of the built-in `small` (its folder; llama.cpp's "
                  "converter and `llama-quantize` for each file):", ""]  # fmt: skip
    lines += [] if not q else md_table(
        ["model", "served", "perplexity", "vs folder float32", "4-bit layers",
         "5-bit layers", "6-bit layers", "int8 layers", "weights MiB"],
        [[r["model"], r["served"], f"{r['ppl']:.3f}", f"{100 * (r['ppl'] / base - 1):+.2f}%",
          r["int4"], r.get("int5", 0), r.get("int6", 0), r["int8"],
          f"{r['weights_mib']:.2f}"] for r in q],
    )  # fmt: skip
    if report["decode"]:
        lines += ["", f"Batch-1 decode of {report['decode_model']} (128 tokens; ms per token, "
                  "median of 3 runs per round):", ""]  # fmt: skip
        lines += md_table(
            ["round", "engine", "ms / token", "tok/s", "weights MiB"],
            [[r["round"], r["engine"], f"{r['ms']:.1f}", f"{1000 / r['ms']:.1f}",
              f"{r['weights_mib']:.0f}" if "weights_mib" in r else ""] for r in report["decode"]],
        )  # fmt: skip
        engines = dict.fromkeys(r["engine"] for r in report["decode"])
        summary = []
        for engine in engines:
            ms = [r["ms"] for r in report["decode"] if r["engine"] == engine]
            summary.append([engine, f"{statistics.median(ms):.1f}", f"{min(ms):.1f}",
                            f"{1000 / statistics.median(ms):.1f}"])  # fmt: skip
        lines += ["", "Over the rounds:", ""]
        lines += md_table(["engine", "median ms / token", "best round", "median tok/s"], summary)
    for key, title, (new_label, base_label) in (
        ("activations", "int8 against bf16 activations", list(ACTIVATION_SETTINGS)),
        ("q6k", "Q6_K layers as stored against int8 per channel", list(Q6K_SETTINGS)),
        (
            "dequantize",
            "layers held as stored against dequantized at load",
            list(DEQUANTIZE_SETTINGS),
        ),
    ):
        lines += _turns_markdown(report.get(key) or [], report.get(f"{key}_model"), title,
                                 new_label, base_label)  # fmt: skip
    return "\n".join(lines) + "\n"


def _turns_markdown(rows: list[dict], model: str | None, title: str, new_label: str,
                    base_label: str) -> list[str]:  # fmt: skip
    """The table of :func:`in_turns` rows, and the medians: how much faster ``new_label`` is."""
    if not rows:
        return []
    lines = ["", f"{title} on {model} (one process, the engines measured in turns):", ""]
    lines += md_table(
        ["round", "setting", "batch-1 decode ms / token", "512-token prefill ms",
         "16-sequence step ms", "weights MiB"],
        [[r["round"], r["setting"], f"{r['decode_ms']:.1f}", f"{r['prefill_ms']:.0f}",
          f"{r['step16_ms']:.1f}", f"{r['weights_mib']:.0f}"] for r in rows],
    )  # fmt: skip
    med = {s: {k: statistics.median(r[k] for r in rows if r["setting"] == s)
               for k in ("decode_ms", "prefill_ms", "step16_ms")}
           for s in dict.fromkeys(r["setting"] for r in rows)}  # fmt: skip
    base, new = med[base_label], med[new_label]
    lines += ["", f"Medians, and how much faster {new_label} is: "
              + "; ".join(f"{name} {base[k]:.1f} -> {new[k]:.1f} ({base[k] / new[k]:.2f}x)"
                          for name, k in (("batch-1 decode ms", "decode_ms"),
                                          ("prefill ms", "prefill_ms"),
                                          ("16-sequence step ms", "step16_ms")))]  # fmt: skip
    return lines
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from infer.builtin import ensure_builtin_model
    from infer.model.folders import find_model_folder

    if args.llama_cpp is None and (args.quality or args.decode_model):
        print("infer bench gguf: --llama-cpp SRC is required (llama.cpp's source tree, built: "
              "build/bin/llama-quantize, llama-server)", file=sys.stderr)  # fmt: skip
        return 2
    if args.llama_cpp is not None:
        args.llama_cpp = args.llama_cpp.expanduser().resolve()
    with tempfile.TemporaryDirectory(prefix="bench-gguf-") as tmp:
        try:
            small = Path(ensure_builtin_model("small")) if args.quality else None
            scores = quality(args, small, Path(tmp)) if small is not None else []
            report = {"machine": offline_machine(), "quality": scores,
                      "decode_model": str(args.decode_model) if args.decode_model else None,
                      "decode": decode(args) if args.decode_model else [],
                      "activations_model": str(args.activations_model or ""),
                      "activations": in_turns(args.activations_model, ACTIVATION_SETTINGS,
                                              args.rounds) if args.activations_model else [],
                      "q6k_model": str(args.q6k_model or ""),
                      "q6k": in_turns(args.q6k_model, Q6K_SETTINGS,
                                      args.rounds) if args.q6k_model else [],
                      "dequantize_model": str(args.dequantize_model or ""),
                      "dequantize": in_turns(args.dequantize_model, DEQUANTIZE_SETTINGS,
                                             args.rounds) if args.dequantize_model else []}  # fmt: skip
        finally:  # the folders made of the temporary files' metadata
            for file in Path(tmp).glob("*.gguf"):
                shutil.rmtree(find_model_folder(file), ignore_errors=True)
    save_report(report, markdown(report), args.out, "gguf")
    return 0


if __name__ == "__main__":
    sys.exit(run(build_parser().parse_args()))

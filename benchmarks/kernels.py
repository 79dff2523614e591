"""The C++ CPU kernels of this checkout against another revision's, side by side in one process.

    infer bench kernels [--against REV | DIR] [--cases linear,decode,prefill,step] [--repeats 9]
                        [--step 16x96] [--step-count 200] [--model DIR]
                        [--out bench-results/kernels]

(``python benchmarks/kernels.py ...`` runs the same.) A kernel micro-benchmark: it lives beside
the reports, outside the package (it needs the checkout's git history anyway); the command
loads it from here.

Builds ``runner/cpu/csrc`` twice, as it is in this tree (A) and as it is at ``--against`` (B: a git
revision, default ``HEAD``, or a folder of kernel sources), loads both libraries and runs the
same calls on the same tensors, A and B taking turns, each case's time the minimum over
``--repeats`` turns. Every output of B is compared with A's bit for bit. A VM's speed drifts by
10-40% from one minute to the next (its memory's rate most), so figures from separate runs do not
compare kernels; these do.

Cases, on the shapes of the ~110M Llama of ``infer bench engine`` (hidden 768, 12 layers, 12
heads of 64, MLP 2048, vocabulary 32000; bf16):

- ``linear``: its 49 linear layers (12 x qkv, o, gate_up, down, then the LM head), each with its
  own weights, at 1, 16, 33, 64 and 256 rows (``--rows``); GFLOP/s;
- ``int4``: the same 48 layers but the LM head with 4-bit weights (groups of 128, as GPTQ
  folders; ``runner/int4.py``'s packing), through the 4-bit kernel this CPU runs (the AVX2 one
  where AVX-512 BF16 is absent), at the ``--rows`` counts; GFLOP/s;
- ``decode``: 12 layers of paged decode attention at 16 x 128, 16 x 1024 and 64 x 128
  (sequences x tokens, ``--decode``), blocks in random order; GB/s of K and V read;
- ``prefill``: one layer of prefill attention, 1 x 1024 and 16 x 64 tokens (``--prefill``);
  GFLOP/s of the causal products;
- ``step``: the engine's whole decode step on that model (built once, as for ``infer bench
  engine``), 16 x 96 tokens (``--step``) and ``--step-count`` steps: the two libraries run the
  layer loop and final norm (the kernels of an all-decode step but the LM head) in the order
  A B B A, and each side's figure is its median step. What a kernel change buys where it runs, with the
  Python, the other kernels and the cold caches of a real step around it; the outputs are not
  compared (the other cases compare bits).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from infer.bench.offline import greedy, make_engine, random_prompts
from infer.runner.attention import KVCache
from infer.runner.cpu.kernels import (
    CSRC,
    CpuKernels,
    PrefillChunks,
    build_library,
    find_compiler,
    int4_flags,
)
from infer.runner.int4 import pack_int4
from infer.testing.bench_models import llama_100m

HIDDEN, LAYERS, HEADS, HEAD_DIM, INTER, VOCAB, BLOCK = 768, 12, 12, 64, 2048, 32000, 16
CASES = ("linear", "int4", "decode", "prefill", "step")
INT4_GROUP = 128

Outputs = torch.Tensor | list[torch.Tensor]
Case = tuple[Callable[[CpuKernels], Callable[[], Outputs]], float, str]
"""A case: (library -> its call on the case's tensors, work per call (GFLOP or GB), unit)."""


def parse_pairs(spec: str) -> list[tuple[int, int]]:
    """``"16x128,64x128"`` -> ``[(16, 128), (64, 128)]``."""
    pairs = []
    for part in spec.split(","):
        a, _, b = part.strip().partition("x")
        if not (a.isdigit() and b.isdigit()) or int(a) <= 0 or int(b) <= 0:
            raise SystemExit(f"bad size {part!r}: write COUNTxTOKENS, e.g. 16x128")
        pairs.append((int(a), int(b)))
    return pairs


def sources_at(against: str, workdir: Path) -> Path:
    """The kernel sources of B: folder ``against`` if it is one, else ``runner/cpu/csrc`` at git
    revision ``against``, extracted under ``workdir``."""
    folder = Path(against)
    if folder.is_dir():
        if not any(folder.glob("*.cpp")):
            raise SystemExit(f"{folder} holds no *.cpp kernel sources")
        return folder
    root = _repo_root()
    # Where the sources are now, and where they were before the CPU backend got its room.
    rels = [CSRC.relative_to(root), Path("src/infer/runner/csrc")]
    for rel in rels:
        archive = subprocess.run(["git", "-C", str(root), "archive", against, str(rel)],
                                 capture_output=True)  # fmt: skip
        if archive.returncode == 0:
            break
    else:
        err = archive.stderr.decode(errors="replace").strip()
        raise SystemExit(f"cannot read the kernels at {against!r}: {err}")
    subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive.stdout, check=True)
    return workdir / rel


def _repo_root() -> Path:
    out = subprocess.run(
        ["git", "-C", str(CSRC), "rev-parse", "--show-toplevel"], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit("--against REV needs a git checkout of infer; give a folder instead")
    return Path(out.stdout.strip())


def side_by_side(
    calls: list[Callable[[], Outputs]], repeats: int
) -> tuple[list[float], list[bool]]:
    """Each call's minimum time over ``repeats`` turns (they take turns), and whether each
    call's outputs equal the first call's bit for bit."""
    first = [_as_list(c()) for c in calls]  # warm-up, and the outputs compared
    same = [all(torch.equal(a, b) for a, b in zip(first[0], f, strict=True)) for f in first]
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best, same


def _as_list(x: Outputs) -> list[torch.Tensor]:
    return [t.clone() for t in (x if isinstance(x, list) else [x])]


def linear_case(libs: list[CpuKernels], rows: int, gen: torch.Generator) -> Case:
    shapes = [(3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    shapes = shapes * LAYERS + [(VOCAB, HIDDEN)]
    weights = [torch.randn(n, k, generator=gen).mul_(0.05).bfloat16() for n, k in shapes]
    packed = [libs[0].tile_pack(w) for w in weights]  # one layout for both (tested equal below)
    for lib in libs[1:]:
        if not all(
            torch.equal(lib.tile_pack(w), p) for w, p in zip(weights[:4], packed[:4], strict=True)
        ):
            raise SystemExit(
                "the two revisions pack weights differently; linear cannot be compared"
            )
    xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (HIDDEN, INTER)}
    flops = 2 * rows * sum(n * k for n, k in shapes)

    def calls(lib: CpuKernels) -> Callable[[], list[torch.Tensor]]:
        def call() -> list[torch.Tensor]:
            return [
                lib.tiled_linear(xs[k], p, None, n)
                for (n, k), p in zip(shapes, packed, strict=True)
            ]

        return call

    return calls, flops / 1e9, "GFLOP/s"


def int4_case(rows: int, gen: torch.Generator) -> Case:
    shapes = [(3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    shapes = shapes * LAYERS
    layers = []
    for n, k in shapes:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(n, k // INT4_GROUP, generator=gen) * 0.01).to(torch.float16)
        zeros = torch.randint(0, 16, (n, k // INT4_GROUP), dtype=torch.uint8, generator=gen)
        layers.append(pack_int4(q, scales, zeros))
    xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (HIDDEN, INTER)}
    flags = int4_flags(False, torch.uint8)
    flops = 2 * rows * sum(n * k for n, k in shapes)

    def calls(lib: CpuKernels) -> Callable[[], list[torch.Tensor]]:
        def call() -> list[torch.Tensor]:
            return [
                lib.int4_linear(xs[k], *layer, None, n, INT4_GROUP, flags)
                for (n, k), layer in zip(shapes, layers, strict=True)
            ]

        return call

    return calls, flops / 1e9, "GFLOP/s"


def _cache(num_blocks: int) -> KVCache:
    cache = KVCache(LAYERS, num_blocks, BLOCK, HEADS, HEAD_DIM, torch.bfloat16, "cpu")
    cache.tensor.normal_()
    return cache


def decode_case(seqs: int, tokens: int, gen: torch.Generator) -> Case:
    per_seq = (tokens + BLOCK - 1) // BLOCK
    cache = _cache(seqs * per_seq)
    tables = torch.randperm(seqs * per_seq, generator=gen).view(seqs, per_seq).int().contiguous()
    lens = torch.full((seqs,), tokens, dtype=torch.int32)
    query = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).bfloat16()
    scale = HEAD_DIM**-0.5

    def calls(lib: CpuKernels) -> Callable[[], list[torch.Tensor]]:
        def call() -> list[torch.Tensor]:
            return [lib.decode_attention(query, cache, i, tables, lens, scale, None)
                    for i in range(LAYERS)]  # fmt: skip

        return call

    kv_bytes = LAYERS * seqs * tokens * 2 * HEADS * HEAD_DIM * 2
    return calls, kv_bytes / 1e9, "GB/s"


def prefill_case(seqs: int, tokens: int, gen: torch.Generator) -> Case:
    per_seq = (tokens + BLOCK - 1) // BLOCK
    cache = _cache(seqs * per_seq)
    tables = torch.randperm(seqs * per_seq, generator=gen).view(seqs, per_seq).int().contiguous()
    chunks = PrefillChunks(
        q_starts=torch.arange(seqs, dtype=torch.int64) * tokens,
        q_lens=torch.full((seqs,), tokens, dtype=torch.int64),
        pasts=torch.zeros(seqs, dtype=torch.int64),
        block_tables=tables,
    )
    query = torch.randn(seqs * tokens, HEADS, HEAD_DIM, generator=gen).bfloat16()

    def calls(lib: CpuKernels) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            out = torch.zeros_like(query)
            lib.prefill_attention(query, out, cache, 0, chunks, HEAD_DIM**-0.5, None)
            return out

        return call

    causal_flops = seqs * HEADS * tokens * (tokens + 1) / 2 * HEAD_DIM * 2 * 2
    return calls, causal_flops / 1e9, "GFLOP/s"


def step_times(
    libs: list[CpuKernels], seqs: int, tokens: int, steps: int, model: str | None, seed: int
) -> tuple[float, float]:
    """Median decode step (seconds) with ``libs[0]`` and with ``libs[1]`` running the layer loop:
    ``seqs`` sequences of ``tokens`` random prompt tokens, ``steps`` steps in the order A B B A
    (each side as often early as late, so a steady drift and the growing contexts cancel).
    Exits with a message if a step failed a request (a library that cannot run the loop)."""
    engine = make_engine(
        llama_100m(model),
        dtype="bfloat16",
        max_model_len=tokens + steps + 8,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(seqs * tokens, 2048),
    )
    fast = engine.runner.fast_decoder
    if fast is None:
        raise SystemExit("step: no fast decode path here (it needs the tiled linear kernels)")
    params = greedy(steps + 4)
    for i, prompt in enumerate(random_prompts(engine.spec.vocab_size, seqs, tokens, seed)):
        engine.add_request(f"step-{i}", prompt, params)
    while engine.scheduler.num_waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()  # the prompts' prefill, then every sequence decodes
    before = {r.request_id: r.num_output_tokens for r in engine.scheduler.running}
    times: list[list[float]] = [[], []]
    for k in range(steps):
        side = (0, 1, 1, 0)[k % 4]
        fast.k = libs[side]
        t0 = time.perf_counter()
        engine.step()
        times[side].append(time.perf_counter() - t0)
        running = engine.scheduler.running
        if len(running) != seqs or any(
            r.num_output_tokens != before.get(r.request_id, -1) + k + 1 for r in running
        ):
            raise SystemExit(
                f"step: a decode step with library {'AB'[side]} failed its requests "
                "(see the log above); no timing"
            )
    fast.k = libs[0]
    return statistics.median(times[0]), statistics.median(times[1])


def run(args: argparse.Namespace) -> int:
    """``infer bench kernels``: ``kernels.json`` and ``kernels.md`` under ``--out``."""
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(
            f"unknown case(s) {', '.join(sorted(unknown))} (known: {', '.join(CASES)})"
        )
    compiler = find_compiler()
    if compiler is None:
        raise SystemExit("no C++ compiler: set $CXX or install g++")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        b_src = sources_at(args.against, Path(tmp))
        libs = [CpuKernels(ctypes.CDLL(str(build_library(compiler, src)))) for src in (CSRC, b_src)]
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[dict] = []
    plan: list[tuple[str, str, Callable[[], Case]]] = []
    for case in cases:
        if case == "step":
            continue  # after the others: it loads a model
        if case in ("linear", "int4"):
            for m in (int(x) for x in args.rows.split(",")):
                make_rows = (
                    (lambda m=m: linear_case(libs, m, gen))
                    if case == "linear"
                    else (lambda m=m: int4_case(m, gen))
                )
                plan.append((case, f"{m} rows", make_rows))
        else:
            sizes = parse_pairs(args.decode if case == "decode" else args.prefill)
            make = decode_case if case == "decode" else prefill_case
            for s, t in sizes:
                plan.append((case, f"{s} x {t}", lambda s=s, t=t, make=make: make(s, t, gen)))
    for case, size, make in plan:
        calls, work, unit = make()
        (ta, tb), (_, same) = side_by_side([calls(libs[0]), calls(libs[1])], args.repeats)
        row = {"case": case, "size": size, "a_ms": ta * 1e3, "b_ms": tb * 1e3,
               "b_over_a": tb / ta, "unit": unit, "a_rate": work / ta, "b_rate": work / tb,
               "same_bits": same}  # fmt: skip
        rows.append(row)
        print(_line(row), flush=True)
    if "step" in cases:
        if args.step_count < 4:
            raise SystemExit(f"--step-count {args.step_count}: at least 4 (A B B A)")
        for s, t in parse_pairs(args.step):
            ta, tb = step_times(libs, s, t, args.step_count, args.model, args.seed)
            row = {"case": "step", "size": f"{s} x {t}", "a_ms": ta * 1e3, "b_ms": tb * 1e3,
                   "b_over_a": tb / ta, "unit": "steps/s", "a_rate": 1 / ta, "b_rate": 1 / tb,
                   "same_bits": None}  # fmt: skip
            rows.append(row)
            print(_line(row), flush=True)
    report = {
        "schema": "infer.bench.kernels/1",
        "against": args.against,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "rows": rows,
    }
    (out / "kernels.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "kernels.md").write_text(render(report))
    print(f"report: {out / 'kernels.md'} (+ kernels.json)")
    return 0 if all(r["same_bits"] is not False for r in rows) else 1


def _line(r: dict) -> str:
    return (f"{r['case']:8s} {r['size']:>10s}: A {r['a_ms']:8.2f} ms ({r['a_rate']:6.1f} {r['unit']})"
            f"  B {r['b_ms']:8.2f} ms ({r['b_rate']:6.1f})  B/A {r['b_over_a']:.2f}"
            f"  {_bits(r['same_bits'], 'same bits', 'OUTPUTS DIFFER')}")  # fmt: skip


def _bits(same: bool | None, yes: str, no: str) -> str:
    return "not compared" if same is None else yes if same else no


def render(report: dict) -> str:
    lines = [
        f"# Kernels: this tree (A) vs `{report['against']}` (B)",
        "",
        f"One process, {report['threads']} threads, A and B taking turns; minimum of "
        f"{report['repeats']} turns each (``step``: the median of each side's steps).",
        "",
        "| case | size | A ms | B ms | B / A | A rate | B rate | outputs |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['case']} | {r['size']} | {r['a_ms']:.2f} | {r['b_ms']:.2f} | "
            f"{r['b_over_a']:.2f} | {r['a_rate']:.1f} {r['unit']} | {r['b_rate']:.1f} {r['unit']} | "
            f"{_bits(r['same_bits'], 'same bits', '**differ**')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    from infer.bench.cli import main

    sys.exit(main(["bench", "kernels", *sys.argv[1:]]))

"""The Triton paged decode attention kernel on one GPU: the ``kernels`` section of ``infer bench gpu``.

    infer bench gpu [--kernel-batches 16,64,256] [--kernel-contexts 512,2048,8192]
                    [--kernel-torch-contexts 512,2048] [--kernel-splits 1,2,4,8,16,32]
                    [--kernel-split-context 8192] [--kernel-reps 20] [--kernel-max-gb 20]
                    [--kernel-prefill 4x2048,1x8192] [--kernel-mixed 16x512+128,64x512+128]
                    [--kernel-gemv-rows 1,16] [--skip-kernels]

A kernel micro-benchmark: it lives beside the reports, outside the package (as
``benchmarks/kernels.py`` does). ``infer bench gpu`` (:mod:`infer.bench.gpu`) loads it from the
source checkout it runs from (:func:`infer.bench.cli.checkout_benchmark`): its section and its
table in ``gpu.md`` (the ``--kernel-*`` flags are ``infer bench gpu``'s); run outside a checkout, the GPU bench runs everything else and says
that this section needs one.

``infer.runner.gpu.triton_attention.paged_decode_attention`` on the model's heads at batch x
context, K/V bytes read per call against the measured read rate, today's torch path
(index_select gather + masked SDPA) beside it, and split-K at batch 1, 8k; then
``paged_prefill_attention`` on whole prompts under a few tile / warp configurations; a mixed
step's attention (decodes beside a prompt) with the decodes in the prefill tiles or through the
decode kernel; then the model's matmuls at decode's few rows (``infer.runner.gpu.triton_gemv``): cuBLAS and each skinny
kernel against the weights' read, and what a batch-1 step's matmuls would take with the best.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from infer.bench.gpu import _free, _ratio, ints, time_ms
from infer.bench.report import md_table, num

# Defaults of the list options: (full run, --quick). An explicit flag wins over both
# (:func:`infer.bench.gpu.resolve_args`).
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "kernel_batches": ("16,64,256", "16,256"),
    "kernel_contexts": ("512,2048,8192", "512,8192"),
    "kernel_torch_contexts": ("512,2048", "2048"),
    "kernel_splits": ("1,2,4,8,16,32", "1,4,16"),
    "kernel_reps": (20, 10),
    "kernel_prefill": ("4x2048,1x8192", "4x2048"),
    "kernel_mixed": ("16x512+128,64x512+128,64x2048+128,1x16384+511", "64x512+128,1x16384+511"),
    "kernel_gemv_rows": ("1,16", "1"),
}


def section(
    args: argparse.Namespace,
    model: dict,
    read_GBps: float | None,
    log: Callable[[str], None],
    res: dict,
) -> dict:
    """The ``kernels`` section of ``infer bench gpu`` on ``model``'s heads (its
    :func:`~infer.bench.gpu.describe_model`), block size 16; fills ``res``."""
    shape = {
        "heads": model["shape"]["num_attention_heads"],
        "kv_heads": model["shape"]["num_key_value_heads"],
        "head_dim": model["shape"]["head_dim"],
        "block_size": 16,
    }
    kernel_bench(args, shape, read_GBps, log, res=res)
    if ints(getattr(args, "kernel_gemv_rows", "") or ""):
        res["gemv"] = {}  # filled as each shape finishes: a run cut short keeps those
        gemv_sweep(args, model["shape"], read_GBps, log, res=res["gemv"])
    return res


def matmul_shapes(shape: dict) -> dict[str, tuple[int, int, int]]:
    """A Llama-shaped model's matmuls as the engine runs them (qkv and gate/up fused): name ->
    (N, K, how many a decode step runs)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    inter = shape["intermediate_size"]
    return {
        "qkv": (q + 2 * kv, h, layers),
        "o": (h, q, layers),
        "gate_up": (2 * inter, h, layers),
        "down": (h, inter, layers),
        "lm_head": (shape["vocab_size"], h, 1),
    }


def gemv_sweep(
    args: argparse.Namespace,
    shape: dict,
    read_GBps: float | None,
    log: Callable[[str], None],
    tg: Any = None,
    res: dict | None = None,
) -> dict:
    """cuBLAS and every skinny-matmul candidate (``triton_gemv.sweep``) on each of the model's
    matmul shapes at ``--kernel-gemv-rows`` rows, bf16, copies of the weight cycled through
    (up to 16, toward 256 MiB a shape on CUDA: several times the L2 cache, so reads come from
    memory); per row count, the sum over a decode step's matmuls with cuBLAS, with the faster
    of the two per shape, and the weights' read at ``read_GBps``. ``tg``: the kernel module
    (tests pass it); ``res`` is filled as the shapes finish."""
    if tg is None:
        tg = importlib.import_module("infer.runner.gpu.triton_gemv")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    min_bytes = 256 << 20 if device.type == "cuda" else 0
    res = {} if res is None else res
    res.update(rows=[], steps=[])
    for name, (n, k, count) in matmul_shapes(shape).items():
        nbytes = n * k * torch.tensor([], dtype=torch.bfloat16).element_size()
        copies = max(1, min(16, math.ceil(min_bytes / nbytes)))
        gen = torch.Generator(device=device).manual_seed(n * 31 + k)
        weights = [torch.randn(n, k, device=device, dtype=dtype, generator=gen) / k**0.5
                   for _ in range(copies)]  # fmt: skip
        for rows in ints(args.kernel_gemv_rows):
            row: dict[str, Any] = {"name": name, "n": n, "k": k, "rows": rows, "count": count,
                                   "bytes": nbytes}  # fmt: skip
            try:
                sw = tg.sweep(weights, rows)
            except Exception as e:  # noqa: BLE001 - one failed cell must not lose the rest
                row["error"] = f"{type(e).__name__}: {e}"[:200]
                log(f"kernel gemv {name} {n}x{k} @{rows}: FAILED {row['error']}")
                res["rows"].append(row)
                continue
            row.update(cublas_us=sw.cublas_us, failed=list(sw.failed),
                       candidates={str(c): us for c, us in sw.candidates})  # fmt: skip
            if sw.best is not None:
                row.update(best=str(sw.best[0]), best_us=sw.best[1])
            for key in ("cublas", "best"):
                us = row.get(f"{key}_us")
                if us and read_GBps:
                    row[f"{key}_pct_of_read"] = nbytes / (us * 1e3) / read_GBps
            res["rows"].append(row)
            best = f"; best {row['best']} {row['best_us']:.1f} us" if "best" in row else ""
            log(f"kernel gemv {name} {n}x{k} @{rows}: cuBLAS {sw.cublas_us:.1f} us{best}"
                + (f"; {len(sw.failed)} failed" if sw.failed else ""))  # fmt: skip
        del weights
        _free(device)
    for rows in ints(args.kernel_gemv_rows):
        cells = [r for r in res["rows"] if r["rows"] == rows and "cublas_us" in r]
        if len(cells) != len(matmul_shapes(shape)):
            continue
        step = {
            "rows": rows,
            "cublas_us": sum(r["count"] * r["cublas_us"] for r in cells),
            "picked_us": sum(
                r["count"] * min(r["cublas_us"], r.get("best_us", math.inf)) for r in cells
            ),  # fmt: skip
            "weights_bytes": sum(r["count"] * r["bytes"] for r in cells),
        }
        if read_GBps:
            step["read_us"] = step["weights_bytes"] / (read_GBps * 1e3)
        res["steps"].append(step)
    return res


def torch_decode_attention(q, k_cache, v_cache, gather, mask, scale):
    """Today's torch path on CUDA (``AttentionContext._attend_decode``): gather every context
    row with index_select, then masked SDPA. ``gather`` [R, L] slots; ``mask`` [R, 1, 1, L]."""
    import torch.nn.functional as F

    r, length = gather.shape
    ks = k_cache.index_select(0, gather.reshape(-1)).view(r, length, *k_cache.shape[1:])
    vs = v_cache.index_select(0, gather.reshape(-1)).view(r, length, *v_cache.shape[1:])
    o = F.scaled_dot_product_attention(
        q[:, :, None, :],
        ks.transpose(1, 2),
        vs.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[1],
    )
    return o[:, :, 0, :]


def _kernel_case(
    attn: Callable,
    r: int,
    length: int,
    shape: dict,
    device: torch.device,
    reps: int,
    splits: list[int],
    with_torch: bool,
    min_bytes: int,
    workspace: Callable | None = None,
) -> dict:
    """Time one batch x context: the kernel at each of ``splits``, and the torch path.

    The cache holds ``copies`` disjoint sets of shuffled blocks (``min_bytes`` of K/V in all)
    and consecutive calls cycle through them, so a small case reads HBM rather than L2; each
    sample is a CUDA graph of at least ``4 * min_bytes`` of reads (see :func:`time_ms`).
    ``workspace(rows, heads, dim, splits, device)``: split-K buffers made once, outside timing.
    """
    h, hkv, d, bs = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["block_size"]
    kv_bytes = r * length * hkv * d * 2 * 2
    copies = max(1, math.ceil(min_bytes / kv_bytes))
    inner = copies * max(1, math.ceil(4 * min_bytes / (copies * kv_bytes)))
    blocks_per_seq = math.ceil(length / bs)
    num_blocks = copies * r * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(r * 100003 + length)
    k_cache = torch.randn(
        num_blocks * bs, hkv, d, dtype=torch.bfloat16, device=device, generator=gen
    )
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = tables.view(copies, r, blocks_per_seq)
    q = torch.randn(r, h, d, dtype=torch.bfloat16, device=device, generator=gen)
    lens = torch.full((r,), length, dtype=torch.int32, device=device)
    scale = d**-0.5
    row: dict[str, Any] = {
        "batch": r,
        "context": length,
        "kv_bytes": kv_bytes,
        "copies": copies,
        "calls_per_sample": inner,
        "splits_ms": {},
    }
    outs: dict[int, torch.Tensor] = {}
    how: dict[str, str] = {}
    for split in splits:
        out = outs[split] = torch.empty_like(q)
        kw: dict[str, Any] = {"block_size": bs, "scale": scale, "num_splits": split, "out": out}
        if split > 1 and workspace is not None:
            kw["workspace"] = workspace(r, h, d, split, device)
        i = [0]

        def fn(kw: dict = kw, i: list = i) -> Any:
            c = i[0] % copies
            i[0] += 1
            return attn(q, k_cache, v_cache, tables[c], lens, **kw)

        ms = time_ms(fn, device, reps, inner=inner, graph=True, how=how)
        row["splits_ms"][str(split)] = statistics.median(ms)
        attn(q, k_cache, v_cache, tables[0], lens, **kw)  # this split's output of copy 0
    row["timing"] = how.get("timing")
    best = min(row["splits_ms"], key=row["splits_ms"].get)
    # The time of the split the engine picks for this batch (the first of ``splits``).
    row["ms"] = row["splits_ms"][str(splits[0])]
    row["splits"] = splits[0]
    row["best_split"], row["best_ms"] = int(best), row["splits_ms"][best]
    row["GBps"] = kv_bytes / (row["ms"] / 1000) / 1e9
    if len(outs) > 1:
        first = outs[splits[0]].float()
        row["split_max_abs_diff"] = max(
            (o.float() - first).abs().max().item() for o in outs.values()
        )
    if with_torch:
        offsets = torch.arange(bs, device=device)
        gathers = (tables.long()[..., None] * bs + offsets).flatten(2)[..., :length]
        mask = (torch.arange(length, device=device)[None, :] < lens[:, None].long())[:, None, None]
        j = [0]

        def torch_fn() -> Any:
            c = j[0] % copies
            j[0] += 1
            return torch_decode_attention(q, k_cache, v_cache, gathers[c], mask, scale)

        torch_how: dict[str, str] = {}
        ms = time_ms(torch_fn, device, reps, inner=inner, graph=True, how=torch_how)
        row["torch_ms"] = statistics.median(ms)
        row["torch_timing"] = torch_how.get("timing")
        row["torch_GBps"] = kv_bytes / (row["torch_ms"] / 1000) / 1e9
        want = torch_decode_attention(q, k_cache, v_cache, gathers[0], mask, scale).float()
        row["max_abs_err"] = (outs[splits[0]].float() - want).abs().max().item()
    return row


def _engine_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """The decode kernel's splits in an engine step of ``rows`` rows (its graph bucket's)."""
    try:
        from infer.runner.gpu.cuda_step import MAX_GRAPH_ROWS, decode_splits
        from infer.runner.gpu.graphs import bucket, capture_sizes
    except ImportError:
        return 1
    return decode_splits(bucket(capture_sizes(MAX_GRAPH_ROWS), rows) or rows, kv_heads, device)


def kernel_bench(
    args: argparse.Namespace,
    shape: dict,
    read_GBps: float | None,
    log: Callable[[str], None],
    attn: Callable | None = None,
    workspace: Callable | None = None,
    min_bytes: int | None = None,
    res: dict | None = None,
) -> dict:
    """The Triton paged decode attention kernel over batch x context, the torch path beside it
    on ``--kernel-torch-contexts``, and split-K at batch 1 (``attn``, ``workspace``: tests).
    ``min_bytes``: K/V cycled through per case (default 256 MiB on CUDA, 5x an H100's L2).
    ``res`` is filled as the cases finish."""
    res = {} if res is None else res
    real_kernels = attn is None  # (tests pass stand-ins: no prefill sweep then)
    if attn is None:
        try:
            ta = importlib.import_module("infer.runner.gpu.triton_attention")
        except ImportError as e:
            res["skipped"] = f"infer.runner.gpu.triton_attention is not importable: {e}"
            return res
        attn, workspace = ta.paged_decode_attention, getattr(ta, "decode_workspace", None)
    device = torch.device(args.device)
    res.update(shape=shape, rows=[], skipped_cases=[], failures=0)
    torch_ctx = set(ints(args.kernel_torch_contexts))
    if min_bytes is None:
        min_bytes = 256 << 20 if device.type == "cuda" else 64 << 10

    def case(r: int, length: int, splits: list[int], with_torch: bool) -> dict:
        return _kernel_case(attn, r, length, shape, device, args.kernel_reps, splits, with_torch,
                            min_bytes, workspace)  # fmt: skip

    for r in ints(args.kernel_batches):
        for length in ints(args.kernel_contexts):
            kv_bytes = r * length * shape["kv_heads"] * shape["head_dim"] * 4
            if kv_bytes > args.kernel_max_gb * 1e9:
                res["skipped_cases"].append(f"{r}x{length}: {kv_bytes / 1e9:.2f} GB of K/V")
                continue
            # As the engine runs it: the splits its decode step of r rows uses, and beside it
            # 1 and four times as many (up to 32): whether the engine's pick leaves speed over.
            engine_splits = _engine_splits(r, shape["kv_heads"], device)
            try:
                splits = list(dict.fromkeys([engine_splits, 1, min(32, 4 * engine_splits)]))
                row = case(r, length, splits, length in torch_ctx)
            except Exception as e:  # noqa: BLE001 - one failed cell must not lose the rest
                row = {"batch": r, "context": length, "error": f"{type(e).__name__}: {e}"}
                res["failures"] += 1
                log(f"kernel {r}x{length}: FAILED {row['error']}")
            else:
                if read_GBps:
                    row["pct_of_read"] = row["GBps"] / read_GBps
                torch_us = f", torch {1000 * row['torch_ms']:.1f} us" if "torch_ms" in row else ""
                log(
                    f"kernel {r}x{length}: {1000 * row['ms']:.1f} us, {row['GBps']:,.0f} GB/s"
                    f"{torch_us} ({row['timing']})"
                )
            res["rows"].append(row)
            _free(device)
    splits = ints(args.kernel_splits)
    if splits:
        length = args.kernel_split_context
        try:
            row = case(1, length, splits, False)
            one = row["splits_ms"].get("1")
            row["speedup"] = one / row["best_ms"] if one else None
            if read_GBps:
                row["best_pct_of_read"] = row["kv_bytes"] / (row["best_ms"] / 1e3) / 1e9 / read_GBps
            res["split"] = row
            times = ", ".join(f"{s}: {1000 * ms:.1f} us" for s, ms in row["splits_ms"].items())
            log(f"kernel split-K 1x{length}: {times}")
        except Exception as e:  # noqa: BLE001
            res["split"] = {"error": f"{type(e).__name__}: {e}"}
            res["failures"] += 1
            log(f"kernel split-K: FAILED {res['split']['error']}")
        _free(device)
    if real_kernels and getattr(args, "kernel_prefill", None):
        res["prefill"] = prefill_configs(args, shape, log)
    if real_kernels and getattr(args, "kernel_mixed", None):
        res["mixed"] = mixed_attention(args, shape, log)
    return res


PREFILL_CONFIGS = ((64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2))
"""(BLOCK_M, BLOCK_N, warps, stages) tried by :func:`prefill_configs`: compiled for sm_90 with
head_dim 128, the engine's 64 x 64 / 4 warps keeps ~1 KB a thread on the stack (spilled
registers; ``cuobjdump --dump-resource-usage``), 8 warps next to nothing."""


def prefill_configs(
    args: argparse.Namespace, shape: dict, log: Callable[[str], None], ta: Any = None
) -> dict:
    """``paged_prefill_attention`` on ``--kernel-prefill`` prompts (``SxL``: S prompts of L
    tokens, no past, block size 16, bf16) under each of :data:`PREFILL_CONFIGS`: ms and causal
    TFLOP/s per config, the engine's own config marked, each output's largest difference from
    the engine config's. ``ta``: the kernel module (tests pass a stand-in)."""
    if ta is None:
        ta = importlib.import_module("infer.runner.gpu.triton_attention")
    device = torch.device(args.device)
    h, hkv, d, bs = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["block_size"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine_config = ta._prefill_config(d, dtype)
    configs = list(dict.fromkeys([engine_config, *PREFILL_CONFIGS]))
    res: dict[str, Any] = {"engine_config": list(engine_config), "cases": []}
    for case in [c for c in args.kernel_prefill.split(",") if c]:
        seqs, length = (int(x) for x in case.split("x"))
        gen = torch.Generator(device=device).manual_seed(seqs * 7919 + length)
        blocks = seqs * math.ceil(length / bs)
        k_cache = torch.randn(blocks * bs, hkv, d, dtype=dtype, device=device, generator=gen)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(blocks, device=device, generator=gen).to(torch.int32)
        tables = tables.view(seqs, -1)
        q = torch.randn(seqs * length, h, d, dtype=dtype, device=device, generator=gen)
        qsl = torch.arange(0, seqs * length + 1, length, dtype=torch.int32, device=device)
        past = torch.zeros(seqs, dtype=torch.int32, device=device)
        flop = 4 * h * d * seqs * length * (length + 1) / 2  # QK^T and PV, causal
        row: dict[str, Any] = {"case": case, "configs": {}}
        outs = {}
        inputs = (q, k_cache, v_cache, tables, qsl, past, length)
        for config in configs:
            key = "x".join(map(str, config))
            out = outs[config] = torch.empty_like(q)

            def fn(out: torch.Tensor = out, inputs: tuple = inputs, config: tuple = config) -> Any:
                return ta.paged_prefill_attention(
                    *inputs, block_size=bs, scale=d**-0.5, out=out, config=config
                )

            try:
                ms = statistics.median(time_ms(fn, device, args.kernel_reps, graph=True))
                fn()
            except Exception as e:  # noqa: BLE001 - a config that does not run is reported
                row["configs"][key] = {"error": f"{type(e).__name__}: {e}"[:200]}
                continue
            row["configs"][key] = {"ms": ms, "TFLOPs": flop / (ms / 1000) / 1e12,
                                   "engine": config == engine_config}  # fmt: skip
        base = outs.get(engine_config)
        for config, out in outs.items():
            entry = row["configs"]["x".join(map(str, config))]
            if base is not None and "ms" in entry:
                entry["max_abs_diff"] = (out.float() - base.float()).abs().max().item()
        res["cases"].append(row)
        times = ", ".join(f"{k}: {v['ms']:.3f} ms" for k, v in row["configs"].items() if "ms" in v)
        log(f"kernel prefill {case}: {times}")
        _free(device)
    return res


MIXED_VARIANTS = {
    "grid": "grid kernel",
    "grid_decode": "decode kernel + grid",
    "tiles": "tiles",
    "tiles_decode": "decode kernel + tiles",
}
"""How :func:`mixed_attention` attends a mixed step: an eager step's grid-per-step prefill
kernel or a padded step's fixed-grid tiles, each with the decodes in it or through the decode
kernel first (``INFER_MIXED_DECODE_ROWS``, the default)."""


def mixed_attention(args: argparse.Namespace, shape: dict, log: Callable[[str], None]) -> dict:
    """A mixed step's attention on ``--kernel-mixed`` cases (``BxL+P``: B decodes at context L
    beside one fresh prompt of P tokens, block size 16) each way of :data:`MIXED_VARIANTS`:
    us of each, what the decode kernel buys on each prefill kernel, and the largest difference
    from the grid kernel's output."""
    device = torch.device(args.device)
    res: dict[str, Any] = {"cases": []}
    for case in [c for c in args.kernel_mixed.split(",") if c]:
        row: dict[str, Any] = {"case": case}
        try:
            row.update(_mixed_case(case, shape, device, args))
            times = ", ".join(f"{MIXED_VARIANTS[k]} {1000 * ms:.1f} us"
                              for k, ms in row["ms"].items())  # fmt: skip
            log(f"kernel mixed {case}: {times}")
        except Exception as e:  # noqa: BLE001 - one failed case must not lose the rest
            row["error"] = f"{type(e).__name__}: {e}"[:200]
            log(f"kernel mixed {case}: FAILED {row['error']}")
        res["cases"].append(row)
        _free(device)
    return res


def _mixed_case(case: str, shape: dict, device: torch.device, args: argparse.Namespace) -> dict:
    """One ``BxL+P`` case of :func:`mixed_attention`: the decodes' rows first, the prompt's
    after them; the decode kernel's list as the engine's: an eager step's one entry a decode,
    a padded step's ``min(token bucket, max_num_seqs)`` (the unused ones of context 0; over 512
    tokens the engine pads no step, and the tiles columns time what it would be), each split
    over the keys as a decode step of that many rows is."""
    from infer.runner.gpu import triton_attention as ta
    from infer.runner.gpu.cuda_step import MAX_MIXED_TOKENS, tile_programs
    from infer.runner.gpu.graphs import bucket, mixed_capture_sizes
    from infer.runner.gpu.step import prefill_tiles

    h, hkv, d, bs = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["block_size"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block_m = ta.prefill_block_m(d, dtype)

    b_l, p = case.split("+")
    b, length, prompt = *(int(x) for x in b_l.split("x")), int(p)
    qlens, pasts = [1] * b + [prompt], [length - 1] * b + [0]
    widths = [math.ceil((n + c) / bs) for n, c in zip(qlens, pasts, strict=True)]
    gen = torch.Generator(device=device).manual_seed(b * 7919 + length * 31 + prompt)
    k_cache = torch.randn(sum(widths) * bs, hkv, d, dtype=dtype, device=device, generator=gen)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(sum(widths), device=device, generator=gen).to(torch.int32)
    tables = torch.zeros(len(qlens), max(widths), dtype=torch.int32, device=device)
    for s, part in enumerate(perm.split(widths)):
        tables[s, : len(part)] = part
    t = sum(qlens)
    q = torch.randn(t, h, d, dtype=dtype, device=device, generator=gen)
    i32 = dict(dtype=torch.int32, device=device)
    starts = torch.tensor([0, *itertools.accumulate(qlens)], **i32)
    past = torch.tensor(pasts, **i32)
    programs = tile_programs((t // block_m + len(qlens)) * h, device)

    def tile_list(lens: list[int]) -> tuple[torch.Tensor, ...]:
        seq, index = prefill_tiles(lens, block_m)
        return (torch.tensor(seq, **i32), torch.tensor(index, **i32),
                torch.tensor([len(seq)], **i32))  # fmt: skip

    every_chunk, prompt_only = tile_list(qlens), tile_list([0] * b + [prompt])
    kw = dict(block_size=bs, scale=d**-0.5)
    outs = {k: torch.empty_like(q) for k in MIXED_VARIANTS}

    def decode_list(entries: int) -> dict:
        unused = [0] * (entries - b)
        splits = _engine_splits(entries, hkv, device)
        return dict(
            context_lens=torch.tensor([length] * b + unused, **i32),
            row_ids=torch.tensor([*range(b), *unused], **i32),
            row_tables=torch.tensor([*range(b), *unused], **i32),
            num_splits=splits,
            workspace=ta.decode_workspace(entries, h, d, splits, device) if splits > 1 else None,
        )

    padded = bucket(mixed_capture_sizes(MAX_MIXED_TOKENS), t) or t
    max_seqs = getattr(args, "max_num_seqs", 256)  # (infer bench gpu's engines')
    eager_list, graph_list = decode_list(b), decode_list(max(b, min(padded, max_seqs)))

    def decodes(out: torch.Tensor, lists: dict) -> None:
        ta.paged_decode_attention(q, k_cache, v_cache, tables, out=out, **lists, **kw)

    def grid(out: torch.Tensor, min_len: int) -> Any:
        return ta.paged_prefill_attention(q, k_cache, v_cache, tables, starts, past, prompt,
                                          out=out, min_query_len=min_len, **kw)  # fmt: skip

    def tiles(out: torch.Tensor, tile_lists: tuple) -> Any:
        return ta.paged_prefill_attention_tiles(q, k_cache, v_cache, tables, starts, past,
                                                *tile_lists, programs, out=out, **kw)  # fmt: skip

    def grid_decode() -> Any:
        decodes(outs["grid_decode"], eager_list)
        return grid(outs["grid_decode"], 2)

    def tiles_decode() -> Any:
        decodes(outs["tiles_decode"], graph_list)
        return tiles(outs["tiles_decode"], prompt_only)

    fns = {
        "grid": lambda: grid(outs["grid"], 1),
        "grid_decode": grid_decode,
        "tiles": lambda: tiles(outs["tiles"], every_chunk),
        "tiles_decode": tiles_decode,
    }
    row: dict[str, Any] = {"ms": {}}
    for key, fn in fns.items():
        row["ms"][key] = statistics.median(time_ms(fn, device, args.kernel_reps, graph=True))
        fn()
    ms = row["ms"]
    row["speedup"] = {"grid": ms["grid"] / ms["grid_decode"],
                      "tiles": ms["tiles"] / ms["tiles_decode"]}  # fmt: skip
    ref = outs["grid"].float()
    row["max_abs_diff"] = max((o.float() - ref).abs().max().item() for o in outs.values())
    return row


def markdown(kern: dict) -> list[str]:
    """The section's tables in ``gpu.md`` (``kern``: the report's ``kernels``)."""
    lines = ["", "## Decode attention kernel (Triton paged vs torch gather + SDPA)", ""]
    if "skipped" in kern:
        return lines + [f"Skipped: {kern['skipped']}"]
    sh = kern.get("shape", {})
    lines += [
        f"{sh.get('heads')} query / {sh.get('kv_heads')} KV heads of {sh.get('head_dim')}, "
        f"block size {sh.get('block_size')}, bf16. K/V bytes = batch x context x KV heads "
        "x dim x 2 B x 2. Median over samples, each a CUDA graph of calls cycling through "
        "copies of the cache (blocks shuffled) so reads miss L2.",
        "",
    ]
    rows: list[list[Any]] = []
    for row in kern.get("rows", []):
        if "error" in row:
            rows.append([row["batch"], row["context"], f"failed: {row['error'][:100]}"])
            continue
        t_ms, pct, one = (
            row.get("torch_ms"),
            row.get("pct_of_read"),
            row.get("splits_ms", {}).get("1"),
        )
        rows.append([
            row["batch"], row["context"], f"{row['kv_bytes'] / 1e6:,.1f}", row.get("splits", 1),
            f"{1000 * row['ms']:.1f}", num(None if one is None else 1000 * one, ".1f"),
            f"{row['GBps']:,.0f}", num(None if pct is None else 100 * pct, ".0f"),
            num(None if t_ms is None else 1000 * t_ms, ".1f"), num(row.get("torch_GBps"), ",.0f"),
            _ratio(t_ms, row["ms"]), num(row.get("max_abs_err"), ".2e"),
            f"{row['best_split']}: {1000 * row['best_ms']:.1f}" if "best_ms" in row else "-",
        ])  # fmt: skip
    lines += md_table("batch | context | K/V MB | splits | triton us | 1 split us | GB/s "
                      "| % of read | torch us | torch GB/s | triton speed-up "
                      "| max abs err vs torch | best splits: us", rows, "r" * 13)  # fmt: skip
    lines += [f"\nSkipped: {s}" for s in kern.get("skipped_cases", [])]
    split = kern.get("split", {})
    if "splits_ms" in split:
        one = split["splits_ms"].get("1")
        lines += ["", f"Split-K at batch 1, context {split['context']}:", ""]
        rows = [[s, f"{1000 * ms:.1f}", _ratio(one, ms)] for s, ms in split["splits_ms"].items()]
        lines += md_table("num_splits | us | speed-up vs 1", rows, "rrr")
    elif "error" in split:
        lines.append(f"\nSplit-K failed: {split['error']}")
    prefill = kern.get("prefill") or {}
    rows = []
    for case in prefill.get("cases", []):
        for key, c in case["configs"].items():
            if "error" in c:
                rows.append([case["case"], key, f"failed: {c['error'][:80]}", "", "", ""])
                continue
            rows.append([case["case"], key + (" (engine)" if c.get("engine") else ""),
                         f"{c['ms']:.3f}", f"{c['TFLOPs']:.0f}",
                         num(c.get("max_abs_diff"), ".2e"), ""])  # fmt: skip
    if rows:
        lines += ["", "Prefill kernel configurations (prompts x tokens, no past, causal):", ""]
        lines += md_table("prompts x tokens | BLOCK_M x BLOCK_N x warps x stages | ms | TFLOP/s "
                          "| max abs diff vs engine's |", rows, "llrrrl")  # fmt: skip
    lines += mixed_markdown(kern.get("mixed") or {})
    return lines + gemv_markdown(kern.get("gemv") or {})


def mixed_markdown(mixed: dict) -> list[str]:
    """The mixed-step attention table (:func:`mixed_attention`)."""
    rows = []
    for c in mixed.get("cases", []):
        if "error" in c:
            rows.append([c["case"], f"failed: {c['error'][:80]}", "", "", "", "", ""])
            continue
        rows.append([c["case"], *(f"{1000 * c['ms'][k]:.1f}" for k in MIXED_VARIANTS),
                     f"{c['speedup']['grid']:.2f}x / {c['speedup']['tiles']:.2f}x",
                     f"{c['max_abs_diff']:.2e}"])  # fmt: skip
    if not rows:
        return []
    head = " | ".join(f"{v} us" for v in MIXED_VARIANTS.values())
    return [
        "",
        "A mixed step's attention (B decodes at context L beside one fresh prompt of P tokens): "
        "an eager step's grid kernel or a padded step's tiles, the decodes in them or through "
        "the decode kernel first (`INFER_MIXED_DECODE_ROWS`, the default):",
        "",
        *md_table(
            f"decodes x context + prompt | {head} | decode kernel's speed-up (grid / tiles) "
            "| max abs diff",
            rows,
            "lrrrrrr",
        ),
    ]


def gemv_markdown(gemv: dict) -> list[str]:
    """The skinny-matmul table and the decode step's matmul sums (``gemv``: the report's
    ``kernels.gemv``)."""
    if not gemv.get("rows"):
        return []
    lines = ["", "## Decode matmuls at a few rows (cuBLAS vs the skinny Triton kernels)", "",
             "bf16 weights, copies cycled through so each call reads from memory; each time a "
             "CUDA graph of 24 calls. % of read: the weight's bytes at the measured read rate.",
             ""]  # fmt: skip
    rows = []
    for r in gemv["rows"]:
        head = [r["name"], f"{r['n']}x{r['k']}", r["rows"], f"{r['bytes'] / 1e6:,.1f}"]
        if "error" in r:
            rows.append(head + [f"failed: {r['error'][:80]}", "", "", "", "", ""])
            continue
        pct = {k: r.get(f"{k}_pct_of_read") for k in ("cublas", "best")}
        rows.append(head + [
            f"{r['cublas_us']:.1f}", num(None if pct["cublas"] is None else 100 * pct["cublas"],
                                         ".0f"),
            r.get("best", "-"), num(r.get("best_us"), ".1f"),
            num(None if pct["best"] is None else 100 * pct["best"], ".0f"),
            _ratio(r["cublas_us"], r.get("best_us")) + (f" ({len(r['failed'])} failed)"
                                                        if r["failed"] else ""),
        ])  # fmt: skip
    lines += md_table("matmul | N x K | rows | MB | cuBLAS us | % of read | best Triton "
                      "| us | % of read | speed-up", rows, "llrrrrlrrl")  # fmt: skip
    steps = [[s["rows"], f"{s['cublas_us']:.0f}", f"{s['picked_us']:.0f}",
              num(s.get("read_us"), ".0f"), _ratio(s["cublas_us"], s["picked_us"])]
             for s in gemv.get("steps", [])]  # fmt: skip
    if steps:
        lines += ["", "A decode step's matmuls (every layer's and the LM head), summed:", ""]
        lines += md_table("rows | cuBLAS us | faster of the two per shape, us | weights' read "
                          "us | speed-up", steps, "rrrrr")  # fmt: skip
    return lines

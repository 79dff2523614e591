"""CPU kernels in C++, compiled on first use and loaded with ctypes.

The sources (``csrc/*.cpp``: paged decode attention, the tiled linear layer) are plain C++ with
OpenMP and no torch headers, so they build with the system's ``g++`` (or ``$CXX``) and need
nothing at install time: ~20 s once per machine on 2 cores (a log line says so while it runs),
one compiler process per source file at a time per core. The shared library is cached under
``$INFER_KERNELS_DIR``, else ``$INFER_CACHE_DIR/kernels`` (default ``~/.cache/infer/kernels``;
a cache of its own keeps one build for every ``INFER_CACHE_DIR``), keyed by the sources, the
compiler and this CPU's instruction-set flags, and is linked against the same OpenMP runtime as
torch (``libgomp.so.1``, already loaded by torch), so both share one thread pool.

Where no compiler is found, or the build fails, or ``INFER_CPU_KERNELS=0`` is set, callers get
``None`` from :func:`cpu_kernels` and use their pure-torch path; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from infer.runner.cpu import hugepages
from infer.runner.kv_quant import KIND_CODES

T = TypeVar("T")

if TYPE_CHECKING:
    from infer.runner.attention import KVCache

logger = logging.getLogger("infer.runner")

CSRC = Path(__file__).parent / "csrc"
"""The kernel sources (``*.cpp``, ``*.h``) :func:`cpu_kernels` builds."""
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
ACT_MUL_CODES = {"silu": 0, "gelu_tanh": 1}
"""Activations :meth:`CpuKernels.act_mul` fuses, by the name :mod:`infer.model.layers` gives them."""


def kernels_dir() -> Path:
    """Where the built kernels are kept: ``$INFER_KERNELS_DIR``, else ``$INFER_CACHE_DIR/kernels``,
    else ``~/.cache/infer/kernels``."""
    if os.environ.get("INFER_KERNELS_DIR"):
        return Path(os.environ["INFER_KERNELS_DIR"]).expanduser()
    root = os.environ.get("INFER_CACHE_DIR") or Path.home() / ".cache" / "infer"
    return Path(root) / "kernels"


@cache
def cpu_flags_line() -> str:
    """This CPU's ``flags`` line of ``/proc/cpuinfo`` ("" where there is none): part of the
    kernels' cache key, and what the built-in models' training reads for bf16 in hardware."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_library(compiler: str, csrc: Path = CSRC) -> Path:
    """Compile the kernel sources of folder ``csrc`` (``*.cpp``, ``*.h``) into a shared library,
    or return the cached one built from the same sources, compiler and CPU flags. Each source's
    object is cached too (keyed by it, the headers, the compiler and the CPU flags): a copy of
    the sources with one file changed (``infer bench kernels`` against another revision, a
    kernel being worked on) compiles that file only."""
    # Each file read once: what is compiled is what the keys were made of (a file saved while
    # the build runs waits for the next build).
    snapshot = {p.name: p.read_bytes() for p in sorted([*csrc.glob("*.cpp"), *csrc.glob("*.h")])}
    sources = [name for name in snapshot if name.endswith(".cpp")]
    headers = b"".join(
        name.encode() + data for name, data in snapshot.items() if name.endswith(".h")
    )
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++17"]
    # The compiler's path too: a wrapper script that adds flags (-mno-avx512f, to test the AVX2
    # build) prints the same --version as the compiler it wraps.
    common = b"".join([headers, version.encode(), compiler.encode(), " ".join(flags).encode(),
                       cpu_flags_line().encode()])  # fmt: skip

    cache = kernels_dir()
    objects = {src: cache / "objects" / f"{Path(src).stem}_{_digest(snapshot[src] + common)}.o"
               for src in sources}  # fmt: skip
    key = _digest(b"".join(name.encode() + snapshot[name] for name in sources) + common)
    target = cache / f"infer_cpu_{key}.so"
    if target.exists():
        return target
    (cache / "objects").mkdir(parents=True, exist_ok=True)
    missing = [src for src in sources if not objects[src].exists()]
    jobs = max(1, min(len(missing), os.cpu_count() or 1))
    # NOTE: the first start on a machine waits for this (~20 s on 2 cores): say so.
    logger.info("compiling the C++ CPU kernels (%d of %d sources, %d at a time; once per "
                "source, compiler and CPU, cached in %s) ...", len(missing), len(sources), jobs,
                target.parent)  # fmt: skip
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmpdir:
        copy = Path(tmpdir) / "csrc"
        copy.mkdir()
        for name, data in snapshot.items():
            (copy / name).write_bytes(data)

        # One object per source, compiled in parallel (the largest file alone takes most of the
        # time), each written under a temporary name and renamed, then one link into a
        # temporary name and a rename: concurrent processes never see half an object or half
        # a library.
        def compile_one(src: str) -> None:
            obj = Path(tmpdir) / (Path(src).stem + ".o")
            _run([compiler, *flags, "-c", str(copy / src), "-o", str(obj)])
            os.replace(obj, objects[src])

        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(compile_one, missing))
        tmp = Path(tmpdir) / "lib.so"
        _run([compiler, "-shared", "-fopenmp", *(str(objects[s]) for s in sources), "-o", str(tmp)])
        os.replace(tmp, target)
    logger.info("compiled the C++ CPU kernels in %.1fs", time.perf_counter() - t0)
    return target


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")


class LinearArgs(ctypes.Structure):
    """One packed linear layer, as csrc/decode_layers.cpp's ``InferLinear``."""

    _fields_ = [("weight", ctypes.c_void_p), ("weight_bytes", ctypes.c_int64),
                ("col_scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("colsum", ctypes.c_void_p), ("group_scales", ctypes.c_void_p),
                ("group_zeros", ctypes.c_void_p), ("group_size", ctypes.c_int64),
                ("int4_flags", ctypes.c_int64)]  # fmt: skip


class LoRAArgs(ctypes.Structure):
    """One projection's LoRA slots, as csrc/kernels.h's ``InferLoRA``."""

    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("rank", ctypes.c_void_p), ("part_off", ctypes.c_void_p),
                ("num_parts", ctypes.c_int64), ("max_rank", ctypes.c_int64)]  # fmt: skip


class LoRAStepArgs(ctypes.Structure):
    """A step's adapter rows grouped by slot, as ``InferLoRAStep``."""

    _fields_ = [("rows", ctypes.c_void_p), ("group_slot", ctypes.c_void_p),
                ("group_start", ctypes.c_void_p), ("group_len", ctypes.c_void_p),
                ("num_groups", ctypes.c_int64)]  # fmt: skip


class DecodeLayer(ctypes.Structure):
    """One decoder layer's weights and cache, as ``InferDecodeLayer``."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
                ("qkv", LinearArgs), ("o", LinearArgs), ("gate_up", LinearArgs),
                ("down", LinearArgs), ("scale", ctypes.c_float), ("window", ctypes.c_int64),
                ("key_cache", ctypes.c_void_p), ("value_cache", ctypes.c_void_p),
                ("key_scales", ctypes.c_void_p), ("value_scales", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("moe", ctypes.c_void_p), ("lora", ctypes.c_void_p * 4)]  # fmt: skip


class MoEArgs(ctypes.Structure):
    """A mixture-of-experts layer's weights, as csrc/kernels.h's ``InferMoE``."""

    _fields_ = [("router", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("num_experts", ctypes.c_int64),
                ("top_k", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("norm_topk", ctypes.c_int64), ("float32_weights", ctypes.c_int64),
                ("shared_gate_up", ctypes.c_void_p), ("shared_down", ctypes.c_void_p),
                ("shared_inter", ctypes.c_int64), ("shared_gate", ctypes.c_void_p),
                ("expert_rows", ctypes.c_void_p)]  # fmt: skip


class DecodeModel(ctypes.Structure):
    """The model's shapes and the step buffers, as ``InferDecodeModel``."""

    _fields_ = [*((name, ctypes.c_int64) for name in ("hidden", "inter", "qkv_n", "num_heads",
                                                      "num_kv_heads", "head_dim", "block_size")),
                ("eps", ctypes.c_float), ("act", ctypes.c_int), ("kv_kind", ctypes.c_int),
                *((name, ctypes.c_void_p) for name in ("x", "normed", "qkv", "attn", "o",
                                                       "gate_up", "act_out", "down")),
                ("lora_step", ctypes.c_void_p)]  # fmt: skip


class CpuKernels:
    """Typed wrappers over the compiled library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, f32, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p

        def bind(name: str, *argtypes: Any) -> Any:
            fn = getattr(lib, name)
            fn.argtypes = list(argtypes)
            fn.restype = ctypes.c_int
            return fn

        self._decode = bind(
            "infer_decode_attention", i32, i32, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
            i64, i64, i64, i64, i64, i64, f32, i64, i32,
        )  # fmt: skip
        # 2: AMX, 1: AVX-512 BF16, 3: AVX2 FMA (bf16 weights only), 0: no tiled linear kernel
        # on this CPU.
        self.linear_kind = int(bind("infer_packed_linear_kind")())
        self.has_amx = self.linear_kind == 2
        # int8 weights: AMX, or AVX-512 BF16 with VBMI's byte tables
        self.linear_int8 = bool(bind("infer_packed_linear_int8")())
        self._pack = bind("infer_tile_pack_weight", ptr, ptr, i64, i64)
        self.has_w8a8 = bool(bind("infer_w8a8_supported")())
        self._w8a8_pack = bind("infer_w8a8_pack", ptr, ptr, ptr, i64, i64)
        self._w8a8_linear = bind(
            "infer_w8a8_linear", ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32
        )
        int4_kinds = int(bind("infer_int4_supported")())
        self.has_int4 = bool(int4_kinds & 1)  # 4-bit weights x bf16: AVX-512 BF16 or AVX2
        self.has_w4a8 = bool(int4_kinds & 2)  # 4-bit weights x int8: AVX-512 VNNI
        self._int4_linear = bind(
            "infer_int4_linear", ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32, i32
        )
        self._pack_int8 = bind("infer_tile_pack_int8", ptr, ptr, i64, i64)
        self._linear = bind(
            "infer_tiled_linear", ptr, ptr, i32, ptr, ptr, ptr, i64, i64, i64, i32, i32
        )
        self._add_rms_norm = bind("infer_add_rms_norm", ptr, ptr, ptr, ptr, ptr, i64, i64, f32, i32)
        self._rope_write_kv = bind(
            "infer_rope_write_kv", ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, ptr,
            i64, i64, i64, i64, i64, i32,
        )  # fmt: skip
        self._store_kv = bind(
            "infer_store_kv", i32, i32, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr,
            i64, i64, i64, i32,
        )  # fmt: skip
        self._act_mul = bind("infer_act_mul", ptr, ptr, i64, i64, i32, i32)
        self._argmax_rows = bind("infer_argmax_rows", ptr, ptr, i64, i64, i32)
        self._prefill = bind(
            "infer_prefill_attention", ptr, i64, i32, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr,
            ptr, ptr, i64, i64, i64, i64, i64, i64, f32, i64, i32,
        )  # fmt: skip
        self.has_prefill_attention = bool(bind("infer_prefill_attention_available")())
        self._encoder_attention = bind(
            "infer_encoder_attention", ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr,
            i64, ptr, i64, i64, i64, i64, i64, f32, i32,
        )  # fmt: skip
        self._moe = bind("infer_moe", ptr, ptr, ptr, i64, i64, i32, i32)
        self._qk_norm = bind("infer_qk_norm", ptr, i64, i64, i64, i64, i64, ptr, ptr, f32, i32)
        self._decode_layers = bind(
            "infer_decode_layers", ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i32
        )
        self._lora_apply = bind(
            "infer_lora_apply", ptr, i64, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64,
            ptr, ptr, ptr, ptr, i64, i32,
        )  # fmt: skip

    # ---- calls by address: the one place each C signature is spelled out. The tensor methods
    # below and runner/cpu/decode_fast.py (which passes addresses it computed once) both use them.
    def add_rms_norm_into(self, x: int, h: int | None, weight: int, residual_out: int | None,
                          out: int, rows: int, dim: int, eps: float) -> None:  # fmt: skip
        self._add_rms_norm(x, h, weight, residual_out, out, rows, dim, eps, torch.get_num_threads())

    def rope_write_kv_into(self, qkv: int, cos: int, sin: int, kind: int, k_cache: int,
                           v_cache: int, k_scales: int | None, v_scales: int | None, slots: int,
                           tokens: int, row_stride: int, num_heads: int, num_kv_heads: int,
                           head_dim: int) -> None:  # fmt: skip
        rc = self._rope_write_kv(qkv, cos, sin, kind, k_cache, v_cache, k_scales, v_scales, slots,
                                 tokens, row_stride, num_heads, num_kv_heads, head_dim,
                                 torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"rope kernel rejected head_dim={head_dim} (code {rc})")

    def act_mul_into(self, gate_up: int, out: int, rows: int, inter: int, act: int) -> None:
        rc = self._act_mul(gate_up, out, rows, inter, act, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"act_mul kernel rejected activation code {act}")

    def linear_into(self, x: int, weight: int, weight_bytes: int, scales: int | None,
                    bias: int | None, y: int, m: int, k: int, n: int,
                    colsum: int | None = None, group_scales: int | None = None,
                    group_zeros: int | None = None, group_size: int = 0,
                    int4_flags: int = 0) -> None:  # fmt: skip
        """The tiled linear kernel on raw pointers; with ``colsum``, the w8a8 one; with a
        ``group_size``, the 4-bit one."""
        threads = torch.get_num_threads()
        if group_size:
            rc = self._int4_linear(x, weight, group_scales, group_zeros, bias, y, m, k, n,
                                   group_size, int4_flags, 0, threads)  # fmt: skip
        elif colsum is not None:
            rc = self._w8a8_linear(x, weight, colsum, scales, bias, y, m, k, n, 0, threads)
        else:
            rc = self._linear(x, weight, weight_bytes, scales, bias, y, m, k, n, 0, threads)
        if rc != 0:
            raise ValueError(f"tiled linear kernel rejected its inputs (code {rc})")

    def moe_into(self, args: MoEArgs, x: int, out: int, rows: int, hidden: int, act: int) -> None:
        """A mixture-of-experts layer (csrc/moe.cpp) over ``rows`` bf16 rows of ``x``."""
        rc = self._moe(ctypes.addressof(args), x, out, rows, hidden, act, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"mixture-of-experts kernel failed (code {rc})")

    def qk_norm_into(self, qkv: int, row_stride: int, rows: int, num_heads: int,
                     num_kv_heads: int, head_dim: int, q_norm: int, k_norm: int,
                     eps: float) -> None:  # fmt: skip
        """Qwen 3's per-head RMSNorms of q and k, in place in a bf16 qkv row."""
        rc = self._qk_norm(qkv, row_stride, rows, num_heads, num_kv_heads, head_dim, q_norm,
                           k_norm, eps, torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"q/k norm kernel failed (code {rc})")

    def decode_attention_into(self, dtype: int, kind: int, query: int, q_stride: int,
                              k_cache: int, v_cache: int, k_scales: int | None,
                              v_scales: int | None, out: int, block_tables: int,
                              context_lens: int, batch: int, num_heads: int, num_kv_heads: int,
                              head_dim: int, block_size: int, max_blocks: int, scale: float,
                              window: int) -> None:  # fmt: skip
        rc = self._decode(dtype, kind, query, q_stride, k_cache, v_cache, k_scales, v_scales, out,
                          block_tables, context_lens, batch, num_heads, num_kv_heads, head_dim,
                          block_size, max_blocks, scale, window, torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"decode attention kernel rejected its inputs (code {rc})")

    def decode_layers_into(self, layers: ctypes.Array, num_layers: int, model: DecodeModel,
                           rows: int, cos: int, sin: int, slots: int, block_tables: int,
                           context_lens: int, max_blocks: int) -> None:  # fmt: skip
        """Every decoder layer of an all-decode step in one call: see csrc/decode_layers.cpp."""
        rc = self._decode_layers(ctypes.addressof(layers), num_layers, ctypes.addressof(model),
                                 rows, cos, sin, slots, block_tables, context_lens, max_blocks,
                                 torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"decode layer {rc // 100 - 1} failed in a kernel (code {rc % 100})")

    def lora_into(self, x: int, x_stride: int, y: int, y_stride: int, k: int, n: int,
                  lora: LoRAArgs, step: LoRAStepArgs) -> None:  # fmt: skip
        """:meth:`lora_apply` on raw pointers and the structures the fused decode loop takes."""
        rc = self._lora_apply(x, x_stride, y, y_stride, k, n, lora.a, lora.bt, lora.scale,
                              lora.rank, lora.part_off, lora.num_parts, lora.max_rank, step.rows,
                              step.group_slot, step.group_start, step.group_len, step.num_groups,
                              torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"LoRA kernel rejected its inputs (code {rc})")

    def lora_apply(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                   scale: torch.Tensor, rank: torch.Tensor, part_off: torch.Tensor,
                   rows: torch.Tensor, groups: torch.Tensor) -> None:  # fmt: skip
        """Add each row's LoRA update to ``y`` in place (csrc/lora.cpp has the layouts).

        ``x [T, K]``, ``y [T, N]`` bf16 with unit column stride; ``a [S, P, ceil(K/2), R, 2]``
        (``R`` a multiple of 16), ``bt [S, ceil(N/16), R, 16]`` bf16; ``scale`` float32 and ``rank`` int32
        ``[S, P]``; ``part_off`` int64 ``[P+1]``; ``rows`` int64: the step's adapter rows
        grouped by slot; ``groups`` int64 ``[3, G]``: each group's slot, first index into
        ``rows`` and length."""
        p, r = a.shape[1], a.shape[3]
        g = groups.shape[1]
        rc = self._lora_apply(
            x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[1], y.shape[1],
            a.data_ptr(),
            bt.data_ptr(), scale.data_ptr(), rank.data_ptr(), part_off.data_ptr(), p, r,
            rows.data_ptr(), groups[0].data_ptr(), groups[1].data_ptr(), groups[2].data_ptr(), g,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"LoRA kernel rejected its inputs (code {rc})")

    # ---- fused element-wise steps (bfloat16, contiguous rows) --------------------------------
    def add_rms_norm(
        self, x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = x + h`` (``x`` when ``h`` is None) and ``weight * residual / rms``.

        ``x, h``: ``[rows, dim]`` contiguous bf16; returns ``(residual, normed)``."""
        rows, dim = x.shape
        out = torch.empty_like(x)
        residual = x if h is None else torch.empty_like(x)
        self.add_rms_norm_into(
            x.data_ptr(),
            None if h is None else h.data_ptr(),
            weight.data_ptr(),
            None if h is None else residual.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
        )
        return residual, out

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        layer_idx: int,
        slots: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        """Rotate the q and k heads of bf16 ``qkv`` ``[T, >= (H + 2 Hkv) D]`` in place and store
        k, v at ``slots`` (int64 ``[T]``) of one layer of ``cache`` (bf16, or quantized).
        ``cos, sin``: ``[T, D]`` contiguous, ``sin``'s first half negated."""
        k_cache, v_cache = cache.layer(layer_idx)
        k_scales, v_scales = cache.layer_scales(layer_idx)
        self.rope_write_kv_into(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            KIND_CODES[cache.kind],
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            _ptr(k_scales),
            _ptr(v_scales),
            slots.data_ptr(),
            qkv.shape[0],
            qkv.stride(0),
            num_heads,
            num_kv_heads,
            head_dim,
        )

    def can_store_kv(self, k: torch.Tensor, cache: KVCache) -> bool:
        """Whether :meth:`store_kv` takes this step's ``k`` for ``cache``."""
        return k.dtype in _DTYPE_CODES and k.dtype == cache.dtype and k.shape[-1] <= 512

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer_idx: int, slots: torch.Tensor
    ) -> None:
        """Store ``k, v`` ``[T, Hkv, D]`` (rows may be strided) at ``slots`` of one layer of
        ``cache``: copied, or quantized with a scale per row."""
        if k.stride(-1) != 1 or k.stride(-2) != k.shape[-1]:
            k = k.contiguous()
        if v.stride(-1) != 1 or v.stride(-2) != v.shape[-1]:
            v = v.contiguous()
        k_cache, v_cache = cache.layer(layer_idx)
        k_scales, v_scales = cache.layer_scales(layer_idx)
        rc = self._store_kv(
            _DTYPE_CODES[k.dtype],
            KIND_CODES[cache.kind],
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            _ptr(k_scales),
            _ptr(v_scales),
            slots.data_ptr(),
            k.shape[0],
            k.shape[1],
            k.shape[2],
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"KV store kernel rejected its inputs (code {rc})")

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """``act(gate) * up`` for ``gate_up`` ``[rows, 2 I]`` contiguous bf16 -> ``[rows, I]``."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self.act_mul_into(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, ACT_MUL_CODES[activation]
        )
        return out

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """First index of each row's maximum of ``[rows, cols]`` contiguous float32 (as
        ``torch.argmax``: NaN counts as the maximum)."""
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.long)
        self._argmax_rows(logits.data_ptr(), out.data_ptr(), rows, cols, torch.get_num_threads())
        return out

    def tiled_linear_supports(self, weight: torch.Tensor) -> bool:
        """Whether the tiled linear kernel takes this ``[N, K]`` weight (N % 16, K % 32): bf16
        with AMX, AVX-512 BF16 or AVX2; int8 with AMX or AVX-512 BF16 and VBMI."""
        n, k = weight.shape
        if weight.dtype == torch.int8:
            ok_dtype = self.linear_int8
        else:
            ok_dtype = weight.dtype == torch.bfloat16 and self.linear_kind >= 1
        return ok_dtype and n % 16 == 0 and k % 32 == 0

    def tile_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` bf16 or int8 weight -> the tile layout :meth:`tiled_linear` streams (a flat
        copy of the same dtype)."""
        w = weight.detach().contiguous()
        packed = hugepages.empty(w.numel(), dtype=w.dtype)
        pack = self._pack_int8 if w.dtype == torch.int8 else self._pack
        rc = pack(w.data_ptr(), packed.data_ptr(), w.shape[0], w.shape[1])
        if rc != 0:
            raise ValueError(f"cannot pack a {tuple(w.shape)} weight in tiles (code {rc})")
        return packed

    def tiled_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
        scales: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """``(x @ W^T) * scales + bias`` for ``x`` ``[M, K]`` contiguous bf16 and ``packed``
        from :meth:`tile_pack` (bf16; or int8 with float32 ``scales`` ``[N]``, one per output
        channel); ``bias`` float32 ``[N]`` or None. Returns ``[M, N]`` bf16 (or float32, the
        sums unrounded)."""
        m, k = x.shape
        out = torch.empty(m, out_features, dtype=out_dtype)
        rc = self._linear(x.data_ptr(), packed.data_ptr(), packed.element_size(), _ptr(scales),
                          _ptr(bias), out.data_ptr(), m, k, out_features,
                          int(out_dtype == torch.float32), torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"tiled linear kernel rejected its inputs (code {rc})")
        return out

    def w8a8_pack(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, K]`` int8 weight -> (the layout :meth:`w8a8_linear` streams, int32 column sums)."""
        q = q.detach().contiguous()
        packed = hugepages.empty(q.numel(), dtype=torch.int8)
        colsum = torch.empty(q.shape[0], dtype=torch.int32)
        rc = self._w8a8_pack(q.data_ptr(), packed.data_ptr(), colsum.data_ptr(), *q.shape)
        if rc != 0:
            raise ValueError(f"cannot pack a {tuple(q.shape)} weight for w8a8 (code {rc})")
        return packed, colsum

    def w8a8_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        colsum: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """``x`` ``[M, K]`` contiguous bf16, each row quantized to int8 (absmax / 127), times the
        packed int8 weight; ``* row scale * scales + bias`` (float32 ``[N]``). bf16 or float32."""
        m, k = x.shape
        out = torch.empty(m, out_features, dtype=out_dtype)
        rc = self._w8a8_linear(x.data_ptr(), packed.data_ptr(), colsum.data_ptr(),
                               scales.data_ptr(), _ptr(bias), out.data_ptr(), m, k, out_features,
                               int(out_dtype == torch.float32), torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"w8a8 linear kernel rejected its inputs (code {rc})")
        return out

    def int4_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
        group_size: int,
        flags: int,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """``x`` ``[M, K]`` contiguous bf16 times a 4-bit weight from
        :func:`infer.runner.int4.pack_int4` (its float16 ``scales`` and uint8 or float16
        ``zeros`` per group and output; with ``INT4_KQUANT`` / ``INT4_Q6K``, records from
        :func:`~infer.runner.int4.pack_kquant` / :func:`~infer.runner.int4.pack_q6k` as the
        scales, ``group_size`` then the activations' group), ``+ bias`` (float32 ``[N]``);
        ``flags``: :func:`int4_flags` (with ``INT4_W4A8``, each row's groups quantized to int8
        as the layer runs)."""
        m, k = x.shape
        out = torch.empty(m, out_features, dtype=out_dtype)
        rc = self._int4_linear(x.data_ptr(), packed.data_ptr(), scales.data_ptr(),
                               zeros.data_ptr(), _ptr(bias), out.data_ptr(), m, k, out_features,
                               group_size, flags, int(out_dtype == torch.float32),
                               torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise ValueError(f"int4 linear kernel rejected its inputs (code {rc})")
        return out

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPE_CODES

    def decode_attention(
        self,
        query: torch.Tensor,
        cache: KVCache,
        layer_idx: int,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """Attention of one query per sequence to its paged context in one layer of ``cache``
        (the query's dtype, or int8 / fp8 with scales).

        Args:
            query: ``[B, H, D]`` float32 or bfloat16 (the cache's ``dtype``), heads contiguous
                within a sequence's row (rows may be strided, e.g. views of a fused qkv).
            block_tables: ``[B, max_blocks]`` int32 (unused tail entries are never read).
            context_lens: ``[B]`` int32, keys per sequence including the query's own.
            window: sliding window (keys ``p - window < j <= p``), or None.

        Returns:
            ``[B, H, D]`` in the query's dtype.
        """
        b, h, d = query.shape
        if query.stride(2) != 1 or query.stride(1) != d:
            query = query.contiguous()
        key_cache, value_cache = cache.layer(layer_idx)
        k_scales, v_scales = cache.layer_scales(layer_idx)
        out = torch.empty(b, h, d, dtype=query.dtype)
        self.decode_attention_into(
            _DTYPE_CODES[query.dtype],
            KIND_CODES[cache.kind],
            query.data_ptr(),
            query.stride(0),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            _ptr(k_scales),
            _ptr(v_scales),
            out.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            b,
            h,
            key_cache.shape[1],
            d,
            cache.block_size,
            block_tables.shape[1],
            scale,
            window or 0,
        )
        return out

    def can_attend_encoder(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether :meth:`encoder_attention` takes these: the prefill kernel's CPUs, bf16, heads
        contiguous within each row, ``head_dim`` a multiple of 32 up to 256."""
        d = q.shape[-1]
        return (
            self.has_prefill_attention
            and all(t.dtype == torch.bfloat16 and t.stride(2) == 1 and t.stride(1) == d
                    for t in (q, k, v))
            and d % 32 == 0
            and d <= 256
        )  # fmt: skip

    def encoder_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        starts: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        window: int | None = None,
        distance_bias: torch.Tensor | None = None,
        key_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """An encoder's attention (csrc/prefill_attention.cpp ``infer_encoder_attention``):
        sequence i's rows ``starts[i] .. starts[i] + lens[i] - 1`` of ``q`` ``[T, H, D]``
        attend to all of its rows of ``k, v`` ``[T, Hkv, D]`` (bf16; rows may be strided, as
        views of a fused projection are) -> ``[T, H, D]``; ``starts``, ``lens``: int64;
        ``window``: only the keys at most that many rows away on either side;
        ``distance_bias`` ``[H, 2R + 1]``: entry ``(j - i) + R`` of a head's row added to
        the scaled score of key j for query i (:meth:`AttentionContext.attend_bidirectional`);
        ``key_lens``: only each sequence's first ``key_lens[i]`` rows are keys."""
        out = torch.empty(q.shape, dtype=q.dtype)
        starts64 = starts.to(torch.int64).contiguous()
        lens64 = lens.to(torch.int64).contiguous()
        keys64 = None if key_lens is None else key_lens.to(torch.int64).contiguous()
        if keys64 is not None and not bool(((keys64 >= 1) & (keys64 <= lens64)).all()):
            raise ValueError(f"key_lens {keys64.tolist()} must be 1 .. each input's rows "
                             f"{lens64.tolist()}")  # fmt: skip
        bias = None if distance_bias is None else distance_bias.float().contiguous()
        if bias is not None and (
            bias.dim() != 2 or bias.shape[0] != q.shape[1] or bias.shape[1] % 2 == 0
            or int(lens64.max()) > bias.shape[1] // 2 + 1
        ):  # fmt: skip
            raise ValueError(f"a distance bias {tuple(bias.shape)} does not fit {q.shape[1]} "
                             f"heads and inputs of up to {int(lens64.max())} rows: it must be "
                             "[heads, 2R + 1], R at least the longest input's rows - 1")  # fmt: skip
        rc = self._encoder_attention(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            out.data_ptr(), out.stride(0), starts64.data_ptr(), lens64.data_ptr(),
            0 if keys64 is None else keys64.data_ptr(), window or 0,
            0 if bias is None else bias.data_ptr(), 0 if bias is None else bias.shape[1] // 2,
            len(lens64), q.shape[1],
            k.shape[1], q.shape[2], scale, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"encoder attention kernel rejected its inputs (code {rc})")
        return out

    def can_prefill(self, query: torch.Tensor, cache: KVCache) -> bool:
        """Whether :meth:`prefill_attention` takes this query over ``cache``: AVX-512 BF16 or AVX2,
        bf16 query and cache (or an int8 / fp8 cache read as bf16), ``head_dim`` a multiple of
        32 up to 256."""
        d = query.shape[-1]
        return (
            self.has_prefill_attention
            and query.dtype == torch.bfloat16
            and cache.dtype == torch.bfloat16
            and d % 32 == 0
            and d <= 256
        )

    def prefill_attention(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        cache: KVCache,
        layer_idx: int,
        chunks: PrefillChunks,
        scale: float,
        window: int | None,
    ) -> None:
        """Causal attention of the prompt chunks' query rows to their paged contexts (their
        own K and V already stored), written into those rows of ``out``.

        Args:
            query: ``[T, H, D]`` bf16 (rows may be strided, heads contiguous within a row).
            out: ``[T, H, D]`` bf16, same layout rules; rows of other tokens are left alone.
            chunks: which rows, at which positions, over which block tables.
        """
        _, h, d = query.shape
        if query.stride(2) != 1 or query.stride(1) != d:
            query = query.contiguous()
        assert out.stride(2) == 1 and out.stride(1) == d
        key_cache, value_cache = cache.layer(layer_idx)
        k_scales, v_scales = cache.layer_scales(layer_idx)
        rc = self._prefill(
            query.data_ptr(),
            query.stride(0),
            KIND_CODES[cache.kind],
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            _ptr(k_scales),
            _ptr(v_scales),
            out.data_ptr(),
            out.stride(0),
            chunks.block_tables.data_ptr(),
            chunks.q_starts.data_ptr(),
            chunks.q_lens.data_ptr(),
            chunks.pasts.data_ptr(),
            chunks.q_starts.shape[0],
            h,
            key_cache.shape[1],
            d,
            cache.block_size,
            chunks.block_tables.shape[1],
            scale,
            window or 0,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"prefill attention kernel rejected its inputs (code {rc})")


@dataclass(frozen=True)
class PrefillChunks:
    """The prompt chunks of a step, for :meth:`CpuKernels.prefill_attention`: chunk ``i`` is
    query rows ``q_starts[i] .. q_starts[i] + q_lens[i] - 1`` at positions ``pasts[i] ..``, over
    the blocks of ``block_tables[i]``."""

    q_starts: torch.Tensor  # [P] int64
    q_lens: torch.Tensor  # [P] int64
    pasts: torch.Tensor  # [P] int64
    block_tables: torch.Tensor  # [P, max_blocks] int32, contiguous


# infer_int4_linear's flags (csrc/kernels.h)
INT4_W4A8, INT4_HALF_ZEROS, INT4_PLANES_SHIFT, INT4_KQUANT, INT4_Q6K = 1, 2, 2, 16, 32
INT4_AVX2 = 64
"""A flag for tests: the AVX2 kernel even where the AVX-512 BF16 one runs (what an AVX2 CPU
computes, checked on any x86 CPU)."""


def int4_flags(
    int8_activations: bool,
    zeros_dtype: torch.dtype,
    bits: int = 4,
    kquant: bool = False,
    q6k: bool = False,
) -> int:
    """The 4-bit kernel's flags: the w4a8 kernel; float16 zeros (GGUF's Q4_1 / Q4_K); the bit
    planes of 5- and 6-bit weights, K-quant or Q6_K records as the scales (w4a8 only)."""
    return (
        (INT4_W4A8 if int8_activations else 0)
        | (INT4_HALF_ZEROS if zeros_dtype == torch.float16 and not (kquant or q6k) else 0)
        | ((bits - 4) << INT4_PLANES_SHIFT)
        | (INT4_KQUANT if kquant else 0)
        | (INT4_Q6K if q6k else 0)
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def find_compiler() -> str | None:
    """``$CXX``, else ``g++``, else ``c++`` on the PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@cache
def cpu_kernels() -> CpuKernels | None:
    """The compiled CPU kernels, or None (with the reason logged) when they are unavailable."""
    if os.environ.get("INFER_CPU_KERNELS", "1") == "0":
        logger.info("CPU kernels disabled by INFER_CPU_KERNELS=0; using the torch attention path")
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C++ compiler found; using the slower torch attention path")
        return None
    try:
        path = build_library(compiler)
        return CpuKernels(ctypes.CDLL(str(path)))
    except (OSError, RuntimeError) as exc:
        logger.warning("could not build the CPU kernels (%s); using the torch attention path", exc)
        return None


def kernels_bound(make: Callable[[CpuKernels], T]) -> Callable[[], T | None]:
    """A getter of ``make(kernels)`` for the current :func:`cpu_kernels` (None without them),
    made once per kernels object: a test that rebuilds the kernels (``cache_clear``) gets a
    fresh one, never one bound to the old library."""
    made: list = [None, None]  # [kernels, make(kernels)]

    def get() -> T | None:
        kernels = cpu_kernels()
        if kernels is None:
            return None
        if made[0] is not kernels:
            made[:] = [kernels, make(kernels)]
        return made[1]

    return get

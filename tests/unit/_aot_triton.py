"""Compile infer's Triton kernels for an sm_90 GPU (H100 / H200) ahead of time, with no GPU:
Triton's front end, its LLVM passes and the ptxas it ships all run on a CPU. Run as a script
(``python -m tests.unit._aot_triton``) without ``TRITON_INTERPRET``: the kernels must be
Triton's JIT functions, not the interpreter's. Prints one line per kernel; exits non-zero on the
first that does not compile."""

from __future__ import annotations

import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from infer.runner.gpu import triton_attention as ta  # noqa: E402
from infer.runner.gpu import triton_fused as tf  # noqa: E402
from infer.runner.gpu import triton_gemv as tg  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
INT_POINTERS = {"bt_ptr", "lens_ptr", "ids_ptr", "rt_ptr", "qsl_ptr", "past_ptr", "tile_seq_ptr", "tile_mt_ptr",
                "num_tiles_ptr", "slots_ptr"}  # fmt: skip
FLOATS = {"qk_scale", "eps"}

ATTENTION = dict(
    HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, WINDOWED=True, FP8_NATIVE=True, EXACT=False
)
# (module, kernel, constexprs, pointer dtypes that differ from bf16, warps)
CASES = [
    (ta, "_decode_kernel", dict(ATTENTION, G=4, G_PAD=16, BLOCK_N=64, NUM_SPLITS=4, KV_KIND=0,
                                FOLD_SCALES=False, ROW_IDS=False), {}, 4),
    (ta, "_decode_kernel", dict(ATTENTION, G=4, G_PAD=16, BLOCK_N=64, NUM_SPLITS=4, KV_KIND=0,
                                FOLD_SCALES=False, ROW_IDS=True), {}, 4),
    (ta, "_decode_kernel", dict(ATTENTION, G=4, G_PAD=16, BLOCK_N=64, NUM_SPLITS=1, KV_KIND=2,
                                FOLD_SCALES=True, ROW_IDS=True), {"k_ptr": "*u8", "v_ptr": "*u8"}, 2),
    (ta, "_decode_combine_kernel", dict(HEAD_DIM=128, D_PAD=128, NUM_SPLITS=4, S_PAD=4,
                                        ROW_IDS=True), {}, 4),
    (ta, "_prefill_kernel", dict(ATTENTION, G=4, BLOCK_M=64, BLOCK_N=64, KV_KIND=0,
                                 FOLD_SCALES=False, MIN_LEN=2), {}, 4),
    (ta, "_prefill_tiles_kernel", dict(ATTENTION, NUM_HEADS=32, G=4, BLOCK_M=64, BLOCK_N=64,
                                       KV_KIND=1, FOLD_SCALES=True),
     {"k_ptr": "*i8", "v_ptr": "*i8"}, 4),
    (ta, "_store_kv_kernel", dict(W=128, NUM_ELEMS=1024, BLOCK=1024),
     {p: "*i16" for p in ("k_ptr", "v_ptr", "kc_ptr", "vc_ptr")}, 4),
    (tf, "_rope_and_store_kernel", dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, HEADS_PAD=64,
                                        HALF_PAD=64), {"cos_ptr": "*fp32", "sin_ptr": "*fp32"}, 4),
    (tf, "_add_rms_norm_kernel", dict(HAS_H=True, BLOCK=2048), {}, 4),
    (tf, "_act_and_mul_kernel", dict(GELU=False, BLOCK=1024), {}, 4),
    (tg, "_gemv_dot_kernel", dict(HAS_BIAS=False, EVEN_K=True, SPLIT_K=1, BLOCK_M=16,
                                  BLOCK_N=64, BLOCK_K=128), {}, 4),
    (tg, "_gemv_dot_kernel", dict(HAS_BIAS=False, EVEN_K=True, SPLIT_K=4, BLOCK_M=16,
                                  BLOCK_N=16, BLOCK_K=256), {"ws_ptr": "*fp32"}, 4),
    (tg, "_gemv_row_kernel", dict(HAS_BIAS=False, EVEN_K=True, SPLIT_K=1, BLOCK_N=16,
                                  BLOCK_K=512), {}, 4),
    (tg, "_gemv_row_kernel", dict(HAS_BIAS=False, EVEN_K=True, SPLIT_K=4, BLOCK_N=8,
                                  BLOCK_K=512), {"ws_ptr": "*fp32"}, 4),
    (tg, "_gemv_reduce_kernel", dict(HAS_BIAS=True, SPLIT_K=4, BLOCK=256),
     {"ws_ptr": "*fp32"}, 4),
]  # fmt: skip


def signature(kernel, constexprs: dict, pointers: dict) -> dict:
    """Triton's signature of ``kernel``: constants, pointers (bf16 unless ``pointers`` or the
    index buffers say otherwise; the scales' are their int16 bits), 32-bit ints and floats."""
    pointers = {"ks_ptr": "*i16", "vs_ptr": "*i16", **pointers}
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            default = "*fp32" if name in ("acc_ptr", "stats_ptr") else "*bf16"
            sig[name] = pointers.get(name, "*i32" if name in INT_POINTERS else default)
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def main() -> int:
    for module, name, constexprs, pointers, warps in CASES:
        kernel = getattr(module, name)
        src = ASTSource(kernel, signature(kernel, constexprs, pointers), constexprs)
        t = time.perf_counter()
        try:
            compiled = triton.compile(src, target=TARGET, options={"num_warps": warps})
        except Exception as e:  # noqa: BLE001 - say which kernel, then fail
            print(f"FAILED {name} {constexprs}: {type(e).__name__}: {e}", flush=True)
            return 1
        cubin = len(compiled.asm.get("cubin", b""))
        print(f"ok {name}: sm_90 cubin {cubin} bytes in {time.perf_counter() - t:.1f}s", flush=True)
    print(f"all {len(CASES)} compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())

// The library's kernels that other kernels call (csrc/decode_layers.cpp), declared once: each
// defining file includes this header, so a signature that drifts from its declaration is a
// compile error rather than a silent mismatch at link time (C linkage carries no types).
#pragma once

#include <cstdint>

extern "C" {

int infer_add_rms_norm(const uint16_t* x, const uint16_t* h, const uint16_t* weight,
                       uint16_t* residual_out, uint16_t* out, int64_t rows, int64_t dim,
                       float eps, int num_threads);
int infer_rope_write_kv(uint16_t* qkv, const uint16_t* cos, const uint16_t* sin, int kv_kind,
                        void* key_cache, void* value_cache, uint16_t* key_scales,
                        uint16_t* value_scales, const int64_t* slots, int64_t tokens,
                        int64_t row_stride, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int num_threads);
int infer_decode_attention(int dtype, int kv_kind, const void* query, int64_t q_stride,
                           const void* key_cache, const void* value_cache,
                           const uint16_t* key_scales, const uint16_t* value_scales, void* out,
                           const int32_t* block_tables, const int32_t* context_lens,
                           int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                           int64_t window, int num_threads);
int infer_decode_attention_avx2(int kv_kind, const uint16_t* query, int64_t q_stride,
                                const void* key_cache, const void* value_cache,
                                const uint16_t* key_scales, const uint16_t* value_scales,
                                uint16_t* out, const int32_t* block_tables,
                                const int32_t* context_lens, int64_t batch, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                int64_t max_blocks, float scale, int64_t window, int num_threads);
int infer_act_mul(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter, int act,
                  int num_threads);
int infer_fma_linear(const uint16_t* x, const uint16_t* packed, const float* bias, void* y,
                     int64_t M, int64_t K, int64_t N, int out_f32, int num_threads);
int infer_w8a8_linear(const uint16_t* x, const int8_t* packed, const int32_t* colsum,
                      const float* w_scale, const float* bias, void* y, int64_t M, int64_t K,
                      int64_t N, int out_f32, int num_threads);
// infer_int4_linear's flags (and InferLinear.int4_flags).
#define INFER_INT4_W4A8 1        // activations to int8 per group: the w4a8 kernel
#define INFER_INT4_HALF_ZEROS 2  // zeros are float16, not uint8 (GGUF's Q4_1 / Q4_K)
// Bits 2-3: how many bit planes (0, 1, 2) follow each 64 bytes of nibbles: 5-bit weights
// (GGUF's Q5 types) and 6-bit ones (Q6_K), w4a8 kernel only.
#define INFER_INT4_PLANES_SHIFT 2
// GGUF's K-quant scales as they are (w4a8 only, groups of 32, K % 256 == 0): `scales` points at
// one 320-byte record per 16 outputs and 256 inputs (sc[8][16] uint8 | m[8][16] uint8 |
// d[16] float16 | dmin[16] float16; weight = d sc q - dmin m), `zeros` is not read.
#define INFER_INT4_KQUANT 16
// GGUF's Q6_K as it is (w4a8 only, 2 bit planes: values 0..63, K % 256 == 0, `group` the
// activations' group, dividing 256): `scales` points at one 288-byte record per 16 outputs and
// 256 inputs (sc[16][16] int8: sub-group s of 16 inputs, output c | d[16] float16; weight =
// d sc (q - 32)), `zeros` is not read.
#define INFER_INT4_Q6K 32
// The AVX2 kernel even where the AVX-512 BF16 one runs (tests: what an AVX2 CPU computes).
#define INFER_INT4_AVX2 64
int infer_int4_linear(const uint16_t* x, const uint8_t* packed, const uint16_t* scales,
                      const void* zeros, const float* bias, void* y, int64_t M, int64_t K,
                      int64_t N, int64_t group, int flags, int out_f32, int num_threads);
// The int4 kernel on AVX2 + FMA + F16C (csrc/linear_int4_avx2.cpp): the same layout and flags'
// meaning (uint8 or float16 zeros; no w4a8, bit planes or GGUF records).
int infer_int4_avx2_linear(const uint16_t* x, const uint8_t* packed, const uint16_t* scales,
                           const void* zeros, const float* bias, void* y, int64_t M, int64_t K,
                           int64_t N, int64_t group, int half_zeros, int out_f32,
                           int num_threads);
int infer_tiled_linear(const uint16_t* x, const void* packed, int weight_bytes,
                       const float* col_scale, const float* bias, void* y, int64_t M, int64_t K,
                       int64_t N, int out_f32, int num_threads);

// One linear layer's packed weight (infer_tiled_linear's arguments; with colsum,
// infer_w8a8_linear's; with a group size, infer_int4_linear's).
struct InferLinear {
  const void* weight;
  int64_t weight_bytes;
  const float* col_scale;  // int8 weights only
  const float* bias;
  int64_t n, k;
  const int32_t* colsum;  // w8a8 weights only
  const uint16_t* group_scales;  // 4-bit weights only: float16 [n/16][k/group][16]
  const void* group_zeros;       // and their zeros (uint8, or float16: INFER_INT4_HALF_ZEROS)
  int64_t group_size;            // 0: not 4-bit
  int64_t int4_flags;            // 4-bit: infer_int4_linear's flags
};

// One projection's LoRA adapter slots, in csrc/lora.cpp's layouts (LoRALinear in
// runner/lora/layers.py).
struct InferLoRA {
  const uint16_t* a;
  const uint16_t* bt;
  const float* scale;
  const int32_t* rank;
  const int64_t* part_off;
  int64_t num_parts, max_rank;
};

// A step's adapter rows grouped by slot (runner/lora/layers.py's LoRABatch).
struct InferLoRAStep {
  const int64_t* rows;
  const int64_t* group_slot;
  const int64_t* group_start;
  const int64_t* group_len;
  int64_t num_groups;
};

int infer_lora_apply(const uint16_t* x, int64_t x_stride, uint16_t* y, int64_t y_stride,
                     int64_t K, int64_t N, const uint16_t* A, const uint16_t* Bt,
                     const float* scale, const int32_t* rank, const int64_t* part_off, int64_t P,
                     int64_t R, const int64_t* rows, const int64_t* group_slot,
                     const int64_t* group_start, const int64_t* group_len, int64_t num_groups,
                     int num_threads);

// A mixture-of-experts layer's weights (csrc/moe.cpp; runner/cpu/moe_kernel.py builds it).
struct InferMoE {
  const uint16_t* router;      // [num_experts, hidden] bf16, row-major
  const InferLinear* gate_up;  // [num_experts]: each expert's fused gate|up projection
  const InferLinear* down;     // [num_experts]
  int64_t num_experts, top_k, inter;
  int64_t norm_topk;        // renormalise the k weights to sum to 1
  int64_t float32_weights;  // Mixtral: the weights stay float32 into the product
  const InferLinear* shared_gate_up;  // Qwen2-MoE's shared expert (null: none)
  const InferLinear* shared_down;
  int64_t shared_inter;
  const uint16_t* shared_gate;  // [hidden] bf16: the shared expert's sigmoid gate
  int64_t* expert_rows;         // [num_experts]: += the rows each expert ran on (null: none)
};

// Qwen 3's q and k norms: each q and k head of a fused qkv row (stride qkv_n) RMS-normed in
// place, as infer_add_rms_norm normalises a row.
int infer_qk_norm(uint16_t* qkv, int64_t qkv_n, int64_t rows, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, const uint16_t* q_norm,
                  const uint16_t* k_norm, float eps, int num_threads);

int infer_moe(const InferMoE* m, const uint16_t* x, uint16_t* out, int64_t rows, int64_t hidden,
              int act, int num_threads);

}  // extern "C"

// The kernel that multiplies by w: bf16 / int8 tiles, w8a8, or 4-bit groups.
inline int infer_linear_run(const InferLinear& w, const uint16_t* in, uint16_t* out,
                            int64_t rows, int num_threads) {
  if (w.group_size)
    return infer_int4_linear(in, static_cast<const uint8_t*>(w.weight), w.group_scales,
                             w.group_zeros, w.bias, out, rows, w.k, w.n, w.group_size,
                             static_cast<int>(w.int4_flags), 0, num_threads);
  if (w.colsum)
    return infer_w8a8_linear(in, static_cast<const int8_t*>(w.weight), w.colsum, w.col_scale,
                             w.bias, out, rows, w.k, w.n, 0, num_threads);
  return infer_tiled_linear(in, w.weight, static_cast<int>(w.weight_bytes), w.col_scale, w.bias,
                            out, rows, w.k, w.n, 0, num_threads);
}

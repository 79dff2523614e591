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
int infer_int4_linear(const uint16_t* x, const uint8_t* packed, const uint16_t* scales,
                      const uint8_t* zeros, const float* bias, void* y, int64_t M, int64_t K,
                      int64_t N, int64_t group, int int8_activations, int out_f32,
                      int num_threads);
int infer_tiled_linear(const uint16_t* x, const void* packed, int weight_bytes,
                       const float* col_scale, const float* bias, void* y, int64_t M, int64_t K,
                       int64_t N, int out_f32, int num_threads);

}  // extern "C"

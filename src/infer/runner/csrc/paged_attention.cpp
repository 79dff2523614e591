// Decode attention over the paged KV cache, for CPUs (built on first use by infer.runner.kernels).
//
// One query token per sequence attends to that sequence's whole context, read in place from the
// cache through its block table: no per-layer copy of the context, no padding, no mask tensor.
//
//   cache (one layer) : [num_slots, kv_heads, head_dim], slot = block_table[b][j / bs] * bs + j % bs
//   query             : [batch, heads, head_dim]; heads = kv_heads * group
//   out               : [batch, heads, head_dim]
//
// Work is split over (sequence, kv head) pairs; each pair reads its K and V rows once for all
// `group` query heads that share them (GQA), keeps scores in float32 and writes the output in the
// query's dtype. Plain C++ with OpenMP (the same runtime torch uses): loops over head_dim are
// written so that -O3 -march=native vectorizes them.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {  // bfloat16 -> float32: the high half of the float's bits
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void from_f32(float x, float* out) { *out = x; }
inline void from_f32(float x, uint16_t* out) {  // float32 -> bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *out = static_cast<uint16_t>((u >> 16) | 0x40);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *out = static_cast<uint16_t>(u >> 16);
}

template <typename T>
void decode_attention(const T* query, const T* key_cache, const T* value_cache, T* out,
                      const int32_t* block_tables, const int32_t* context_lens, int64_t batch,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                      int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * num_kv_heads; ++item) {
      const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t len = context_lens[b];
      const int64_t start = (window > 0 && len > window) ? len - window : 0;
      const int64_t n = len - start;
      const int32_t* table = block_tables + b * max_blocks;
      scores.resize(group * (n > 0 ? n : 1));
      for (int64_t g = 0; g < group; ++g) {
        const T* qh = query + (b * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = to_f32(qh[d]) * scale;
      }
      // Scores: one pass over the keys, every query head of the group at once.
      for (int64_t j = start; j < len; ++j) {
        const int64_t slot = static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size;
        const T* k = key_cache + slot * slot_stride + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * to_f32(k[d]);
          scores[g * n + (j - start)] = s;
        }
      }
      // Softmax in float32, per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) m = sg[j] > m ? sg[j] : m;
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - m);
          sum += sg[j];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
      }
      // Weighted sum of the values: one pass over the values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = start; j < len; ++j) {
        const int64_t slot = static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size;
        const T* v = value_cache + slot * slot_stride + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + (j - start)];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * to_f32(v[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* oh = out + (b * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) from_f32(acc[g * head_dim + d], oh + d);
      }
    }
  }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16 (query, caches and out share it).
int infer_decode_attention(int dtype, const void* query, const void* key_cache,
                           const void* value_cache, void* out, const int32_t* block_tables,
                           const int32_t* context_lens, int64_t batch, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t max_blocks, float scale, int64_t window, int num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
  if (dtype == 0) {
    decode_attention<float>(static_cast<const float*>(query), static_cast<const float*>(key_cache),
                            static_cast<const float*>(value_cache), static_cast<float*>(out),
                            block_tables, context_lens, batch, num_heads, num_kv_heads, head_dim,
                            block_size, max_blocks, scale, window, num_threads);
    return 0;
  }
  if (dtype == 1) {
    decode_attention<uint16_t>(
        static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(key_cache),
        static_cast<const uint16_t*>(value_cache), static_cast<uint16_t*>(out), block_tables,
        context_lens, batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale,
        window, num_threads);
    return 0;
  }
  return 2;
}

}  // extern "C"

// Fused element-wise steps of a decoder layer, bfloat16 in and out, float32 inside.
//
// Each replaces a chain of torch ops that would read and write the activations several times
// (and pay the per-op dispatch several times, which dominates at decode sizes):
//
//   infer_add_rms_norm   residual = x + h (rounded to bf16); out = w * bf16(residual / rms)
//                        (h may be null: a plain RMSNorm of x)
//   infer_rope_write_kv  rotate q and k of a fused qkv row in place ("rotate half" rope with
//                        the sign folded into the sin table) and store k, v in the KV cache slot
//   infer_store_kv       store k, v rows in the KV cache slots (copied, or quantized to int8 /
//                        float8 e4m3 with a bf16 scale per slot and head)
//   infer_act_mul        out = act(gate) * up for a fused [gate | up] row (SiLU or tanh-GELU)
//   infer_argmax_rows    the first index of each row's maximum (NaN counts as the maximum)
//
// Rows are split over OpenMP threads when there are enough of them to pay for the fork.

#include <cmath>
#include <cstdint>
#include <omp.h>

#include "kernels.h"
#include "simd.h"

namespace {

using infer_simd::bf16_to_f32;
using infer_simd::f32_to_bf16;
using infer_simd::round_bf16;

// One head's row of D values (float32) into a quantized cache: scale = absmax / qmax rounded
// up to bf16 (qmax 127 for int8, 448 for e4m3), each value stored as round(value * (1 / scale)).
inline void store_head(const float* x, int64_t d, int kind, void* dst, uint16_t* scale) {
  // On AVX-512 the same values 16 at a time (the prefill stores every row of a prompt).
#ifdef INFER_HAVE_AVX512
  const int64_t vec_end = d / 16 * 16;
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < vec_end; i += 16)  // NaN lanes ignored, as fmax does (second operand)
    vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), vmax);
  float absmax = vec_end > 0 ? _mm512_reduce_max_ps(vmax) : 0.f;
#else
  const int64_t vec_end = 0;
  float absmax = 0.f;
#endif
  for (int64_t i = vec_end; i < d; ++i) absmax = std::fmax(absmax, std::fabs(x[i]));
  const uint16_t s = infer_simd::f32_to_bf16_up(absmax / (kind == kKvInt8 ? 127.f : 448.f));
  *scale = s;
  const float sf = bf16_to_f32(s);
  const float inv = sf > 0.f ? 1.f / sf : 0.f;
  auto* o = static_cast<uint8_t*>(dst);
#ifdef INFER_HAVE_AVX512
  for (int64_t i = 0; i < vec_end; i += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv));
    __m128i bytes;
    if (kind == kKvInt8) {
      __m512 q = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
      bytes = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q));
    } else {
      bytes = infer_simd::to_fp8x16(y);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), bytes);
  }
#endif
  for (int64_t i = vec_end; i < d; ++i) {
    if (kind == kKvInt8) {
      const float q = std::nearbyint(x[i] * inv);
      o[i] = static_cast<uint8_t>(
          static_cast<int8_t>(q > 127.f ? 127.f : (q < -127.f ? -127.f : q)));
    } else {
      o[i] = infer_simd::f32_to_fp8e4m3(x[i] * inv);
    }
  }
}

// Store `heads` rows of one token (src in dtype 0 float32 / 1 bfloat16) at `slot`.
inline void store_token(const void* src, int src_dtype, int64_t heads, int64_t d, int kind,
                        void* cache, uint16_t* scales, int64_t slot) {
  const int64_t elem = kind == kKvPlain ? (src_dtype == 0 ? 4 : 2) : 1;
  char* base = static_cast<char*>(cache) + slot * heads * d * elem;
  if (kind == kKvPlain) {  // same dtype in and out: a plain copy
    std::memcpy(base, src, heads * d * elem);
    return;
  }
  float row[512];
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d; ++i)
      row[i] = src_dtype == 0 ? static_cast<const float*>(src)[h * d + i]
                              : bf16_to_f32(static_cast<const uint16_t*>(src)[h * d + i]);
    store_head(row, d, kind, base + h * d * elem, scales + slot * heads + h);
  }
}

// Threads for `rows` rows of `work` elements each: one unless the job is big enough.
inline int threads_for(int64_t rows, int64_t work, int num_threads) {
  const int64_t total = rows * work;
  if (total < (1 << 15) || rows < 2) return 1;
  return num_threads;
}

}  // namespace

extern "C" {

int infer_add_rms_norm(const uint16_t* x, const uint16_t* h, const uint16_t* weight,
                       uint16_t* residual_out, uint16_t* out, int64_t rows, int64_t dim,
                       float eps, int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows, dim, num_threads))
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * dim;
    uint16_t* res = residual_out ? residual_out + r * dim : nullptr;
#ifdef INFER_HAVE_AVX512
    {
      using namespace infer_simd;
      __m512 vss = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 m = dim - d >= 16 ? 0xffff : static_cast<__mmask16>((1u << (dim - d)) - 1);
        __m512 v = maskz_load_bf16x16(m, xr + d);
        if (h) {
          v = round_bf16x16(_mm512_add_ps(v, maskz_load_bf16x16(m, h + r * dim + d)));
          mask_store_bf16x16(res + d, m, v);
        }
        vss = _mm512_fmadd_ps(v, v, vss);
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(vss) / static_cast<float>(dim) + eps);
      const __m512 vinv = _mm512_set1_ps(inv);
      const uint16_t* src = h ? res : xr;
      uint16_t* o = out + r * dim;
      for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 m = dim - d >= 16 ? 0xffff : static_cast<__mmask16>((1u << (dim - d)) - 1);
        const __m512 normed = round_bf16x16(_mm512_mul_ps(maskz_load_bf16x16(m, src + d), vinv));
        mask_store_bf16x16(o + d, m, _mm512_mul_ps(maskz_load_bf16x16(m, weight + d), normed));
      }
      continue;
    }
#elif defined(INFER_HAVE_AVX2)
    if (dim % 8 == 0) {
      using namespace infer_simd;
      __m256 vss = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8) {
        __m256 v = load_bf16x8(xr + d);
        if (h) {
          v = round_bf16x8(_mm256_add_ps(v, load_bf16x8(h + r * dim + d)));
          store_bf16x8(res + d, v);
        }
        vss = _mm256_fmadd_ps(v, v, vss);
      }
      const float inv = 1.f / std::sqrt(reduce_add8(vss) / static_cast<float>(dim) + eps);
      const __m256 vinv = _mm256_set1_ps(inv);
      const uint16_t* src = h ? res : xr;
      uint16_t* o = out + r * dim;
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 normed = round_bf16x8(_mm256_mul_ps(load_bf16x8(src + d), vinv));
        store_bf16x8(o + d, _mm256_mul_ps(load_bf16x8(weight + d), normed));
      }
      continue;
    }
#endif
    float ss = 0.f;
    // Pass 1: the residual sum (rounded as torch rounds x + h in bf16) and its square sum.
    for (int64_t d = 0; d < dim; ++d) {
      float v = bf16_to_f32(xr[d]);
      if (h) {
        v = bf16_to_f32(f32_to_bf16(v + bf16_to_f32(h[r * dim + d])));
        res[d] = f32_to_bf16(v);
      }
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    const uint16_t* src = h ? res : xr;
    uint16_t* o = out + r * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(src[d]) * inv));
      o[d] = f32_to_bf16(bf16_to_f32(weight[d]) * normed);
    }
  }
  return 0;
}

// qkv: [tokens, row_stride] with q heads, then k heads, then v heads, each head_dim long, at the
// start of each row. cos, sin: [tokens, head_dim] (sin's first half negated). Caches: one layer,
// [num_slots, kv_heads, head_dim]; slots: [tokens] int64.
int infer_rope_write_kv(uint16_t* qkv, const uint16_t* cos, const uint16_t* sin, int kv_kind,
                        void* key_cache, void* value_cache, uint16_t* key_scales,
                        uint16_t* value_scales, const int64_t* slots, int64_t tokens,
                        int64_t row_stride, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int num_threads) {
  if (head_dim % 2 || head_dim > 512 || kv_kind < 0 || kv_kind > 2) return 1;
  const int64_t half = head_dim / 2;
  const int64_t kv_row = num_kv_heads * head_dim;
#pragma omp parallel for num_threads(threads_for(tokens, row_stride, num_threads))
  for (int64_t t = 0; t < tokens; ++t) {
    uint16_t* row = qkv + t * row_stride;
    const uint16_t* c = cos + t * head_dim;
    const uint16_t* s = sin + t * head_dim;
    for (int64_t hd = 0; hd < num_heads + num_kv_heads; ++hd) {
      uint16_t* x = row + hd * head_dim;
      int64_t i = 0;
#ifdef INFER_HAVE_AVX512
      if (half % 16 == 0) {
        using namespace infer_simd;
        for (; i < half; i += 16) {
          const __m512 a = load_bf16x16(x + i), b = load_bf16x16(x + i + half);
          const __m512 lo = round_bf16x16(_mm512_mul_ps(a, load_bf16x16(c + i)));
          const __m512 hi = round_bf16x16(_mm512_mul_ps(b, load_bf16x16(c + i + half)));
          store_bf16x16(x + i, _mm512_fmadd_ps(b, load_bf16x16(s + i), lo));
          store_bf16x16(x + i + half, _mm512_fmadd_ps(a, load_bf16x16(s + i + half), hi));
        }
      }
#endif
      for (; i < half; ++i) {
        const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
        // addcmul(x * cos, (x2, x1), sin) as torch rounds it: x * cos to bf16, then the
        // product and the sum in float32, rounded once
        const float lo = bf16_to_f32(f32_to_bf16(a * bf16_to_f32(c[i])));
        const float hi = bf16_to_f32(f32_to_bf16(b * bf16_to_f32(c[i + half])));
        x[i] = f32_to_bf16(lo + b * bf16_to_f32(s[i]));
        x[i + half] = f32_to_bf16(hi + a * bf16_to_f32(s[i + half]));
      }
    }
    store_token(row + num_heads * head_dim, 1, num_kv_heads, head_dim, kv_kind, key_cache,
                key_scales, slots[t]);
    store_token(row + (num_heads + num_kv_heads) * head_dim, 1, num_kv_heads, head_dim, kv_kind,
                value_cache, value_scales, slots[t]);
  }
  return 0;
}

// k, v: [tokens, num_kv_heads, head_dim] rows (float32 or bfloat16: src_dtype 0 / 1) with
// k_stride / v_stride elements between tokens; the caches hold the same dtype (kv_kind 0) or
// bytes with bf16 scales [num_slots, num_kv_heads] (1 int8, 2 e4m3).
int infer_store_kv(int src_dtype, int kv_kind, const void* k, const void* v, int64_t k_stride,
                   int64_t v_stride, void* key_cache, void* value_cache, uint16_t* key_scales,
                   uint16_t* value_scales, const int64_t* slots, int64_t tokens,
                   int64_t num_kv_heads, int64_t head_dim, int num_threads) {
  if (head_dim > 512 || kv_kind < 0 || kv_kind > 2 || src_dtype < 0 || src_dtype > 1) return 1;
  const int64_t elem = src_dtype == 0 ? 4 : 2;
#pragma omp parallel for num_threads(threads_for(tokens, num_kv_heads * head_dim, num_threads))
  for (int64_t t = 0; t < tokens; ++t) {
    store_token(static_cast<const char*>(k) + t * k_stride * elem, src_dtype, num_kv_heads,
                head_dim, kv_kind, key_cache, key_scales, slots[t]);
    store_token(static_cast<const char*>(v) + t * v_stride * elem, src_dtype, num_kv_heads,
                head_dim, kv_kind, value_cache, value_scales, slots[t]);
  }
  return 0;
}

// act: 0 = SiLU, 1 = tanh-approximated GELU.
int infer_act_mul(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter, int act,
                  int num_threads) {
  if (act != 0 && act != 1) return 1;
#pragma omp parallel for num_threads(threads_for(rows, inter, num_threads))
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* g = gate_up + r * 2 * inter;
    const uint16_t* u = g + inter;
    uint16_t* o = out + r * inter;
    int64_t i = 0;
#ifdef INFER_HAVE_AVX512
    {
      using namespace infer_simd;
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= inter; i += 16) {
        const __m512 x = load_bf16x16(g + i);
        __m512 a;
        if (act == 0) {
          a = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        } else {  // 0.5 x (1 + tanh(y)) = x / (1 + e^(-2y)): no cancellation for y << 0
          const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
          const __m512 y2 = _mm512_mul_ps(_mm512_set1_ps(-2.f * 0.7978845608028654f),
                                          _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
          a = _mm512_div_ps(x, _mm512_add_ps(one, exp16(y2)));
        }
        store_bf16x16(o + i, _mm512_mul_ps(round_bf16x16(a), load_bf16x16(u + i)));
      }
    }
#elif defined(INFER_HAVE_AVX2)
    {
      using namespace infer_simd;
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= inter; i += 8) {
        const __m256 x = load_bf16x8(g + i);
        __m256 a;
        if (act == 0) {
          a = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        } else {
          const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
          const __m256 y2 = _mm256_mul_ps(_mm256_set1_ps(-2.f * 0.7978845608028654f),
                                          _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
          a = _mm256_div_ps(x, _mm256_add_ps(one, exp8(y2)));
        }
        store_bf16x8(o + i, _mm256_mul_ps(round_bf16x8(a), load_bf16x8(u + i)));
      }
    }
#endif
    for (; i < inter; ++i) {
      const float x = bf16_to_f32(g[i]);
      float a;
      if (act == 0) {
        a = x / (1.f + std::exp(-x));
      } else {  // tanh-approximated GELU: 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi)
        a = x / (1.f + std::exp(-2.f * 0.7978845608028654f * (x + 0.044715f * x * x * x)));
      }
      o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(a)) * bf16_to_f32(u[i]));
    }
  }
  return 0;
}

int infer_argmax_rows(const float* logits, int64_t* out, int64_t rows, int64_t cols,
                      int num_threads) {
#pragma omp parallel for num_threads(threads_for(rows, cols, num_threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * cols;
#ifdef INFER_HAVE_AVX512
    if (cols >= 16) {
      __m512 vmax = _mm512_loadu_ps(x);
      __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __m512i cur = vidx;
      __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
      const __m512i step = _mm512_set1_epi32(16);
      int64_t i = 16;
      for (; i + 16 <= cols; i += 16) {
        cur = _mm512_add_epi32(cur, step);
        const __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);  // strict: first wins
        vmax = _mm512_mask_mov_ps(vmax, gt, v);
        vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
      }
      if (!nan) {
        alignas(64) float mv[16];
        alignas(64) int32_t mi[16];
        _mm512_store_ps(mv, vmax);
        _mm512_store_si512(mi, vidx);
        float m = mv[0];
        int64_t best = mi[0];
        for (int l = 1; l < 16; ++l)
          if (mv[l] > m || (mv[l] == m && mi[l] < best)) {
            m = mv[l];
            best = mi[l];
          }
        for (; i < cols; ++i) {
          if (std::isnan(x[i])) {
            m = x[i];  // the scalar pass below finds the first NaN
            break;
          }
          if (x[i] > m) {
            m = x[i];
            best = i;
          }
        }
        if (!std::isnan(m)) {
          out[r] = best;
          continue;
        }
      }
    }
#endif
    int64_t best = 0;
    float m = x[0];
    if (!std::isnan(m)) {
      for (int64_t i = 1; i < cols; ++i) {
        const float v = x[i];
        if (v > m) {
          m = v;
          best = i;
        } else if (std::isnan(v)) {
          best = i;
          break;
        }
      }
    }
    out[r] = best;
  }
  return 0;
}

}  // extern "C"

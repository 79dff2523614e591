// Decode attention over the paged KV cache on CPUs with AVX2 and FMA but not AVX-512 BF16 (AMD
// Zen 2/3, Intel Haswell to Ice Lake client): paged_attention.cpp's bfloat16 path in 8-lane
// float32 vectors, for a bf16, int8 or float8 cache.
//
// A work item is one sequence and a run of its kv heads [h0, h1), whose K (then V) rows sit next
// to each other in each slot's row of the cache. Per item:
//
//   scores  S[h][j] = (q_h . k_j) * scale (* key scale)    8 keys at a time per query head:
//                                                          8 accumulators, reduced together
//   softmax per query head in float32 (vector exp)         (* value scale, for a scaled cache)
//   values  out[h] = sum_j S[h][j] v_j                     one pass over the value rows, every
//                                                          query head of the item at once,
//                                                          sums in L1
//
// The scalar path's std::exp alone cost more than the rest of the kernel. Rows are gathered
// through the block table, so they are prefetched by hand (keys 64 rows ahead, values 32), into
// L2: that many rows do not fit a 32 KiB L1, and fetched into L1 they pushed out the rows in use
// (built with -mno-avx512f on Zen 4, whose L1 is Zen 3's size: 12 layers x 16 x 1024 tokens
// 34 -> 25 ms, 16 x 128 3.9-4.4 -> 3.3-3.5 ms).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>

#include "kernels.h"
#include "simd.h"

#ifdef INFER_HAVE_AVX2

namespace {

constexpr int64_t kKeysAhead = 64;  // keys between a key row's prefetch and its use
constexpr int64_t kRowsAhead = 32;   // value rows between a row's prefetch and its use

// 16 stored cache values -> two vectors of 8 float32 (before their row's scale). A bf16 row is
// widened by interleaving zeros below each value (VPUNPCKL/HWD: one load and two shuffles per
// 16 values, where a zero-extending load and a shift per 8 cost twice the micro-ops), which
// leaves its values in "unpack order" within each 16: lo = 0..3, 8..11 and hi = 4..7, 12..15.
// Dot products do not care about the order as long as the query is laid out the same
// (kUnpackOrder); value sums are put back in order when stored. int8 / float8 rows widen in
// order.
template <int kKind>
constexpr bool kUnpackOrder = kKind == kKvPlain;

template <int kKind, typename KvT>
inline void load_kv16(const KvT* p, __m256& lo, __m256& hi) {
  if constexpr (kKind == kKvInt8) {
    lo = infer_simd::load_i8x8(reinterpret_cast<const int8_t*>(p));
    hi = infer_simd::load_i8x8(reinterpret_cast<const int8_t*>(p) + 8);
  } else if constexpr (kKind == kKvFp8) {
    lo = infer_simd::load_fp8x8(reinterpret_cast<const uint8_t*>(p));
    hi = infer_simd::load_fp8x8(reinterpret_cast<const uint8_t*>(p) + 8);
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
  }
}

// Position within a 16-value chunk of value i in unpack order (i < 8: lo, else hi).
inline int unpack_position(int i) { return (i & 3) + ((i & 4) << 1) + ((i & 8) >> 1); }

// Softmax of one head's n scores in place, in float32.
inline void softmax(float* s, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
  float m = infer_simd::reduce_max8(vmax);
  for (; j < n; ++j) m = s[j] > m ? s[j] : m;
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = infer_simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = infer_simd::reduce_add8(vsum);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), vinv));
  for (; j < n; ++j) s[j] *= inv;
}

// Value rows j .. j + R - 1 (rows[r]) into every head's sums: R FMAs per sum, one row at a
// time, in order (the bits of one row at a time); kHeadDim > 0 fixes head_dim (unrolled lanes).
template <int R, int kKind, typename KvT, int kHeadDim>
inline void add_value_rows(const float* scores, int64_t n, int64_t j, const KvT* const* rows,
                           int64_t nkv, int64_t group, int64_t head_dim, float* acc) {
  const int64_t hd = kHeadDim > 0 ? kHeadDim : head_dim;
  for (int64_t kv = 0; kv < nkv; ++kv)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kv * group + g;
      __m256 p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm256_set1_ps(scores[h * n + j + r]);
      float* a = acc + h * hd;
      for (int64_t c = 0; c < hd / 8; c += 2) {
        __m256 slo = _mm256_loadu_ps(a + c * 8), shi = _mm256_loadu_ps(a + c * 8 + 8);
        for (int r = 0; r < R; ++r) {
          __m256 lo, hi;
          load_kv16<kKind>(rows[r] + kv * hd + c * 8, lo, hi);
          slo = _mm256_fmadd_ps(p[r], lo, slo);
          shi = _mm256_fmadd_ps(p[r], hi, shi);
        }
        _mm256_storeu_ps(a + c * 8, slo);
        _mm256_storeu_ps(a + c * 8 + 8, shi);
      }
    }
}

template <int kKind, typename KvT, int kHeadDim>
void decode_attention_avx2(const uint16_t* query, int64_t q_stride, const KvT* key_cache,
                           const KvT* value_cache, const uint16_t* key_scales,
                           const uint16_t* value_scales, uint16_t* out,
                           const int32_t* block_tables, const int32_t* context_lens,
                           int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                           int64_t window, int num_threads) {
  constexpr bool kScaled = kKind != kKvPlain;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
  const infer_simd::DecodeSplit split(batch, num_kv_heads, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    // Inside the region, where a compile-time kHeadDim keeps the lane loops unrolled (the
    // region gets outside variables by reference); the caller picks kHeadDim > 0 only where
    // head_dim equals it.
    const int64_t lanes = (kHeadDim > 0 ? kHeadDim : head_dim) / 8;  // even: head_dim % 16 == 0
    std::vector<float> scores, qf, vacc;
    std::vector<const KvT*> krows;
    std::vector<int64_t> slots;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < split.count(batch); ++item) {
      const auto [b, h0, h1, start, n] = split.item(item, context_lens, window);
      if (h0 >= h1) continue;
      const int64_t nq = (h1 - h0) * group;  // query heads of this item
      uint16_t* ob = out + (b * num_heads + h0 * group) * head_dim;
      if (n <= 0) {
        std::memset(ob, 0, nq * head_dim * 2);
        continue;
      }
      const int64_t npad = (n + 7) / 8 * 8;
      const int32_t* table = block_tables + b * max_blocks;
      scores.resize(nq * npad);
      krows.resize(npad);
      slots.resize(npad);
      for (int64_t j = 0; j < npad; ++j) {
        const int64_t slot = infer_simd::paged_slot(table, start + (j < n ? j : 0), block_size);
        slots[j] = slot;  // padding keys repeat the first one
        krows[j] = key_cache + slot * slot_stride + h0 * head_dim;
      }
      const int64_t item_bytes = (h1 - h0) * head_dim * static_cast<int64_t>(sizeof(KvT));
      for (int64_t j = 0; j < kKeysAhead && j < npad; ++j) infer_simd::prefetch_l2(krows[j], item_bytes);
      const uint16_t* qb = query + b * q_stride + h0 * group * head_dim;
      qf.resize(nq * head_dim);
      for (int64_t i = 0; i < nq * head_dim; ++i) {
        const int64_t at = kUnpackOrder<kKind> ? i / 16 * 16 + unpack_position(i % 16) : i;
        qf[i] = infer_simd::bf16_to_f32(qb[at]);
      }
      // Scores, laid out [nq][n] (a head's padding past n is written over by the next head's).
      const __m256 vscale = _mm256_set1_ps(scale);
      for (int64_t j0 = 0; j0 < npad; j0 += 8) {
        for (int64_t i = j0 + kKeysAhead; i < j0 + kKeysAhead + 8 && i < npad; ++i)
          infer_simd::prefetch_l2(krows[i], item_bytes);
        for (int64_t h = 0; h < nq; ++h) {
          const int64_t kv = group == 1 ? h : h / group, off = kv * head_dim;
          const float* qh = qf.data() + h * head_dim;
          // The 8 keys side by side, 16 dims at a time: 8 independent FMA chains, and each
          // piece of the query loaded once for all of them.
          const KvT* k[8];
          for (int i = 0; i < 8; ++i) k[i] = krows[j0 + i] + off;
          __m256 acc[8];
          for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
          for (int64_t c = 0; c < lanes; c += 2) {
            const __m256 q0 = _mm256_loadu_ps(qh + c * 8), q1 = _mm256_loadu_ps(qh + c * 8 + 8);
            for (int i = 0; i < 8; ++i) {
              __m256 lo, hi;
              load_kv16<kKind>(k[i] + c * 8, lo, hi);
              acc[i] = _mm256_fmadd_ps(q1, hi, _mm256_fmadd_ps(q0, lo, acc[i]));
            }
          }
          __m256 r = _mm256_mul_ps(infer_simd::sum8(acc), vscale);
          if constexpr (kScaled) {
            alignas(32) float ks[8];
            const int64_t kvh = h0 + kv;
            for (int i = 0; i < 8; ++i)
              ks[i] = infer_simd::bf16_to_f32(key_scales[slots[j0 + i] * num_kv_heads + kvh]);
            r = _mm256_mul_ps(r, _mm256_load_ps(ks));
          }
          if (n - j0 >= 8) {
            _mm256_storeu_ps(scores.data() + h * n + j0, r);
          } else {
            alignas(32) float tail[8];
            _mm256_store_ps(tail, r);
            std::memcpy(scores.data() + h * n + j0, tail, (n - j0) * sizeof(float));
          }
        }
      }
      for (int64_t h = 0; h < nq; ++h) {
        float* sg = scores.data() + h * n;
        softmax(sg, n);
        if constexpr (kScaled) {
          const int64_t kvh = h0 + h / group;
          for (int64_t j = 0; j < n; ++j)
            sg[j] *= infer_simd::bf16_to_f32(value_scales[slots[j] * num_kv_heads + kvh]);
        }
      }
      // Values: every query head of the item in one pass over its value rows, sums in L1 (per
      // head with the sums in registers, reading each row's head slices in separate passes,
      // measured 5-15% slower).
      vacc.assign(nq * head_dim, 0.f);
      float* acc = vacc.data();
      auto vrow = [&](int64_t j) { return value_cache + slots[j] * slot_stride + h0 * head_dim; };
      for (int64_t j = 0; j < kRowsAhead && j < n; ++j) infer_simd::prefetch_l2(vrow(j), item_bytes);
      // Two rows per visit of a head's sums (their loads and stores halved).
      int64_t j = 0;
      for (; j + 2 <= n; j += 2) {
        for (int64_t r = j + kRowsAhead; r < j + kRowsAhead + 2 && r < n; ++r)
          infer_simd::prefetch_l2(vrow(r), item_bytes);
        const KvT* rows[2] = {vrow(j), vrow(j + 1)};
        add_value_rows<2, kKind, KvT, kHeadDim>(scores.data(), n, j, rows, h1 - h0, group,
                                                head_dim, acc);
      }
      for (; j < n; ++j) {
        const KvT* rows[1] = {vrow(j)};
        add_value_rows<1, kKind, KvT, kHeadDim>(scores.data(), n, j, rows, h1 - h0, group,
                                                head_dim, acc);
      }
      if constexpr (kUnpackOrder<kKind>) {  // back in order, 16 at a time
        for (int64_t i = 0; i < nq * head_dim; i += 16) {
          alignas(32) float chunk[16];
          for (int j = 0; j < 16; ++j) chunk[unpack_position(j)] = acc[i + j];
          std::memcpy(acc + i, chunk, sizeof(chunk));
        }
      }
      for (int64_t i = 0; i + 8 <= nq * head_dim; i += 8)
        infer_simd::store_bf16x8(ob + i, _mm256_loadu_ps(acc + i));
    }
  }
}

}  // namespace

// infer_decode_attention's bfloat16 path on AVX2 (head_dim a multiple of 16): same arguments.
int infer_decode_attention_avx2(int kv_kind, const uint16_t* query, int64_t q_stride,
                                const void* key_cache, const void* value_cache,
                                const uint16_t* key_scales, const uint16_t* value_scales,
                                uint16_t* out, const int32_t* block_tables,
                                const int32_t* context_lens, int64_t batch, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                int64_t max_blocks, float scale, int64_t window,
                                int num_threads) {
#define INFER_ARGS(KV)                                                                         \
  query, q_stride, static_cast<const KV*>(key_cache), static_cast<const KV*>(value_cache),     \
      key_scales, value_scales, out, block_tables, context_lens, batch, num_heads,             \
      num_kv_heads, head_dim, block_size, max_blocks, scale, window, num_threads
  // The common head sizes with head_dim a compile-time constant (unrolled lanes).
#define INFER_BY_HEAD_DIM(KIND, KV)                                                             \
  if (head_dim == 64) decode_attention_avx2<KIND, KV, 64>(INFER_ARGS(KV));                      \
  else if (head_dim == 128) decode_attention_avx2<KIND, KV, 128>(INFER_ARGS(KV));               \
  else decode_attention_avx2<KIND, KV, 0>(INFER_ARGS(KV));
  if (kv_kind == kKvPlain) { INFER_BY_HEAD_DIM(kKvPlain, uint16_t) }
  else if (kv_kind == kKvInt8) { INFER_BY_HEAD_DIM(kKvInt8, int8_t) }
  else { INFER_BY_HEAD_DIM(kKvFp8, uint8_t) }
#undef INFER_BY_HEAD_DIM
#undef INFER_ARGS
  return 0;
}

#endif  // INFER_HAVE_AVX2

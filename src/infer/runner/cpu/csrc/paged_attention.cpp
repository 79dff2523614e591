// Decode attention over the paged KV cache, for CPUs (built on first use by infer.runner.cpu.kernels).
//
// One query token per sequence attends to that sequence's whole context, read in place from the
// cache through its block table: no per-layer copy of the context, no padding, no mask tensor.
//
//   cache (one layer) : [num_slots, kv_heads, head_dim], slot = block_table[b][j / bs] * bs + j % bs
//   query             : [batch, heads, head_dim]; heads = kv_heads * group
//   out               : [batch, heads, head_dim]
//
// The cache holds the query's dtype (float32 or bfloat16), or one byte per value (int8, or float8
// e4m3) with a bfloat16 scale per (slot, kv head): value = stored * scale. Scales fold into the
// arithmetic: a key's scale multiplies its score, a value's scale its softmax weight.
//
// Work is split over (sequence, kv head) pairs; each pair reads its K and V rows once for all
// `group` query heads that share them (GQA), keeps scores in float32 and writes the output in the
// query's dtype. Plain C++ with OpenMP (the same runtime torch uses); an AVX-512 path for the
// common shapes, and an AVX2 one (paged_attention_avx2.cpp) for bfloat16 elsewhere.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>

#include "kernels.h"
#include "simd.h"

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return infer_simd::bf16_to_f32(x); }
inline void from_f32(float x, float* out) { *out = x; }
inline void from_f32(float x, uint16_t* out) { *out = infer_simd::f32_to_bf16(x); }

// One stored cache value as float32 (before its row's scale).
template <int kKind, typename KvT>
inline float kv_value(KvT x) {
  if constexpr (kKind == kKvInt8) return static_cast<float>(static_cast<int8_t>(x));
  else if constexpr (kKind == kKvFp8) return infer_simd::fp8e4m3_to_f32(static_cast<uint8_t>(x));
  else return to_f32(x);
}

// The scale of (slot, kv head); 1 for a plain cache.
inline float kv_scale(const uint16_t* scales, int64_t slot, int64_t num_kv_heads, int64_t kvh) {
  return scales ? infer_simd::bf16_to_f32(scales[slot * num_kv_heads + kvh]) : 1.f;
}

template <typename T, typename KvT, int kKind>
void decode_attention(const T* query, int64_t q_stride, const KvT* key_cache,
                      const KvT* value_cache, const uint16_t* key_scales,
                      const uint16_t* value_scales, T* out,
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
        const T* qh = query + b * q_stride + (kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = to_f32(qh[d]) * scale;
      }
      // Scores: one pass over the keys, every query head of the group at once.
      for (int64_t j = start; j < len; ++j) {
        const int64_t slot = infer_simd::paged_slot(table, j, block_size);
        const KvT* k = key_cache + slot * slot_stride + kvh * head_dim;
        const float ks = kv_scale(key_scales, slot, num_kv_heads, kvh);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kv_value<kKind>(k[d]);
          scores[g * n + (j - start)] = s * ks;
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
        const int64_t slot = infer_simd::paged_slot(table, j, block_size);
        const KvT* v = value_cache + slot * slot_stride + kvh * head_dim;
        const float vs = kv_scale(value_scales, slot, num_kv_heads, kvh);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + (j - start)] * vs;
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * kv_value<kKind>(v[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* oh = out + (b * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) from_f32(acc[g * head_dim + d], oh + d);
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)

using infer_simd::exp16;
using infer_simd::load_bf16x16;

// Sixteen vectors -> one: lane i of the result is the sum of the 16 lanes of v[i].
// (45 shuffles and adds instead of 16 horizontal reductions.)
inline __m512 sum16(const __m512* v) {
  __m512 s1[8], s2[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                          _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of 4 consecutive vectors
    const __m512d a = _mm512_castps_pd(s1[2 * i]), b = _mm512_castps_pd(s1[2 * i + 1]);
    s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Add the four 128-bit lanes: block k of the result holds vectors 4k .. 4k+3.
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x44),
                                  _mm512_shuffle_f32x4(s2[0], s2[1], 0xEE));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], 0x44),
                                  _mm512_shuffle_f32x4(s2[2], s2[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

// Rows of the cache are gathered through the block table, so the hardware prefetchers lose the
// stream at every block; prefetching by hand (K: the next 16 keys, V: 16 rows ahead) measured
// 15 -> 21 GB/s at 64 x 128 and 16 x 1024 tokens (12 heads x 64, bf16, 2 threads). Each pass
// also asks for its first rows all at once before it starts. The prefetches go to L2, not L1:
// 16 rows of 12 heads are 24 KiB, most of a 32 KiB L1 (Zen 4), so fetched into L1 they pushed
// out the rows in use; into L2, 12 layers x 16 x 1024 tokens took 30-35 -> 20-22 ms on Zen 4
// (~30 GB/s, a plain read's rate there), 16 x 128 3.4-4.3 -> 2.2-2.5 ms. (On Zen 5's 48 KiB L1,
// keys 16 ahead into L1 had measured 1.95 -> 1.75 ms against 32 ahead at 16 x 128.)
constexpr int64_t kPrefetchRows = 16;
constexpr int64_t kKeysAhead = 16;  // keys between a key row's prefetch and its use

// A one-byte cache read through the bf16 tables (simd.h): its rows are turned into bf16 rows, a
// kv head at a time, and go through the bf16 cache's code from there (the scales still apply
// to scores and softmax weights). For head_dim a multiple of 64 fixed at compile time; other
// shapes widen 16 values at a time arithmetically.
template <int kKind, int kHeadDim>
constexpr bool kBytesAsBf16 =
#ifdef INFER_HAVE_BYTE_TABLES
    kKind != kKvPlain && kHeadDim > 0 && kHeadDim % 64 == 0;
#else
    false;
#endif

#ifdef INFER_HAVE_BYTE_TABLES
// rows[r][offset .. offset + kHeadDim) (one-byte values) -> out + r * kHeadDim (bf16).
template <int kKind, int kHeadDim, typename KvT>
inline void byte_rows_to_bf16(const KvT* const* rows, int64_t offset, int count,
                              uint16_t* out) {
  constexpr bool kInt8 = kKind == kKvInt8;
  const infer_simd::ByteBf16Tables& t = infer_simd::byte_bf16_tables<kInt8>();
  for (int r = 0; r < count; ++r)
    for (int64_t c = 0; c < kHeadDim / 64; ++c) {
      __m512i w0, w1;
      infer_simd::bytes64_to_bf16<kInt8>(
          reinterpret_cast<const uint8_t*>(rows[r] + offset + c * 64), t, w0, w1);
      _mm512_store_si512(out + r * kHeadDim + c * 64, w0);
      _mm512_store_si512(out + r * kHeadDim + c * 64 + 32, w1);
    }
}
#endif

// Query heads sharing a kv head (GQA) score 16 keys at a time against the keys turned
// pair-major (16 x 16 transposes of 32-bit dim pairs, once per kv head): each head's 16 scores
// are then head_dim / 2 DPBF16PS with a broadcast query pair, and no 16-way reduction. With one
// query head per kv head nothing amortizes the transposes, and the row-major loop stays.
constexpr int64_t kMinGroupForPairs = 2;
template <int kKind, int kHeadDim>
constexpr bool kKeysAsPairs =
    kHeadDim > 0 && kHeadDim % 32 == 0 && (kKind == kKvPlain || kBytesAsBf16<kKind, kHeadDim>);

// The scales of kv head kvh at 16 slots, as float32 lanes.
inline __m512 key_scales16(const uint16_t* scales, const int64_t* slots, int64_t num_kv_heads,
                           int64_t kvh) {
  alignas(64) float ks[16];
  for (int i = 0; i < 16; ++i) ks[i] = infer_simd::bf16_to_f32(scales[slots[i] * num_kv_heads + kvh]);
  return _mm512_load_ps(ks);
}

// 16 stored cache values -> 16 float32 (before their row's scale).
template <int kKind, typename KvT>
inline __m512 load_kv16(const KvT* p) {
  if constexpr (kKind == kKvInt8) return infer_simd::load_i8x16(reinterpret_cast<const int8_t*>(p));
  else if constexpr (kKind == kKvFp8) return infer_simd::load_fp8x16(reinterpret_cast<const uint8_t*>(p));
  else return load_bf16x16(reinterpret_cast<const uint16_t*>(p));
}

// Rows [j, j + 2 * kPairs) of the values into every head's sums as bf16 dot products: rows
// 2i and 2i + 1 interleaved word by word (once per kv head, for all its query heads), so one
// DPBF16PS multiplies 16 dims of both rows by the head's pair of softmax weights (bf16, pb:
// [nq][n2], n2 even) and adds both: half the multiplies of float32 FMAs on widened rows, and
// no widening. The interleave works within 128-bit lanes, so a 32-dim slice's sums lie as
//
//   acc[0 .. 15]  = dims 0-3, 8-11, 16-19, 24-27     (UNPCKLWD of the two rows)
//   acc[16 .. 31] = dims 4-7, 12-15, 20-23, 28-31    (UNPCKHWD)
//
// and are put back in order once, at the end. A row past the context (an odd count's last
// pair) weighs 0 and is read as zeros. A one-byte cache's rows are first made bf16 (exactly: every int8 and e4m3
// value is one), through the byte tables or 16 values at a time arithmetically.
template <int kPairs, int kKind, typename KvT, int kHeadDim>
inline void add_value_pairs(const uint16_t* pb, int64_t n2, int64_t n, int64_t j,
                            const KvT* const* vrows, int64_t nkv, int64_t group, int64_t hd,
                            float* acc, uint16_t* ibuf) {
  constexpr int R = 2 * kPairs;
  constexpr int64_t kConvDim = kHeadDim > 0 ? kHeadDim : 256;
  [[maybe_unused]] alignas(64) uint16_t conv[kKind != kKvPlain ? R * kConvDim : 1];
  const KvT* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = vrows[j + r < n ? j + r : j];  // read as zeros past n
  for (int64_t kv = 0; kv < nkv; ++kv) {
    const uint16_t* wrows[R];
    if constexpr (kBytesAsBf16<kKind, kHeadDim>) {
#ifdef INFER_HAVE_BYTE_TABLES
      byte_rows_to_bf16<kKind, kHeadDim>(rows, kv * hd, R, conv);
#endif
      for (int r = 0; r < R; ++r) wrows[r] = conv + r * kHeadDim;
    } else if constexpr (kKind != kKvPlain) {
      for (int r = 0; r < R; ++r) {
        for (int64_t c = 0; c < hd / 16; ++c)
          infer_simd::store_bf16x16(conv + r * kConvDim + c * 16,
                                    load_kv16<kKind>(rows[r] + kv * hd + c * 16));
        wrows[r] = conv + r * kConvDim;
      }
    } else {
      for (int r = 0; r < R; ++r) wrows[r] = reinterpret_cast<const uint16_t*>(rows[r]) + kv * hd;
    }
    // A pair's words: in registers when head_dim is fixed (64: 4 vectors a pair, 128: 8), else
    // in ibuf (L1).
    constexpr int64_t kSlices = kHeadDim > 0 ? kHeadDim / 32 : 1;
    [[maybe_unused]] __m512i iv[kPairs][kSlices][2];
    for (int i = 0; i < kPairs; ++i)
      for (int64_t c = 0; c < hd / 32; ++c) {
        const __m512i x = _mm512_loadu_si512(wrows[2 * i] + c * 32);
        // past the context (only ever the second row of the last pair): zeros, so that an
        // infinity in the row it repeats cannot make 0 * inf
        const __m512i y = j + 2 * i + 1 < n ? _mm512_loadu_si512(wrows[2 * i + 1] + c * 32)
                                            : _mm512_setzero_si512();
        if constexpr (kHeadDim > 0) {
          iv[i][c][0] = _mm512_unpacklo_epi16(x, y);
          iv[i][c][1] = _mm512_unpackhi_epi16(x, y);
        } else {
          _mm512_store_si512(ibuf + (i * hd + c * 32) * 2, _mm512_unpacklo_epi16(x, y));
          _mm512_store_si512(ibuf + (i * hd + c * 32) * 2 + 32, _mm512_unpackhi_epi16(x, y));
        }
      }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kv * group + g;
      __m512bh pp[kPairs];
      for (int i = 0; i < kPairs; ++i) {
        int32_t pair;
        std::memcpy(&pair, pb + h * n2 + j + 2 * i, 4);
        pp[i] = (__m512bh)_mm512_set1_epi32(pair);
      }
      float* a = acc + h * hd;
      for (int64_t c = 0; c < hd / 32; ++c) {
        __m512 lo = _mm512_load_ps(a + c * 32), hi = _mm512_load_ps(a + c * 32 + 16);
        for (int i = 0; i < kPairs; ++i) {
          __m512i wlo, whi;
          if constexpr (kHeadDim > 0) {
            wlo = iv[i][c][0];
            whi = iv[i][c][1];
          } else {
            wlo = _mm512_load_si512(ibuf + (i * hd + c * 32) * 2);
            whi = _mm512_load_si512(ibuf + (i * hd + c * 32) * 2 + 32);
          }
          lo = _mm512_dpbf16_ps(lo, pp[i], (__m512bh)wlo);
          hi = _mm512_dpbf16_ps(hi, pp[i], (__m512bh)whi);
        }
        _mm512_store_ps(a + c * 32, lo);
        _mm512_store_ps(a + c * 32 + 16, hi);
      }
    }
  }
}

// out[h] = sum_j p[h][j] * v_j[h] for all nq = nkv * group query heads of an item in one pass
// over its value rows, each read once, front to back, with the sums in L1 (acc, nq x head_dim,
// 64-byte aligned). Register-sized groups of heads took one pass per group, reading every row
// twice (half of it each time): 5-7% slower over 16-64 sequences x 100-1100 tokens, same bits.
// Several rows per visit of a head's sums cut their loads and stores (two rows per visit, 16 x
// 96 tokens 1.75 -> 1.66 ms, 64 x 128 11.4 -> 11.0 on Zen 4; then four, with a widening per
// 16 values, 16 x 512 11.7 -> 10.9); then by row pairs (add_value_pairs), every cache kind read
// as bf16 and the softmax weights rounded to bf16, as the prefill kernel's are (16 x 1,100
// tokens: 12 on 12 heads 1.04x, 32 on 8 1.13x, 14 on 2 1.24x; more with a one-byte cache).
// kHeadDim > 0 fixes head_dim at compile time (the lane loops unroll); 0 reads it from
// head_dim. (For a scaled cache, p already carries each row's scale.)
template <int kKind, typename KvT, int kHeadDim>
void weighted_values(const float* scores, int64_t n, const KvT* const* vrows, int64_t nkv,
                     int64_t group, int64_t head_dim, float* acc, uint16_t* ob) {
  constexpr int kRows = 4;
  const int64_t hd = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t nq = nkv * group;
  std::memset(acc, 0, nq * hd * sizeof(float));
  const int64_t row_bytes = nkv * hd * static_cast<int64_t>(sizeof(KvT));
  for (int64_t j = 0; j < kPrefetchRows && j < n; ++j)  // the first, at once
    infer_simd::prefetch_l2(vrows[j], row_bytes);
  // The weights as bf16, [nq][n2]: rows j, j + 1 (j even) one 32-bit word; 0 past n.
  const int64_t n2 = (n + 1) / 2 * 2;
  auto* pb = static_cast<uint16_t*>(infer_simd::thread_scratch<1>((nq * n2 + 4 * hd) * 2 + 64));
  uint16_t* ibuf = pb + (nq * n2 + 31) / 32 * 32;  // kRows interleaved rows, 64-byte aligned
  for (int64_t h = 0; h < nq; ++h) {
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
      _mm256_mask_storeu_epi16(pb + h * n2 + j, m,
                               infer_simd::to_bf16x16(_mm512_maskz_loadu_ps(m, scores + h * n + j)));
    }
    if (n2 > n) pb[h * n2 + n] = 0;
  }
  int64_t j = 0;
  for (; j + kRows <= n2; j += kRows) {
    for (int64_t r = j + kPrefetchRows; r < j + kPrefetchRows + kRows && r < n; ++r)
      infer_simd::prefetch_l2(vrows[r], row_bytes);
    add_value_pairs<kRows / 2, kKind, KvT, kHeadDim>(pb, n2, n, j, vrows, nkv, group, hd, acc,
                                                     ibuf);
  }
  if (j < n2)
    add_value_pairs<1, kKind, KvT, kHeadDim>(pb, n2, n, j, vrows, nkv, group, hd, acc, ibuf);
  // each 32-dim slice's two halves back in dim order (see add_value_pairs), rounded to bf16
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t i = 0; i < nq * hd; i += 32) {
    const __m512 lo = _mm512_load_ps(acc + i), hi = _mm512_load_ps(acc + i + 16);
    infer_simd::store_bf16x16(ob + i, _mm512_permutex2var_ps(lo, first, hi));
    infer_simd::store_bf16x16(ob + i + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}

// The bfloat16-query path with head_dim a multiple of 32 (up to 256), in AVX-512, over a bf16,
// int8 or fp8 cache.
//
// A work item is one sequence and a run of its kv heads [h0, h1): the heads' K (then V) rows sit
// next to each other in each slot's row of the cache, so the item streams through contiguous
// memory (per-head items, hopping one 128-byte row per 1.5 KiB, measured 5-40x slower at 1024+
// tokens). Items are split across heads only as far as needed to keep every thread busy.
//
// Scores: 16 keys at a time per query head into 16 accumulators reduced together (sum16): BF16
// dot products on a bf16 cache and on a one-byte one read as bf16 (kBytesAsBf16), float32 FMAs on
// dequantized bytes otherwise; with several query heads per kv head (kKeysAsPairs), against the
// 16 keys turned pair-major once, one DPBF16PS per dim pair and no reduction. Softmax in float32.
// Values: every query head of the item in one pass over the value rows, sums in L1.
template <int kKind, typename KvT, int kHeadDim>
void decode_attention_avx512(const uint16_t* query, int64_t q_stride, const KvT* key_cache,
                             const KvT* value_cache,
                             const uint16_t* key_scales, const uint16_t* value_scales,
                             uint16_t* out, const int32_t* block_tables,
                             const int32_t* context_lens, int64_t batch, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             int64_t max_blocks, float scale, int64_t window, int num_threads) {
  constexpr bool kScaled = kKind != kKvPlain;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
  const infer_simd::DecodeSplit split(batch, num_kv_heads, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    // Loop bounds, here inside the region: it gets outside variables by reference, so a
    // constant computed out there would not be one in here (nor unroll the loops). The caller
    // picks kHeadDim > 0 only where head_dim equals it.
    const int64_t pairs = (kHeadDim > 0 ? kHeadDim : head_dim) / 32;  // 32 bf16 per dpbf16
    const int64_t lanes = (kHeadDim > 0 ? kHeadDim : head_dim) / 16;  // 16 float32 per vector
    std::vector<float> scores, qf, vacc, vsc;
    // 16 key rows of one kv head as bf16 (a one-byte cache read through the tables).
    [[maybe_unused]] alignas(64) uint16_t kconv[kBytesAsBf16<kKind, kHeadDim> ? 16 * kHeadDim : 1];
    std::vector<const KvT*> krows, vrows;
    std::vector<int64_t> slots;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < split.count(batch); ++item) {
      const auto [b, h0, h1, start, n] = split.item(item, context_lens, window);
      if (h0 >= h1) continue;
      const int64_t nq = (h1 - h0) * group;  // query heads of this item
      if (n <= 0) {
        std::memset(out + (b * num_heads + h0 * group) * head_dim, 0, nq * head_dim * 2);
        continue;
      }
      const int64_t npad = (n + 15) / 16 * 16;
      const int32_t* table = block_tables + b * max_blocks;
      scores.resize(nq * npad);
      krows.resize(npad);
      vrows.resize(n);
      slots.resize(npad);
      for (int64_t j = 0; j < npad; ++j) {
        const int64_t p = start + (j < n ? j : 0);  // padding keys repeat the first one
        const int64_t slot = infer_simd::paged_slot(table, p, block_size);
        slots[j] = slot;
        krows[j] = key_cache + slot * slot_stride + h0 * head_dim;
        if (j < n) vrows[j] = value_cache + slot * slot_stride + h0 * head_dim;
      }
      // The first kKeysAhead keys' rows, all at once (the loop below prefetches the rest).
      const int64_t item_bytes = (h1 - h0) * head_dim * static_cast<int64_t>(sizeof(KvT));
      for (int64_t j = 0; j < kKeysAhead && j < npad; ++j)
        infer_simd::prefetch_l2(krows[j], item_bytes);
      const uint16_t* qb = query + b * q_stride + h0 * group * head_dim;
      if constexpr (kScaled && !kBytesAsBf16<kKind, kHeadDim>) {  // float32, for FMAs
        qf.resize(nq * head_dim);
        for (int64_t i = 0; i < nq * head_dim; ++i) qf[i] = infer_simd::bf16_to_f32(qb[i]);
      }
      // Scores, laid out [nq][n] (masked stores: the padding keys' scores are never written),
      // scaled.
      const __m512 vscale = _mm512_set1_ps(scale);
      const int64_t head_bytes = head_dim * static_cast<int64_t>(sizeof(KvT));
      for (int64_t j0 = 0; j0 < npad; j0 += 16) {
        const int64_t cnt = n - j0 >= 16 ? 16 : n - j0;
        const auto valid = static_cast<__mmask16>((1u << cnt) - 1);
        for (int64_t kv = 0; kv < h1 - h0; ++kv) {
          const int64_t off = kv * head_dim;
          // The rows of the keys kKeysAhead on, one kv head's part with each kv head's scores:
          // a burst of every row at once (24 KiB) stalled on the CPU's miss buffers
          // (measured 25 -> 20-22 ms for 12 layers x 16 sequences x 1024 keys on Zen 5).
          if (j0 + kKeysAhead < npad) {
            for (int64_t i = j0 + kKeysAhead; i < j0 + kKeysAhead + 16 && i < npad; ++i)
              infer_simd::prefetch_l2(krows[i] + off, head_bytes);
          }
#ifdef INFER_HAVE_BYTE_TABLES
          if constexpr (kBytesAsBf16<kKind, kHeadDim>)  // once for all `group` query heads
            byte_rows_to_bf16<kKind, kHeadDim>(&krows[j0], off, 16, kconv);
#endif
          // Key i of the block as bf16 words: in the cache, or converted into kconv.
          [[maybe_unused]] auto bf16_key = [&](int i) -> const uint16_t* {
            if constexpr (kBytesAsBf16<kKind, kHeadDim>) return kconv + i * kHeadDim;
            else return reinterpret_cast<const uint16_t*>(krows[j0 + i] + off);
          };
          if constexpr (kKeysAsPairs<kKind, kHeadDim>) {
            if (group >= kMinGroupForPairs) {
              // The 16 keys' rows turned pair-major: kt[p] = dims (2p, 2p+1) of keys 0 .. 15,
              // once for all `group` query heads.
              alignas(64) __m512i kt[kHeadDim / 2];
              for (int64_t blk = 0; blk < kHeadDim / 32; ++blk) {
                __m512i rows[16];
                for (int i = 0; i < 16; ++i) rows[i] = _mm512_loadu_si512(bf16_key(i) + blk * 32);
                infer_simd::transpose16x16(rows);
                for (int w = 0; w < 16; ++w) kt[blk * 16 + w] = rows[w];
              }
              __m512 ksc = vscale;
              if constexpr (kScaled)
                ksc = _mm512_mul_ps(vscale, key_scales16(key_scales, &slots[j0], num_kv_heads,
                                                         h0 + kv));
              for (int64_t g = 0; g < group; ++g) {
                const int64_t h = kv * group + g;
                int32_t qp[kHeadDim / 2];  // the query's dim pairs, as 32-bit words
                std::memcpy(qp, qb + h * head_dim, sizeof(qp));
                __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                               _mm512_setzero_ps()};
                for (int64_t p = 0; p < kHeadDim / 2; p += 4)
                  for (int u = 0; u < 4; ++u)
                    a[u] = _mm512_dpbf16_ps(a[u], (__m512bh)_mm512_set1_epi32(qp[p + u]),
                                            (__m512bh)kt[p + u]);
                const __m512 s = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
                // The scores of a key come out of the transpose in the order key scales (or
                // vscale) are laid out: lane i is key j0 + i.
                _mm512_mask_storeu_ps(scores.data() + h * n + j0, valid, _mm512_mul_ps(s, ksc));
              }
              continue;
            }
          }
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            __m512 acc[16];
            for (int i = 0; i < 16; ++i) {
              __m512 s = _mm512_setzero_ps();
              if constexpr (kScaled && !kBytesAsBf16<kKind, kHeadDim>) {
                const KvT* k = krows[j0 + i] + off;
                const float* qh = qf.data() + h * head_dim;
                for (int64_t c = 0; c < lanes; ++c)
                  s = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c * 16), load_kv16<kKind>(k + c * 16),
                                      s);
              } else {
                const uint16_t* qh = qb + h * head_dim;
                const uint16_t* k = bf16_key(i);
                for (int64_t c = 0; c < pairs; ++c)
                  s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qh + c * 32),
                                       (__m512bh)_mm512_loadu_si512(k + c * 32));
              }
              acc[i] = s;
            }
            __m512 r = _mm512_mul_ps(sum16(acc), vscale);
            if constexpr (kScaled)
              r = _mm512_mul_ps(r, key_scales16(key_scales, &slots[j0], num_kv_heads, h0 + kv));
            _mm512_mask_storeu_ps(scores.data() + h * n + j0, valid, r);
          }
        }
      }
      // Softmax per query head, in float32 (times each value row's scale, for a scaled cache:
      // gathered once per kv head for its query heads, a scalar load per row that, repeated
      // per query head, took ~15% of the kernel with 32 query heads on 8 kv heads).
      if constexpr (kScaled) {
        vsc.resize((h1 - h0) * n);
        for (int64_t kv = 0; kv < h1 - h0; ++kv)
          for (int64_t j = 0; j < n; ++j)
            vsc[kv * n + j] = infer_simd::bf16_to_f32(value_scales[slots[j] * num_kv_heads + h0 + kv]);
      }
      for (int64_t h = 0; h < nq; ++h) {
        float* sg = scores.data() + h * n;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sg + j));
        float m = _mm512_reduce_max_ps(vmax);
        for (; j < n; ++j) m = sg[j] > m ? sg[j] : m;
        const __m512 vm = _mm512_set1_ps(m);
        __m512 vsum = _mm512_setzero_ps();
        for (j = 0; j < n; j += 16) {
          const __mmask16 mask = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sg + j), vm));
          _mm512_mask_storeu_ps(sg + j, mask, e);
          vsum = _mm512_mask_add_ps(vsum, mask, vsum, e);
        }
        const float sum = _mm512_reduce_add_ps(vsum);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const __m512 vinv = _mm512_set1_ps(inv);
        [[maybe_unused]] const float* vs = kScaled ? vsc.data() + (h / group) * n : nullptr;
        for (j = 0; j < n; j += 16) {
          const __mmask16 mask = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
          __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, sg + j), vinv);
          if constexpr (kScaled) w = _mm512_mul_ps(w, _mm512_maskz_loadu_ps(mask, vs + j));
          _mm512_mask_storeu_ps(sg + j, mask, w);
        }
      }
      // Values: every query head of the item in one pass over its value rows.
      vacc.resize(nq * head_dim + 16);
      auto* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(vacc.data()) + 63) & ~uintptr_t{63});
      weighted_values<kKind, KvT, kHeadDim>(scores.data(), n, vrows.data(), h1 - h0, group,
                                            head_dim, acc,
                             out + (b * num_heads + h0 * group) * head_dim);
    }
  }
}
#define INFER_HAVE_BF16_AVX512 1
#endif

}  // namespace

extern "C" {

// dtype: the query's and out's, 0 = float32, 1 = bfloat16; q_stride: elements from one
// sequence's query row to the next (heads are contiguous within a row; out is [B, H, D]). kv_kind: 0 = the caches hold the
// query's dtype; 1 = int8, 2 = float8 e4m3, each with bf16 scales [num_slots, kv_heads].
int infer_decode_attention(int dtype, int kv_kind, const void* query, int64_t q_stride,
                           const void* key_cache,
                           const void* value_cache, const uint16_t* key_scales,
                           const uint16_t* value_scales, void* out, const int32_t* block_tables,
                           const int32_t* context_lens, int64_t batch, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t max_blocks, float scale, int64_t window, int num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
  if (dtype != 0 && dtype != 1) return 2;
  if (kv_kind < 0 || kv_kind > 2 || (kv_kind != 0 && (!key_scales || !value_scales))) return 3;
#define INFER_ARGS(Q, KV)                                                                       \
  static_cast<const Q*>(query), q_stride, static_cast<const KV*>(key_cache),                   \
      static_cast<const KV*>(value_cache), key_scales, value_scales, static_cast<Q*>(out),      \
      block_tables, context_lens, batch, num_heads, num_kv_heads, head_dim, block_size,         \
      max_blocks, scale, window, num_threads
#ifdef INFER_HAVE_BF16_AVX512
  if (dtype == 1 && head_dim % 32 == 0 && head_dim <= 256) {
    // The common head sizes with head_dim a compile-time constant (unrolled lanes).
#define INFER_BY_HEAD_DIM(KIND, KV)                                                             \
  if (head_dim == 64) decode_attention_avx512<KIND, KV, 64>(INFER_ARGS(uint16_t, KV));          \
  else if (head_dim == 128) decode_attention_avx512<KIND, KV, 128>(INFER_ARGS(uint16_t, KV));   \
  else decode_attention_avx512<KIND, KV, 0>(INFER_ARGS(uint16_t, KV));
    if (kv_kind == kKvPlain) { INFER_BY_HEAD_DIM(kKvPlain, uint16_t) }
    else if (kv_kind == kKvInt8) { INFER_BY_HEAD_DIM(kKvInt8, int8_t) }
    else { INFER_BY_HEAD_DIM(kKvFp8, uint8_t) }
#undef INFER_BY_HEAD_DIM
    return 0;
  }
#endif
#ifdef INFER_HAVE_AVX2
  if (dtype == 1 && head_dim % 16 == 0 && head_dim <= 512)
    return infer_decode_attention_avx2(kv_kind, static_cast<const uint16_t*>(query), q_stride,
                                       key_cache, value_cache, key_scales, value_scales,
                                       static_cast<uint16_t*>(out), block_tables, context_lens,
                                       batch, num_heads, num_kv_heads, head_dim, block_size,
                                       max_blocks, scale, window, num_threads);
#endif
  if (dtype == 0) {
    if (kv_kind == kKvPlain) decode_attention<float, float, kKvPlain>(INFER_ARGS(float, float));
    else if (kv_kind == kKvInt8) decode_attention<float, int8_t, kKvInt8>(INFER_ARGS(float, int8_t));
    else decode_attention<float, uint8_t, kKvFp8>(INFER_ARGS(float, uint8_t));
  } else {
    if (kv_kind == kKvPlain)
      decode_attention<uint16_t, uint16_t, kKvPlain>(INFER_ARGS(uint16_t, uint16_t));
    else if (kv_kind == kKvInt8)
      decode_attention<uint16_t, int8_t, kKvInt8>(INFER_ARGS(uint16_t, int8_t));
    else
      decode_attention<uint16_t, uint8_t, kKvFp8>(INFER_ARGS(uint16_t, uint8_t));
  }
#undef INFER_ARGS
  return 0;
}

}  // extern "C"

// Prefill attention over the paged KV cache, for CPUs with AVX-512 BF16 (Zen 4/5, Sapphire
// Rapids and later) or AVX2 (the same layouts widened to float32 in registers): a prompt chunk of
// n tokens attends causally to its sequence's past and to itself, read in place from the cache
// through the block table (this step's K and V are stored before attention is called).
//
//   query  : [T, heads, head_dim] bf16 rows of the step (row stride q_stride elements)
//   cache  : [num_slots, kv_heads, head_dim] (one layer), slot = table[p / bs] * bs + p % bs;
//            bf16, or int8 / float8 with a bf16 scale per (slot, kv head), dequantized to bf16
//            as they are packed
//   out    : [T, heads, head_dim] bf16 (row stride out_stride elements); only the prefill rows
//            are written
//
// A work item is one (sequence, kv head). It packs the keys and values it can see once, in the
// layouts VDPBF16PS multiplies from, then walks its queries in tiles of about 48 (query, head)
// rows: all the group's query heads of a kv head share the packed keys and values (GQA).
//
//   keys   Kp[jb][p][16] : word p (the bf16 pair of dims 2p, 2p+1) of keys jb*16 .. jb*16+15
//   values Vw[j2][d]     : the bf16 pair (v[2 j2][d], v[2 j2 + 1][d]), keys taken two by two
//
//   key column c of a tile = absolute key position base + c;  for a tile of queries [qa, qb):
//
//        c_start (16-aligned)                        c_end = past + qb - base
//          |<---------------- scores S[rows][c] ------------->|
//   row r: |  -inf | visible keys lo(pos) .. pos | -inf ......|    pos = past + qa + r / group
//
// Scores are float32 (scale applied after the dot products), the softmax is float32, and its
// unnormalized probabilities are rounded to bf16 for the value products, as torch's CPU flash
// attention does for bf16; each row is divided by its float32 sum at the end.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>

#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define INFER_PREFILL_AVX512 1
#elif defined(INFER_HAVE_AVX2)
#define INFER_PREFILL_AVX2 1
#endif
#if defined(INFER_PREFILL_AVX512) || defined(INFER_PREFILL_AVX2)
#define INFER_HAVE_PREFILL_ATTENTION 1

namespace {

using infer_simd::paged_slot;

constexpr int kRowsPerTile = 48;  // (query, head) rows per tile: scores stay in L2 up to ~4K keys
constexpr int64_t kValueChunkBytes = 16384;  // value pairs per pass: 16 KiB of them

// One layer's K or V cache as bf16 rows: the stored rows themselves for a bf16 cache; for an
// int8 or float8 cache each row dequantized (value * its row's bf16 scale, in float32, rounded
// to bf16: what the torch path's KVCache.gather gives) into a scratch row.
struct KvRows {
  const void* cache;
  const uint16_t* scales;  // [num_slots, kv_heads] bf16, or null for a plain cache
  int kind;
  int64_t num_kv_heads, head_dim;
  int64_t row_stride = 0;  // elements from one slot's row to the next (0: num_kv_heads * head_dim)

  int64_t offset(int64_t slot, int64_t kvh) const {
    return slot * (row_stride ? row_stride : num_kv_heads * head_dim) + kvh * head_dim;
  }

  const uint16_t* row(int64_t slot, int64_t kvh, uint16_t* scratch) const {
    const int64_t at = offset(slot, kvh);
    if (kind == kKvPlain) return static_cast<const uint16_t*>(cache) + at;
    const float s = infer_simd::bf16_to_f32(scales[slot * num_kv_heads + kvh]);
    const uint8_t* q = static_cast<const uint8_t*>(cache) + at;
#ifdef INFER_HAVE_AVX512
    // 16 at a time (a NaN byte reads as 480 here, as load_fp8x16 reads it; never stored).
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m512 v = kind == kKvInt8 ? infer_simd::load_i8x16(reinterpret_cast<const int8_t*>(q) + d)
                                       : infer_simd::load_fp8x16(q + d);
      infer_simd::store_bf16x16(scratch + d, _mm512_mul_ps(v, _mm512_set1_ps(s)));
    }
#else
    for (int64_t d = 0; d < head_dim; ++d) {
      const float v = kind == kKvInt8 ? static_cast<float>(static_cast<int8_t>(q[d]))
                                      : infer_simd::fp8e4m3_to_f32(q[d]);
      scratch[d] = infer_simd::f32_to_bf16(v * s);
    }
#endif
    return scratch;
  }

  void prefetch(int64_t slot, int64_t kvh) const {
    const int64_t bytes = head_dim * (kind == kKvPlain ? 2 : 1);
    const char* at = static_cast<const char*>(cache) + offset(slot, kvh) * (bytes / head_dim);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(at + o);
  }
};

// Keys [base, base + nk) of kv head kvh -> Kp (zero keys up to a multiple of 16). scratch holds
// 16 rows of head_dim (a quantized cache's dequantized rows; zeros past the last key).
void pack_keys(const KvRows& keys, const int32_t* table, int64_t block_size, int64_t kvh,
               int64_t base, int64_t nk, uint16_t* scratch, uint32_t* kp) {
  const int64_t head_dim = keys.head_dim, pairs = head_dim / 2, nkb = (nk + 15) / 16;
  for (int64_t jb = 0; jb < nkb; ++jb) {
    uint32_t* dst = kp + jb * pairs * 16;
    if (jb + 1 < nkb)  // the next block's rows (gathered through the table: no stream to follow)
      for (int64_t j = (jb + 1) * 16; j < (jb + 2) * 16 && j < nk; ++j)
        keys.prefetch(paged_slot(table, base + j, block_size), kvh);
    const uint32_t* src[16];
    for (int64_t jj = 0; jj < 16; ++jj) {
      const int64_t j = jb * 16 + jj;
      uint16_t* own = scratch + jj * head_dim;
      if (j >= nk) std::memset(own, 0, head_dim * 2);
      src[jj] = reinterpret_cast<const uint32_t*>(
          j < nk ? keys.row(paged_slot(table, base + j, block_size), kvh, own) : own);
    }
#ifdef INFER_PREFILL_AVX512
    // 16 keys x 16 words at a time, transposed in registers (pairs is a multiple of 16); with
    // the prefetches above, a 1024-token prompt's attention took 6.2 -> 5.8 ms a layer on Zen 4
    // against packing a word at a time.
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512i r[16];
      for (int jj = 0; jj < 16; ++jj) r[jj] = _mm512_loadu_si512(src[jj] + p0);
      infer_simd::transpose16x16(r);
      for (int e = 0; e < 16; ++e) _mm512_storeu_si512(dst + (p0 + e) * 16, r[e]);
    }
#else
    for (int64_t jj = 0; jj < 16; ++jj)
      for (int64_t p = 0; p < pairs; ++p) dst[p * 16 + jj] = src[jj][p];
#endif
  }
}

// Values [base, base + nk) of kv head kvh -> Vw (a zero value pairs with an odd last key; pairs
// up to a multiple of 8, so every 16-column chunk of probabilities has its 8 value pairs).
void pack_values(const KvRows& values, const int32_t* table, int64_t block_size, int64_t kvh,
                 int64_t base, int64_t nk, uint16_t* scratch, uint32_t* vw) {
  const int64_t head_dim = values.head_dim;
  const int64_t npairs = (nk + 15) / 16 * 8;
  for (int64_t j2 = 0; j2 < npairs; ++j2) {
    if (j2 % 8 == 0)  // the next 16 rows
      for (int64_t j = 2 * j2 + 16; j < 2 * j2 + 32 && j < nk; ++j)
        values.prefetch(paged_slot(table, base + j, block_size), kvh);
    uint32_t* dst = vw + j2 * head_dim;
    const int64_t j0 = 2 * j2, j1 = 2 * j2 + 1;
    if (j0 >= nk) {
      std::memset(dst, 0, head_dim * 4);
      continue;
    }
    const uint16_t* a = values.row(paged_slot(table, base + j0, block_size), kvh, scratch);
    if (j1 < nk) {
      const uint16_t* b = values.row(paged_slot(table, base + j1, block_size), kvh, scratch + head_dim);
#ifdef INFER_PREFILL_AVX2
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = a[d] | static_cast<uint32_t>(b[d]) << 16;
#else
      for (int64_t d = 0; d < head_dim; d += 32) {  // interleave 32 dims of a and b
        const __m512i va = _mm512_loadu_si512(a + d), vb = _mm512_loadu_si512(b + d);
        const __m512i lo_idx = _mm512_set_epi16(
            47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
        _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(va, lo_idx, vb));
        _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(va, hi_idx, vb));
      }
#endif
    } else {
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = a[d];
    }
  }
}

#ifdef INFER_PREFILL_AVX512

// S[i][jb*16 ..] = q_i . k for MR rows and NB blocks of 16 keys, float32.
template <int MR, int NB>
inline void qk_block(const uint16_t* const* qrows, const uint32_t* kp, int64_t pairs, float* s,
                     int64_t s_stride, __m512 scale) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh kv[NB];
    for (int j = 0; j < NB; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(kp + (j * pairs + p) * 16);
    for (int i = 0; i < MR; ++i) {
      uint32_t w;
      std::memcpy(&w, qrows[i] + 2 * p, 4);
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], qv, kv[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(s + i * s_stride + j * 16, _mm512_mul_ps(acc[i][j], scale));
}

template <int NB>
inline void qk_rows(int rows, const uint16_t* const* qrows, const uint32_t* kp, int64_t pairs,
                    float* s, int64_t s_stride, __m512 scale) {
  switch (rows) {
    case 1: qk_block<1, NB>(qrows, kp, pairs, s, s_stride, scale); break;
    case 2: qk_block<2, NB>(qrows, kp, pairs, s, s_stride, scale); break;
    case 3: qk_block<3, NB>(qrows, kp, pairs, s, s_stride, scale); break;
    case 4: qk_block<4, NB>(qrows, kp, pairs, s, s_stride, scale); break;
    case 5: qk_block<5, NB>(qrows, kp, pairs, s, s_stride, scale); break;
    default: qk_block<6, NB>(qrows, kp, pairs, s, s_stride, scale); break;
  }
}

// acc_i[d0 ..] (+)= sum_j p_i[j] v_j for MR rows and NB blocks of 16 dims, over npairs key
// pairs; float32 sums kept in acc (row i at acc + i * head_dim), started from zero if first.
template <int MR, int NB>
inline void pv_block(const uint16_t* pr, int64_t p_stride, const uint32_t* vw, int64_t head_dim,
                     int64_t npairs, bool first, float* acc_rows) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j)
      acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_rows + i * head_dim + j * 16);
  for (int64_t j2 = 0; j2 < npairs; ++j2) {
    __m512bh vv[NB];
    for (int j = 0; j < NB; ++j) vv[j] = (__m512bh)_mm512_loadu_si512(vw + j2 * head_dim + j * 16);
    for (int i = 0; i < MR; ++i) {
      uint32_t w;
      std::memcpy(&w, pr + i * p_stride + 2 * j2, 4);
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pv, vv[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(acc_rows + i * head_dim + j * 16, acc[i][j]);
}

template <int NB>
inline void pv_rows(int rows, const uint16_t* pr, int64_t p_stride, const uint32_t* vw,
                    int64_t head_dim, int64_t npairs, bool first, float* acc) {
  switch (rows) {
    case 1: pv_block<1, NB>(pr, p_stride, vw, head_dim, npairs, first, acc); break;
    case 2: pv_block<2, NB>(pr, p_stride, vw, head_dim, npairs, first, acc); break;
    case 3: pv_block<3, NB>(pr, p_stride, vw, head_dim, npairs, first, acc); break;
    case 4: pv_block<4, NB>(pr, p_stride, vw, head_dim, npairs, first, acc); break;
    case 5: pv_block<5, NB>(pr, p_stride, vw, head_dim, npairs, first, acc); break;
    default: pv_block<6, NB>(pr, p_stride, vw, head_dim, npairs, first, acc); break;
  }
}

using Prob = uint16_t;  // probabilities, rounded to bf16 for the value products
constexpr int64_t kTileRows = 6;  // rows per micro-kernel call

// Scores of rows r0 .. r0 + mr - 1 against nb blocks of 16 keys (nb <= 4), scaled.
inline void qk_tile(int nb, int mr, const uint16_t* const* q, const uint32_t* kp, int64_t pairs,
                    float* s, int64_t s_stride, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale);
  switch (nb) {
    case 1: qk_rows<1>(mr, q, kp, pairs, s, s_stride, vscale); break;
    case 2: qk_rows<2>(mr, q, kp, pairs, s, s_stride, vscale); break;
    case 3: qk_rows<3>(mr, q, kp, pairs, s, s_stride, vscale); break;
    default: qk_rows<4>(mr, q, kp, pairs, s, s_stride, vscale); break;
  }
}

// Value sums of mr rows over npairs key pairs, for nb blocks of 16 dims (nb <= 4).
inline void pv_tile(int nb, int mr, const Prob* pr, int64_t p_stride, const uint32_t* vw,
                    int64_t head_dim, int64_t npairs, bool first, float* acc) {
  switch (nb) {
    case 1: pv_rows<1>(mr, pr, p_stride, vw, head_dim, npairs, first, acc); break;
    case 2: pv_rows<2>(mr, pr, p_stride, vw, head_dim, npairs, first, acc); break;
    case 3: pv_rows<3>(mr, pr, p_stride, vw, head_dim, npairs, first, acc); break;
    default: pv_rows<4>(mr, pr, p_stride, vw, head_dim, npairs, first, acc); break;
  }
}

// One row's softmax: visible columns [lo, hi]; everything else becomes probability 0. Only the
// 16-column chunks that straddle lo or hi need a mask. Returns 1 / the sum of the row.
inline float softmax_row(const float* s, Prob* p, int64_t lo, int64_t hi, int64_t ncols) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int64_t c_lo = lo / 16 * 16, c_hi = hi / 16 * 16;  // first and last chunk used
  auto mask_of = [&](int64_t c) -> __mmask16 {
    const __m512i col = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(c)));
    return _mm512_cmpge_epi32_mask(col, _mm512_set1_epi32(static_cast<int>(lo))) &
           _mm512_cmple_epi32_mask(col, _mm512_set1_epi32(static_cast<int>(hi)));
  };
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t c = c_lo; c <= c_hi; c += 16) {
    const __mmask16 ok = (c == c_lo || c == c_hi) ? mask_of(c) : 0xffff;
    vmax = _mm512_mask_max_ps(vmax, ok, vmax, _mm512_loadu_ps(s + c));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t c = 0; c < c_lo; c += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + c), _mm256_setzero_si256());
  for (int64_t c = c_lo; c <= c_hi; c += 16) {
    __m512 e = infer_simd::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + c), m));
    if (c == c_lo || c == c_hi) e = _mm512_maskz_mov_ps(mask_of(c), e);
    vsum = _mm512_add_ps(vsum, e);
    // Values in [0, 1], never NaN or denormal (exp16 stops at e^-87): the BF16 instruction
    // rounds them to nearest even like the integer path.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + c), (__m256i)_mm512_cvtneps_pbh(e));
  }
  for (int64_t c = c_hi + 16; c < ncols; c += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + c), _mm256_setzero_si256());
  const float sum = _mm512_reduce_add_ps(vsum);
  return sum > 0.f ? 1.f / sum : 0.f;
}

// out = bf16(o * inv), head_dim values.
inline void store_row(uint16_t* out, const float* o, float inv, int64_t head_dim) {
  const __m512 v = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < head_dim; d += 16)
    infer_simd::store_bf16x16(out + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), v));
}

#endif  // INFER_PREFILL_AVX512

#ifdef INFER_PREFILL_AVX2

// AVX2: no bf16 products, so the packed words are widened in registers as linear_avx2.cpp does
// (a word's low half shifted up is the even element, its high half masked the odd one) and
// multiplied in float32 FMAs; the probabilities are kept as float32 values rounded to bf16 (the
// same numbers the bf16 path multiplies).
using Prob = float;
constexpr int64_t kTileRows = 4;

using infer_simd::pair_hi;
using infer_simd::pair_lo;

// acc[i][h] (+)= sum_p a_i[2p] * lo(w[p][h]) + a_i[2p+1] * hi(w[p][h]): MR rows of float32 a
// (row i at a + i * a_stride) against 16 lanes of packed words (w + p * w_stride, two vectors).
template <int MR>
inline void fma_words(const float* a, int64_t a_stride, const uint32_t* w, int64_t w_stride,
                      int64_t n, __m256 (&acc)[MR][2]) {
  for (int64_t p = 0; p < n; ++p) {
    const auto* wp = reinterpret_cast<const __m256i*>(w + p * w_stride);
    const __m256 lo0 = pair_lo(_mm256_loadu_si256(wp)), lo1 = pair_lo(_mm256_loadu_si256(wp + 1));
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * a_stride + 2 * p);
      acc[i][0] = _mm256_fmadd_ps(x, lo0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(x, lo1, acc[i][1]);
    }
    const __m256 hi0 = pair_hi(_mm256_loadu_si256(wp)), hi1 = pair_hi(_mm256_loadu_si256(wp + 1));
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * a_stride + 2 * p + 1);
      acc[i][0] = _mm256_fmadd_ps(x, hi0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(x, hi1, acc[i][1]);
    }
  }
}

template <int MR>
inline void qk_block(const float* qf, int64_t head_dim, const uint32_t* kp, int64_t pairs,
                     float* s, int64_t s_stride, __m256 scale) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  fma_words<MR>(qf, head_dim, kp, 16, pairs, acc);
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(s + i * s_stride + 8 * h, _mm256_mul_ps(acc[i][h], scale));
}

inline void qk_tile(int nb, int mr, const uint16_t* const* q, const uint32_t* kp, int64_t pairs,
                    float* s, int64_t s_stride, float scale) {
  const int64_t head_dim = 2 * pairs;
  alignas(32) float qf[kTileRows * 256];  // the rows in float32 (head_dim <= 256)
  for (int i = 0; i < mr; ++i)
    for (int64_t d = 0; d < head_dim; ++d) qf[i * head_dim + d] = infer_simd::bf16_to_f32(q[i][d]);
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int j = 0; j < nb; ++j) {
    const uint32_t* kb = kp + j * pairs * 16;
    switch (mr) {
      case 1: qk_block<1>(qf, head_dim, kb, pairs, s + j * 16, s_stride, vscale); break;
      case 2: qk_block<2>(qf, head_dim, kb, pairs, s + j * 16, s_stride, vscale); break;
      case 3: qk_block<3>(qf, head_dim, kb, pairs, s + j * 16, s_stride, vscale); break;
      default: qk_block<4>(qf, head_dim, kb, pairs, s + j * 16, s_stride, vscale); break;
    }
  }
}

template <int MR>
inline void pv_block(const Prob* pr, int64_t p_stride, const uint32_t* vw, int64_t head_dim,
                     int64_t npairs, bool first, float* acc_rows) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h)
      acc[i][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_rows + i * head_dim + 8 * h);
  fma_words<MR>(pr, p_stride, vw, head_dim, npairs, acc);
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc_rows + i * head_dim + 8 * h, acc[i][h]);
}

inline void pv_tile(int nb, int mr, const Prob* pr, int64_t p_stride, const uint32_t* vw,
                    int64_t head_dim, int64_t npairs, bool first, float* acc) {
  for (int j = 0; j < nb; ++j) {
    switch (mr) {
      case 1: pv_block<1>(pr, p_stride, vw + j * 16, head_dim, npairs, first, acc + j * 16); break;
      case 2: pv_block<2>(pr, p_stride, vw + j * 16, head_dim, npairs, first, acc + j * 16); break;
      case 3: pv_block<3>(pr, p_stride, vw + j * 16, head_dim, npairs, first, acc + j * 16); break;
      default: pv_block<4>(pr, p_stride, vw + j * 16, head_dim, npairs, first, acc + j * 16); break;
    }
  }
}

inline float softmax_row(const float* s, Prob* p, int64_t lo, int64_t hi, int64_t ncols) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t c_lo = lo / 8 * 8, c_hi = hi / 8 * 8;
  auto visible = [&](int64_t c) {  // lanes with lo <= column <= hi
    const __m256i col = _mm256_add_epi32(iota, _mm256_set1_epi32(static_cast<int>(c)));
    const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(lo)), col);
    const __m256i above = _mm256_cmpgt_epi32(col, _mm256_set1_epi32(static_cast<int>(hi)));
    return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_or_si256(below, above), _mm256_set1_epi32(-1)));
  };
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int64_t c = c_lo; c <= c_hi; c += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + c), visible(c)));
  const __m256 m = _mm256_set1_ps(infer_simd::reduce_max8(vmax));
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t c = 0; c < c_lo; c += 8) _mm256_storeu_ps(p + c, _mm256_setzero_ps());
  for (int64_t c = c_lo; c <= c_hi; c += 8) {
    const __m256 e = _mm256_and_ps(infer_simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), m)), visible(c));
    vsum = _mm256_add_ps(vsum, e);
    _mm256_storeu_ps(p + c, infer_simd::round_bf16x8(e));
  }
  for (int64_t c = c_hi + 8; c < ncols; c += 8) _mm256_storeu_ps(p + c, _mm256_setzero_ps());
  const float sum = infer_simd::reduce_add8(vsum);
  return sum > 0.f ? 1.f / sum : 0.f;
}

inline void store_row(uint16_t* out, const float* o, float inv, int64_t head_dim) {
  const __m256 v = _mm256_set1_ps(inv);
  for (int64_t d = 0; d < head_dim; d += 8)
    infer_simd::store_bf16x8(out + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), v));
}

#endif  // INFER_PREFILL_AVX2

struct Buffers {
  std::vector<uint32_t> kp, vw;
  std::vector<float> s, inv, o;
  std::vector<Prob> p;
  std::vector<uint16_t> scratch;
  std::vector<const uint16_t*> qrows;
  std::vector<uint16_t*> orows;
  std::vector<int64_t> lo, hi;  // per row: first and last visible key column
};

// A score added by how far a key is from its query (MPNet's relative position buckets,
// ALiBi's slopes): head h's bias for key j of query i is at[h * row + (j - i) + reach], for
// |j - i| <= reach.
struct DistanceBias {
  const float* at = nullptr;  // [heads, row] float32, or null: none
  int64_t reach = 0;
  int64_t row() const { return 2 * reach + 1; }
};

// One (sequence, kv head): queries [0, n) at positions past .. past + n - 1; each sees the
// keys up to its own position (window > 0: the last ``window`` of them), or with
// ``bidirectional`` (an encoder: past 0) all n (window > 0: those at most ``window`` away on
// either side, ModernBERT's local layers); ``bias``: added to the scaled scores.
void attend_item(const uint16_t* query, int64_t q_stride, const KvRows& keys,
                 const KvRows& values, uint16_t* out, int64_t out_stride,
                 const int32_t* table, int64_t q_start, int64_t n, int64_t past, int64_t kvh,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 float scale, int64_t window, bool bidirectional, const DistanceBias& bias,
                 Buffers& buf, int64_t num_keys = -1) {
  const int64_t group = num_heads / num_kv_heads, pairs = head_dim / 2;
  const int64_t reach = bidirectional ? window : window - 1;  // keys before a query it sees
  // (bidirectional: only the first num_keys rows are keys when num_keys >= 0; the rows after
  // them are queries only, as a ColBERT query's expansion tokens)
  const int64_t key_end = bidirectional && num_keys >= 0 ? num_keys : past + n;
  // the last key a query at pos sees (inclusive)
  auto last_key = [&](int64_t pos) {
    if (!bidirectional) return pos;
    return window > 0 && pos + window < key_end ? pos + window : key_end - 1;
  };
  // (never past its last: a query further than the window from every key sees the last one)
  auto first_key = [&](int64_t pos) {
    const int64_t first = window > 0 && pos - reach > 0 ? pos - reach : 0;
    return first < last_key(pos) ? first : last_key(pos);
  };
  const int64_t base = first_key(past) / 16 * 16;  // every column index is relative to base
  const int64_t nk = past + n - base;
  const int64_t nk16 = (nk + 15) / 16 * 16;
  buf.kp.resize(nk16 * pairs);
  buf.vw.resize(nk16 / 2 * head_dim);
  buf.scratch.resize(16 * head_dim);  // pack_keys: 16 rows; pack_values: 2
  pack_keys(keys, table, block_size, kvh, base, nk, buf.scratch.data(), buf.kp.data());
  pack_values(values, table, block_size, kvh, base, nk, buf.scratch.data(), buf.vw.data());

  const int64_t tile_queries = kRowsPerTile / group > 0 ? kRowsPerTile / group : 1;
  for (int64_t qa = 0; qa < n; qa += tile_queries) {
    const int64_t qb = qa + tile_queries < n ? qa + tile_queries : n;
    const int64_t rows = (qb - qa) * group;
    const int64_t c_start = (first_key(past + qa) - base) / 16 * 16;
    const int64_t c_end = last_key(past + qb - 1) + 1 - base;
    const int64_t ncols = (c_end - c_start + 15) / 16 * 16;
    buf.s.resize(rows * ncols);
    buf.p.resize(rows * ncols);
    buf.inv.resize(rows);
    buf.qrows.resize(rows);
    buf.orows.resize(rows);
    buf.lo.resize(rows);
    buf.hi.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qi = qa + r / group, h = kvh * group + r % group;
      buf.qrows[r] = query + (q_start + qi) * q_stride + h * head_dim;
      buf.orows[r] = out + (q_start + qi) * out_stride + h * head_dim;
      buf.lo[r] = first_key(past + qi) - base - c_start;
      buf.hi[r] = last_key(past + qi) - base - c_start;  // inclusive
    }
    // Scores, scaled: a block of 64 keys (in L1) against every row, kTileRows rows at a time.
    const uint32_t* kp0 = buf.kp.data() + c_start / 16 * pairs * 16;
    for (int64_t c = 0; c < ncols; c += 64) {
      const int nb = static_cast<int>((ncols - c) / 16 < 4 ? (ncols - c) / 16 : 4);
      const uint32_t* kp = kp0 + c / 16 * pairs * 16;
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
        const int mr = static_cast<int>(rows - r0 < kTileRows ? rows - r0 : kTileRows);
        qk_tile(nb, mr, buf.qrows.data() + r0, kp, pairs, buf.s.data() + r0 * ncols + c, ncols,
                scale);
      }
    }
    if (bias.at != nullptr)  // column c is key base + c_start + c, at (that - query) + reach
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t qi = qa + r / group, h = kvh * group + r % group;
        const float* b = bias.at + h * bias.row() + bias.reach + base + c_start - (past + qi);
        float* s = buf.s.data() + r * ncols;
        for (int64_t c = buf.lo[r]; c <= buf.hi[r]; ++c) s[c] += b[c];
      }
    for (int64_t r = 0; r < rows; ++r)
      buf.inv[r] = softmax_row(buf.s.data() + r * ncols, buf.p.data() + r * ncols, buf.lo[r],
                               buf.hi[r], ncols);
    // Values: 16 KiB of value pairs at a time (in L1) into every row's float32 sums.
    const uint32_t* vw0 = buf.vw.data() + c_start / 2 * head_dim;
    const int64_t npairs = ncols / 2;
    const int64_t chunk = kValueChunkBytes / (head_dim * 4);
    buf.o.resize(rows * head_dim);
    for (int64_t j0 = 0; j0 < npairs; j0 += chunk) {
      const int64_t nj = npairs - j0 < chunk ? npairs - j0 : chunk;
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
        const int mr = static_cast<int>(rows - r0 < kTileRows ? rows - r0 : kTileRows);
        const Prob* pr = buf.p.data() + r0 * ncols + 2 * j0;
        for (int64_t d = 0; d < head_dim; d += 64) {
          const int nb = static_cast<int>((head_dim - d) / 16 < 4 ? (head_dim - d) / 16 : 4);
          pv_tile(nb, mr, pr, ncols, vw0 + j0 * head_dim + d, head_dim, nj, j0 == 0,
                  buf.o.data() + r0 * head_dim + d);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      store_row(buf.orows[r], buf.o.data() + r * head_dim, buf.inv[r], head_dim);
  }
}

}  // namespace
#endif

extern "C" {

// Whether infer_prefill_attention runs on this CPU (AVX-512 BF16).
int infer_prefill_attention_available() {
#ifdef INFER_HAVE_PREFILL_ATTENTION
  return 1;
#else
  return 0;
#endif
}

// Prefill attention of num_seqs prompt chunks (bf16 query and out; head_dim a multiple of 32,
// at most 256). kv_kind 0: a bf16 cache; 1 int8, 2 float8 e4m3, each with bf16 scales
// [num_slots, kv_heads]. Chunk i: query rows q_starts[i] .. q_starts[i] + q_lens[i] - 1 at
// positions pasts[i] .. , its block table row block_tables[i * max_blocks ..]. window > 0: a
// query at position p sees keys p - window < j <= p.
int infer_prefill_attention(const uint16_t* query, int64_t q_stride, int kv_kind,
                            const void* key_cache, const void* value_cache,
                            const uint16_t* key_scales, const uint16_t* value_scales,
                            uint16_t* out, int64_t out_stride,
                            const int32_t* block_tables, const int64_t* q_starts,
                            const int64_t* q_lens, const int64_t* pasts, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                            int num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
  if (head_dim % 32 != 0 || head_dim > 256) return 2;
  if (kv_kind < 0 || kv_kind > 2 || (kv_kind != kKvPlain && (!key_scales || !value_scales))) return 4;
#ifdef INFER_HAVE_PREFILL_ATTENTION
  const KvRows keys{key_cache, key_scales, kv_kind, num_kv_heads, head_dim};
  const KvRows values{value_cache, value_scales, kv_kind, num_kv_heads, head_dim};
  const int64_t items = num_seqs * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
  {
    Buffers buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t i = item / num_kv_heads, kvh = item % num_kv_heads;
      if (q_lens[i] <= 0) continue;
      attend_item(query, q_stride, keys, values, out, out_stride,
                  block_tables + i * max_blocks, q_starts[i], q_lens[i], pasts[i], kvh,
                  num_heads, num_kv_heads, head_dim, block_size, scale, window, false, DistanceBias{},
                  buf);
    }
  }
  return 0;
#else
  (void)query; (void)q_stride; (void)key_cache; (void)value_cache; (void)out; (void)out_stride;
  (void)key_scales; (void)value_scales;
  (void)block_tables; (void)q_starts; (void)q_lens; (void)pasts; (void)num_seqs;
  (void)block_size; (void)max_blocks; (void)scale; (void)window; (void)num_threads;
  return 3;
#endif
}

// An encoder's attention: sequence i's query rows q_starts[i] .. q_starts[i] + q_lens[i] - 1
// attend to all of that sequence's keys and values (its own rows of key / value: no cache),
// or with window > 0 to those at most window rows away on either side; key_lens (or null):
// only the sequence's first key_lens[i] rows are keys (1 .. q_lens[i]). query / out
// [T, heads, head_dim], key / value [T, kv_heads, head_dim], bf16, each row q_stride /
// out_stride / k_stride / v_stride elements after the one before (heads contiguous in a row).
// distance_bias (or null): float32 [heads, 2 * bias_reach + 1], head h's entry
// (j - i) + bias_reach added to the scaled score of key j for query i (every sequence at most
// bias_reach + 1 rows long). Each sequence's rows are read as a "cache" of one block holding
// them all.
int infer_encoder_attention(const uint16_t* query, int64_t q_stride, const uint16_t* key,
                            int64_t k_stride, const uint16_t* value, int64_t v_stride,
                            uint16_t* out, int64_t out_stride, const int64_t* q_starts,
                            const int64_t* q_lens, const int64_t* key_lens, int64_t window,
                            const float* distance_bias, int64_t bias_reach, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            float scale, int num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
  if (head_dim % 32 != 0 || head_dim > 256) return 2;
  if (distance_bias != nullptr)
    for (int64_t i = 0; i < num_seqs; ++i)
      if (q_lens[i] > bias_reach + 1) return 5;
  if (key_lens != nullptr)
    for (int64_t i = 0; i < num_seqs; ++i)
      if (key_lens[i] < 1 || key_lens[i] > q_lens[i]) return 6;
#ifdef INFER_HAVE_PREFILL_ATTENTION
  const DistanceBias bias{distance_bias, bias_reach};
  const int64_t items = num_seqs * num_kv_heads;
  const int32_t table[1] = {0};
#pragma omp parallel num_threads(num_threads)
  {
    Buffers buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t i = item / num_kv_heads, kvh = item % num_kv_heads, n = q_lens[i];
      if (n <= 0) continue;
      const KvRows keys{key + q_starts[i] * k_stride, nullptr, kKvPlain, num_kv_heads, head_dim,
                        k_stride};
      const KvRows values{value + q_starts[i] * v_stride, nullptr, kKvPlain, num_kv_heads,
                          head_dim, v_stride};
      attend_item(query, q_stride, keys, values, out, out_stride, table, q_starts[i], n, 0, kvh,
                  num_heads, num_kv_heads, head_dim, n, scale, window, true, bias, buf,
                  key_lens != nullptr ? key_lens[i] : -1);
    }
  }
  return 0;
#else
  (void)query; (void)q_stride; (void)key; (void)k_stride; (void)value; (void)v_stride; (void)out;
  (void)out_stride; (void)q_starts; (void)q_lens; (void)window; (void)num_seqs; (void)scale;
  (void)num_threads; (void)distance_bias; (void)bias_reach; (void)key_lens;
  return 3;
#endif
}

}  // extern "C"

// Shared helpers of the CPU kernels: paged-cache slots, bfloat16 <-> float32 and exp, scalar,
// AVX2 and AVX-512; a per-thread scratch buffer.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#define INFER_HAVE_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define INFER_HAVE_AVX2 1
#endif

// How the KV cache stores its values (the Python side's kv_quant.KIND_CODES).
enum KvKind { kKvPlain = 0, kKvInt8 = 1, kKvFp8 = 2 };

namespace infer_simd {

// f(std::integral_constant<int, R>{}) with R = n for 1 <= n < Max, else R = Max: the kernels'
// blocks take their row and column-block counts as template arguments (their accumulators
// live in registers), and a step's counts are known only at run time.
template <int Max, int R = 1, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (R == Max) {
    f(std::integral_constant<int, R>{});
  } else if (n == R) {
    f(std::integral_constant<int, R>{});
  } else {
    with_count<Max, R + 1>(n, std::forward<F>(f));
  }
}

// The cache slot of position pos of a sequence with this block table row.
inline int64_t paged_slot(const int32_t* table, int64_t pos, int64_t block_size) {
  return static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
}

#if defined(INFER_HAVE_AVX512) || defined(INFER_HAVE_AVX2)
// Bytes [p, p + bytes) into L2, a cache line at a time: for cache rows gathered through a block
// table, which the hardware prefetchers cannot follow (why L2 and not L1: paged_attention.cpp).
inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* r = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T1);
}
#endif

// Decode attention's work items: a sequence and a run of its kv heads [h0, h1), whose K (then
// V) rows sit next to each other in each slot's row of the cache. Items are split across heads
// only as far as needed to keep every thread busy. Keys [start, start + n) are visible (a
// sliding window drops the older ones).
struct DecodeItem {
  int64_t b, h0, h1, start, n;
};

struct DecodeSplit {
  int64_t splits, heads_per_item, num_kv_heads;

  DecodeSplit(int64_t batch, int64_t kv_heads, int num_threads) : num_kv_heads(kv_heads) {
    splits = (2 * num_threads + batch - 1) / batch;
    if (splits > num_kv_heads) splits = num_kv_heads;
    if (splits < 1) splits = 1;
    heads_per_item = (num_kv_heads + splits - 1) / splits;
  }

  int64_t count(int64_t batch) const { return batch * splits; }

  // Item i; h0 >= h1 for an empty one.
  DecodeItem item(int64_t i, const int32_t* context_lens, int64_t window) const {
    const int64_t b = i / splits, h0 = (i % splits) * heads_per_item;
    const int64_t h1 = h0 + heads_per_item < num_kv_heads ? h0 + heads_per_item : num_kv_heads;
    const int64_t len = context_lens[b];
    const int64_t start = (window > 0 && len > window) ? len - window : 0;
    return {b, h0, h1, start, len - start};
  }
};

inline float bf16_to_f32(uint16_t x) {  // the bf16 bits are the high half of the float's
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float x) {  // round to nearest even, as torch does; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// bf16 at or above x (x >= 0): a KV scale rounded up, so |value| / scale stays in range.
inline uint16_t f32_to_bf16_up(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (u & 0xffffu) u += 0x10000u;
  return static_cast<uint16_t>(u >> 16);
}

// float8 e4m3 ("fn": no infinities, 0x7f/0xff are NaN, largest finite 448) <-> float32, by
// assembling and rounding the bits (no frexp / ldexp calls: the fp8 KV cache's prefill stored
// and read every value through them, 105 + 85 ms of a 540 ms 1,024-token prefill step on the
// ~110M Llama). Checked bit for bit against the libm formulation over all 2^32 floats.
inline float fp8e4m3_to_f32(uint8_t b) {
  const uint32_t e = (b >> 3) & 15, m = b & 7, sign = static_cast<uint32_t>(b & 0x80) << 24;
  uint32_t u;
  if (e == 15 && m == 7) {
    u = sign | 0x7fc00000u;  // NaN
  } else if (e == 0) {       // subnormal: m * 2^-9, exact in float32
    const float v = static_cast<float>(m) * (1.f / 512.f);
    std::memcpy(&u, &v, 4);
    u |= sign;
  } else {                   // 2^(e - 7) * (1 + m / 8)
    u = sign | ((e + 120) << 23) | (m << 20);
  }
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// Round to nearest even, saturating at +-448 (as scaled KV values never exceed it).
inline uint8_t f32_to_fp8e4m3(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  u &= 0x7fffffffu;                            // |x|
  if (u > 0x7f800000u) return sign | 0x7f;     // NaN
  if (u >= 0x43e00000u) return sign | 0x7e;    // >= 448 (and infinity): the largest finite
  if (u < 0x3c800000u) {                       // below 2^-6: subnormal, k * 2^-9, k = 0..8
    float a;
    std::memcpy(&a, &u, 4);
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));
  }
  // The 23 mantissa bits rounded to 3, half to even; a carry moves into the exponent.
  const uint32_t r = u + 0x7ffffu + ((u >> 20) & 1u);
  const int exp = static_cast<int>(r >> 23) - 127;
  const uint32_t q = (r >> 20) & 7u;
  if (exp > 8 || (exp == 8 && q == 7)) return sign | 0x7e;
  return sign | static_cast<uint8_t>(((exp + 7) << 3) | q);
}

// A per-thread scratch buffer of at least `bytes` (64-byte aligned), kept between calls: freeing
// it every call would give it back to the OS and fault its pages in again. kSlot: a second,
// independent buffer for a kernel that needs two at once.
template <int kSlot = 0>
inline void* thread_scratch(int64_t bytes) {
  struct Buffer {
    void* data = nullptr;
    int64_t bytes = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buf;
  if (buf.bytes < bytes) {
    std::free(buf.data);
    buf.data = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    buf.bytes = bytes;
  }
  return buf.data;
}

#ifdef INFER_HAVE_AVX2

// 8 bf16 -> 8 float32.
inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// float32 lanes rounded to nearest even bf16 as torch rounds them (a NaN stays a NaN, quieted),
// in the high half of each 32-bit lane; the low half is left over.
inline __m256i round_bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
}

// 8 float32 -> 8 bf16.
inline __m128i to_bf16x8(__m256 v) {
  const __m256i hi = _mm256_srli_epi32(round_bf16_bits8(v), 16);  // 8 x 16 bits in 32-bit lanes
  return _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
}

inline void store_bf16x8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16x8(v));
}

// 8 float32 sums -> y[at .. at + 7]: float32 (kOutF32), or rounded to bf16 (the AVX2 linears').
template <bool kOutF32>
inline void store_out8(void* y, int64_t at, __m256 v) {
  if (kOutF32)
    _mm256_storeu_ps(static_cast<float*>(y) + at, v);
  else
    store_bf16x8(static_cast<uint16_t*>(y) + at, v);
}

// 8 words, each a pair of bf16 (low half: element 2i, high half: element 2i + 1), -> the 8
// even elements (lo) or the 8 odd ones (hi) as float32: the bf16 bits are a float's high half.
inline __m256 pair_lo(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline __m256 pair_hi(__m256i w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// float32 -> nearest bf16, kept as float32 (the rounded bits' high half).
inline __m256 round_bf16x8(__m256 v) { return pair_hi(round_bf16_bits8(v)); }

// e^x, float32 lanes, as exp16 below: 2^(x log2 e) as an integer power and a degree-5
// polynomial on [-0.5, 0.5]; -87 and below give e^-87, above 88.72 +inf.
inline __m256 exp8(__m256 x_in) {
  const __m256 x = _mm256_min_ps(_mm256_max_ps(x_in, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, k);
  __m256 p = _mm256_set1_ps(1.3333558146428443e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6180399924896104e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 overflow = _mm256_cmp_ps(x_in, _mm256_set1_ps(88.72f), _CMP_GT_OQ);
  return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY),
                          overflow);
}

// Eight vectors -> one: lane i of the result is the sum of the 8 lanes of v[i].
inline __m256 sum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float reduce_add8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float reduce_max8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// 8 int8 -> 8 float32.
inline __m256 load_i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 8 float8 e4m3 -> 8 float32, as load_fp8x16 below (through float16, F16C).
inline __m256 load_fp8x8(const uint8_t* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(mag, sign)), _mm256_set1_ps(256.f));
}

#endif  // INFER_HAVE_AVX2

#ifdef INFER_HAVE_AVX512

inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 maskz_load_bf16x16(__mmask16 m, const uint16_t* p) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// float32 lanes rounded to nearest even bf16 as torch rounds them (a NaN stays a NaN, quieted),
// still in the high half of each 32-bit lane; the low half is left over.
inline __m512i round_bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
}

// float32 lanes -> bfloat16 lanes. With AVX512-BF16, VCVTNEPS2BF16 (the same rounding and NaN
// quieting) unless a lane is denormal, which that instruction flushes to zero: those vectors,
// and CPUs without it, narrow the integer rounding (VPMOVDW), which made it the bottleneck of
// the element-wise kernels: 2048-row SiLU-and-multiply (2048 wide) 0.97 -> 0.70 ms, RMSNorm
// (768 wide) 0.31 -> 0.22 ms on Zen 5.
inline __m256i to_bf16x16(__m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) == 0, 1))  // 0x20: denormal
    return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits(v), 16));
}

inline void store_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16x16(v));
}

inline void mask_store_bf16x16(uint16_t* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, to_bf16x16(v));
}

// float32 -> nearest bf16, kept as float32 (no narrowing and widening back).
inline __m512 round_bf16x16(__m512 v) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(round_bf16_bits(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// e^x, float32 lanes: 2^(x log2 e) split into an integer power (exponent bits) and a degree-5
// polynomial on [-0.5, 0.5] (relative error ~2e-7). Below -87 it gives e^-87 (~1.6e-38, where
// the true value is denormal); above 88.7, where float32 overflows, +inf.
inline __m512 exp16(__m512 x_in) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps(x_in, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, k);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180399924896104e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  const __mmask16 overflow = _mm512_cmp_ps_mask(x_in, _mm512_set1_ps(88.72f), _CMP_GT_OQ);
  return _mm512_mask_mov_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(e)), overflow,
                            _mm512_set1_ps(INFINITY));
}

// r[i][e] -> r[e][i] for 16 vectors of 16 32-bit words, in registers (three rounds of shuffles).
inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: rows 2i, 2i+1, words 4L .. 4L+3
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + k], lane L: word 4L + k of rows 4i .. 4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // word 4L + k of all 16 rows: lane L of r[k], r[4+k], r[8+k], r[12+k]
    const __m512i ab_lo = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44);
    const __m512i ab_hi = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
    const __m512i cd_hi = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
    t[k] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
    t[8 + k] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// 16 int8 -> 16 float32.
inline __m512 load_i8x16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 16 float8 e4m3 -> 16 float32: the e4m3 bits moved into a float16's place read as a float16
// 2^8 too small (exponent bias 15 vs 7), subnormals included; NaN (never stored) reads as 480.
inline __m512 load_fp8x16(const uint8_t* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(mag, sign)), _mm512_set1_ps(256.f));
}

// 16 float32 -> 16 float8 e4m3 bytes, each rounded as f32_to_fp8e4m3 rounds it: the mantissa
// rounded to 3 bits (half to even) and the exponent rebiased (127 -> 7) in one subtraction,
// saturated at 448; below 2^-6, round(|v| * 512); NaN stays NaN.
inline __m128i to_fp8x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(a, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7ffff)));
  __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(120 << 3));
  code = _mm512_min_epi32(code, _mm512_set1_epi32(0x7e));
  const __m512 k = _mm512_roundscale_ps(
      _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 sub = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x3c800000));
  code = _mm512_mask_mov_epi32(code, sub, _mm512_cvtps_epi32(k));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
  code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7f));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define INFER_HAVE_BYTE_TABLES 1
// 64 one-byte cache values -> 64 bfloat16 in order, exactly (every e4m3 value and every integer
// of magnitude up to 127 is a bf16 value), in 7 instructions (8 for int8): a byte's 7 magnitude
// bits index two 128-entry tables (VPERMI2B), the bf16's high and low bytes; the sign bit joins
// the high byte; interleaving the two within 128-bit lanes makes the words. e4m3 is
// sign-magnitude already; an int8 is made so first (its absolute value: the cache never holds
// -128). The bytes are first moved (VPERMB) so that the interleave leaves the words in order.
// The arithmetic widening (load_fp8x16 above, ~9 instructions per 16 values; int8's two per 16
// and a float32 FMA per value) made the one-byte caches' decode attention compute-bound.
//
//   x (64 bytes) --order--> lane k: [x[8k .. 8k+7], x[32+8k .. 32+8k+7]]
//   lo = LO[|x|], hi = HI[|x|] | (x & 0x80)
//   w0 = unpacklo(lo, hi): lane k = words 8k .. 8k+7   -> bf16 0 .. 31
//   w1 = unpackhi(lo, hi): lane k = words 32+8k .. +7  -> bf16 32 .. 63
struct ByteBf16Tables {
  __m512i hi0, hi1, lo0, lo1, order;
};

// kInt8: the magnitudes are the integers 0 .. 127; else e4m3 codes.
template <bool kInt8>
inline ByteBf16Tables make_byte_bf16_tables() {
  alignas(64) uint8_t hi[128], lo[128], order[64];
  for (int m = 0; m < 128; ++m) {
    const float v = kInt8 ? static_cast<float>(m) : fp8e4m3_to_f32(static_cast<uint8_t>(m));
    uint32_t u;
    std::memcpy(&u, &v, 4);
    hi[m] = static_cast<uint8_t>(u >> 24);
    lo[m] = static_cast<uint8_t>(u >> 16);
  }
  for (int k = 0; k < 4; ++k)
    for (int i = 0; i < 8; ++i) {
      order[16 * k + i] = static_cast<uint8_t>(8 * k + i);
      order[16 * k + 8 + i] = static_cast<uint8_t>(32 + 8 * k + i);
    }
  return {_mm512_load_si512(hi), _mm512_load_si512(hi + 64), _mm512_load_si512(lo),
          _mm512_load_si512(lo + 64), _mm512_load_si512(order)};
}

template <bool kInt8>
inline const ByteBf16Tables& byte_bf16_tables() {
  static const ByteBf16Tables tables = make_byte_bf16_tables<kInt8>();
  return tables;
}

template <bool kInt8>
inline void bytes64_to_bf16(const uint8_t* p, const ByteBf16Tables& t, __m512i& w0, __m512i& w1) {
  const __m512i x = _mm512_permutexvar_epi8(t.order, _mm512_loadu_si512(p));
  const __m512i sign = _mm512_and_si512(x, _mm512_set1_epi8(static_cast<char>(0x80)));
  const __m512i mag = kInt8 ? _mm512_abs_epi8(x) : x;  // the tables read bits 0-6 only
  const __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(t.hi0, mag, t.hi1), sign);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, mag, t.lo1);
  w0 = _mm512_unpacklo_epi8(lo, hi);
  w1 = _mm512_unpackhi_epi8(lo, hi);
}

// The same for int8 bytes stored ahead of time in the order the interleave wants and as sign and
// magnitude (pack_sign_magnitude64): no VPERMB, no absolute value, the sign joined by one
// ternary-logic op; 5 instructions per 64 values (for int8 weights, read once per multiply pass).
inline void packed_int8x64_to_bf16(const uint8_t* p, const ByteBf16Tables& t, __m512i& w0,
                                   __m512i& w1) {
  const __m512i x = _mm512_loadu_si512(p);
  const __m512i hi = _mm512_ternarylogic_epi32(  // table | (x & 0x80)
      _mm512_permutex2var_epi8(t.hi0, x, t.hi1), x, _mm512_set1_epi8(static_cast<char>(0x80)),
      0xf8);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, x, t.lo1);
  w0 = _mm512_unpacklo_epi8(lo, hi);
  w1 = _mm512_unpackhi_epi8(lo, hi);
}
#endif

// 64 int8 values (-127 .. 127) -> what packed_int8x64_to_bf16 reads: moved so that the
// interleave of 128-bit lanes leaves them in order, each as its sign bit and magnitude.
inline void pack_sign_magnitude64(const int8_t* src, uint8_t* dst) {
  for (int k = 0; k < 4; ++k)
    for (int i = 0; i < 8; ++i)
      for (int half = 0; half < 2; ++half) {
        const int q = src[32 * half + 8 * k + i];
        dst[16 * k + 8 * half + i] = static_cast<uint8_t>(q < 0 ? 0x80 | -q : q);
      }
}

#endif  // INFER_HAVE_AVX512

}  // namespace infer_simd

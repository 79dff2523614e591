// Shared helpers of the CPU kernels: bfloat16 <-> float32 and exp, scalar and AVX-512.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#define INFER_HAVE_AVX512 1
#endif

namespace infer_simd {

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

#ifdef INFER_HAVE_AVX512

inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 maskz_load_bf16x16(__mmask16 m, const uint16_t* p) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// float32 lanes -> bfloat16 lanes, round to nearest even (the integer way, so denormals are
// rounded as torch rounds them; the BF16 instruction would flush them).
inline __m256i to_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

inline void store_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16x16(v));
}

inline void mask_store_bf16x16(uint16_t* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, to_bf16x16(v));
}

inline __m512 round_bf16x16(__m512 v) {  // float32 -> nearest bf16, kept as float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
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

#endif  // INFER_HAVE_AVX512

}  // namespace infer_simd

// Linear layers with 4-bit weights (--quantization int4 | w4a8, GPTQ and AWQ checkpoints) on
// AVX-512 CPUs. Weights: values q 0..15 with, per group of `group` inputs and per output, a
// float16 scale and a zero (weight = scale * (q - zero)): an integer (uint8), or a float16 for
// GGUF's Q4_1 / Q4_K groups, whose zero is a ratio. Two kernels read them:
//
// int4 (activations stay bf16; AVX-512 BF16):
//   y[m][n] = sum_g w_scale[g][n] * (sum_{k in g} x[m][k] * (128 + q[n][k])
//                                    - (128 + zero[g][n]) * xsum[m][g])  + bias
//   Each nibble becomes the bf16 number 128 + q by one ternary-logic op ((w >> 4r) & 0xF |
//   0x4300: 0x4300 is 128.0, and 128..255 are exact in bf16's 8 significant bits), so
//   VDPBF16PS multiplies it with no table; the 128s and the zero come off once per group
//   against the group's float sum of x. The float32 sum carries the 128s (the cancellation
//   costs ~7 bits of float32's 24, far below bf16's 8).
//
// w4a8 (activations to int8; AVX-512 VNNI):
//   y[m][n] = sum_g w_scale[g][n] * x_scale[m][g]
//             * (sum_{k in g} xq[m][k] * q[n][k]  -  zero[g][n] * xsum[m][g])  + bias
//   each row's values in each group quantized to int8 when the layer runs (symmetric,
//   absmax / 127, rounded to nearest even), so the group's sum is one exact integer dot
//   product: VPDPBUSD multiplies 4 unsigned bytes (the weights, unpacked from their nibbles
//   with an AND and a shift) by 4 signed bytes (x), 128 multiply-adds per 64-byte load. A
//   float16 zero's product (zero * xsum) is taken in float32 (the integer part stays exact).
//
//   packed W : [N/16][K/8] rows of 64 bytes (o: 8 inputs) of block nb (16 outputs n = 16 nb + c),
//              in one of two layouts:
//     int4:  output c's 32-bit lane holds two 16-bit words h = 0, 1; nibble r (bits 4r..4r+3)
//            of word h is q[n][8o + 2r + h], so (w >> 4r) masked is the input pair (8o + 2r,
//            8o + 2r + 1) of all 16 outputs, in the pair order VDPBF16PS reads
//     w4a8:  output c's 4 bytes j = 0..3 are q[n][8o + j] | q[n][8o + 4 + j] << 4: the low
//            nibbles are the 4-input "quad" 2o of all 16 outputs, the high nibbles quad 2o + 1,
//            in the order VPDPBUSD reads
//     w4a8 with 5-bit weights (GGUF's Q5 types; the flags' plane count 1): each 64 bytes
//            followed by a plane of 16 bytes, two 64-bit masks: bit p of the first is bit 4
//            of the value in byte p's low nibble, of the second its high nibble's; a masked
//            byte add puts the bit back (values 0..31, which VPDPBUSD reads as it reads
//            0..15): 80 bytes per 8 inputs of 16 outputs
//     w4a8 with 6-bit weights (GGUF's Q6_K; plane count 2): two such planes (bits 4 and 5),
//            96 bytes per 8 inputs of 16 outputs
//   scales   : [N/16][K/group][16] float16     zeros : [N/16][K/group][16] uint8 or float16
//              (K-quant and Q6_K records in their place: kernels.h)
//   xp (w4a8): per pass of up to 8 rows, [K/4][pass rows] 32-bit words (row r's 4 bytes of
//              quad kq), so one broadcast feeds a row's multiply
//
// Q6_K (weight = d sc (q - 32), q 0..63, an int8 sc per 16 inputs, a float16 d per 256):
//   y[m][n] = sum_g d[n] * x_scale[m][g]
//             * sum_{s in g} sc[s][n] * (sum_{k in s} xq[m][k] * q[n][k]  -  32 xsum16[m][s])
//   the sub-scales applied in the integer domain (one VPMULLD per 16 inputs), one float step
//   per activation group (up to the super-block: |the group's sum| < 16 * 16 * 127 * 32 * 128
//   < 2^31).
//
// Every sum runs in a fixed order (group by group, inputs in order) and a row's result
// depends on nothing but its own values: the same bits in any batch, any pass and any thread
// count.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <omp.h>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define INFER_HAVE_W4A8 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define INFER_HAVE_INT4 1
#endif

namespace {

#if defined(INFER_HAVE_INT4) || defined(INFER_HAVE_W4A8)
constexpr int64_t kPassRows = 8;       // 8 group + 8 row accumulators stay in registers
constexpr int64_t kAheadBytes = 8192;  // weight prefetch distance into L2

// Rows split into passes of at most kPassRows, evenly.
struct Passes {
  int64_t rows;
  explicit Passes(int64_t M) {
    const int64_t passes = (M + kPassRows - 1) / kPassRows;
    rows = (M + passes - 1) / passes;
  }
};

// 16 float32 sums of row m -> y[m][col .. col + 15] (+ bias), float32 or rounded to bf16.
template <bool kOutF32>
inline void store_row(void* y, int64_t m, int64_t N, int64_t col, __m512 v, const float* bias) {
  v = _mm512_add_ps(v, bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps());
  if (kOutF32)
    _mm512_storeu_ps(static_cast<float*>(y) + m * N + col, v);
  else
    infer_simd::store_bf16x16(static_cast<uint16_t*>(y) + m * N + col, v);
}
#endif

#ifdef INFER_HAVE_INT4
// Two bf16 values read as one 32-bit word (may alias the uint16_t rows of x).
typedef int32_t Pair __attribute__((may_alias));

// 128 + the zeros of 16 outputs of one group: uint8, or float16 (kHalfZeros).
template <bool kHalfZeros>
inline __m512 offset_zeros(const void* zb, int64_t g) {
  if (kHalfZeros)
    return _mm512_add_ps(_mm512_cvtph_ps(_mm256_loadu_si256(
                             reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(zb) + g * 16))),
                         _mm512_set1_ps(128.0f));
  return _mm512_cvtepi32_ps(_mm512_add_epi32(
      _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(zb) + g * 16))),
      _mm512_set1_epi32(128)));
}

// Rows [m0, m0 + MR) of x (bf16, row-major) times column block nb, activations as they are.
template <int MR, bool kOutF32, bool kHalfZeros>
inline void int4_bf16_block(const uint16_t* x, const float* x_sum, const uint8_t* wb,
                            const uint16_t* sb, const void* zb, const float* bias, void* y,
                            int64_t m0, int64_t K, int64_t N, int64_t nb, int64_t group) {
  const int64_t groups = K / group;
  const __m512i nibble = _mm512_set1_epi16(0x000F);
  const __m512i offset = _mm512_set1_epi16(0x4300);  // bf16 128.0
  constexpr int kMaskOr = 0xEA;                      // ternary logic: (a & b) | c
  const uint16_t* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = x + (m0 + i) * K;
  __m512 out[MR];
  for (int i = 0; i < MR; ++i) out[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t o = g * group / 8; o < (g + 1) * group / 8; ++o) {
      _mm_prefetch(reinterpret_cast<const char*>(wb + o * 64) + kAheadBytes, _MM_HINT_T1);
      const __m512i w = _mm512_loadu_si512(wb + o * 64);
      const __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(w, nibble, offset, kMaskOr);
      const __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), nibble,
                                                                offset, kMaskOr);
      const __m512bh w2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), nibble,
                                                                offset, kMaskOr);
      const __m512bh w3 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 12), offset);
      for (int i = 0; i < MR; ++i) {
        // x's input pairs (8o + 2r, 8o + 2r + 1) as 32-bit words, broadcast from memory
        const Pair* xp = reinterpret_cast<const Pair*>(xr[i] + 8 * o);
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(xp[0]), w0);
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(xp[1]), w1);
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(xp[2]), w2);
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(xp[3]), w3);
      }
    }
    const __m512 ws = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + g * 16)));
    const __m512 z = offset_zeros<kHalfZeros>(zb, g);
    for (int i = 0; i < MR; ++i) {
      const __m512 t = _mm512_fnmadd_ps(z, _mm512_set1_ps(x_sum[(m0 + i) * groups + g]), acc[i]);
      out[i] = _mm512_fmadd_ps(t, ws, out[i]);
    }
  }
  for (int i = 0; i < MR; ++i) store_row<kOutF32>(y, m0 + i, N, nb * 16, out[i], bias);
}

// Each thread sums x's groups into its own scratch, then threads take contiguous runs of
// column blocks, each block's weights read from memory once and from cache for its further
// passes of up to 8 rows.
template <bool kOutF32, bool kHalfZeros>
void int4_bf16_linear(const uint16_t* x, const uint8_t* packed, const uint16_t* scales,
                      const void* zeros, const float* bias, void* y, int64_t M, int64_t K,
                      int64_t N, int64_t group, int num_threads) {
  const int64_t zero_bytes = kHalfZeros ? 2 : 1;
  const int64_t pass_rows = Passes(M).rows, nblocks = N / 16, groups = K / group;
#pragma omp parallel num_threads(num_threads)
  {
    auto* x_sum = static_cast<float*>(infer_simd::thread_scratch(M * groups * 4));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t k = g * group; k < (g + 1) * group; k += 16)
          s = _mm512_add_ps(s, infer_simd::load_bf16x16(x + m * K + k));
        x_sum[m * groups + g] = _mm512_reduce_add_ps(s);
      }
#pragma omp for schedule(guided) nowait  // the region's end joins the threads
    for (int64_t b = 0; b < nblocks; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += pass_rows) {
        const int64_t rows = M - m0 < pass_rows ? M - m0 : pass_rows;
        infer_simd::with_count<kPassRows>(rows, [&](auto r) {
          int4_bf16_block<decltype(r)::value, kOutF32, kHalfZeros>(
              x, x_sum, packed + b * K * 8, scales + b * groups * 16,
              static_cast<const uint8_t*>(zeros) + b * groups * 16 * zero_bytes, bias, y, m0, K,
              N, b, group);
        });
      }
  }
}
#endif  // INFER_HAVE_INT4

#ifdef INFER_HAVE_W4A8
// Row x (bf16, K values) -> per group: its int8 values into the pass-interleaved xp, its scale
// and the sum of its int8 values. A group with a NaN or an infinity gets a NaN scale (its
// outputs NaN, as a float matmul's would be non-finite); an all-zero group a zero scale.
// With x_sum16 (Q6_K), the sums of each 16 values too.
inline void quantize_row(const uint16_t* x, int64_t K, int64_t group, int32_t* xp,
                         int64_t pass_rows, float* x_scale, int32_t* x_sum, int32_t* x_sum16) {
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 unordered = 0;
    for (int64_t k = g0; k < g0 + group; k += 16) {
      const __m512 v = infer_simd::load_bf16x16(x + k);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    }
    const float absmax = _mm512_reduce_max_ps(vmax);
    const bool finite = !unordered && std::isfinite(absmax);
    const float inv =
        finite && absmax > 0.f && std::isfinite(127.f / absmax) ? 127.f / absmax : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = g0; k < g0 + group; k += 16) {
      const __m512i q =
          _mm512_cvtps_epi32(_mm512_mul_ps(infer_simd::load_bf16x16(x + k), vinv));
      sum = _mm512_add_epi32(sum, q);
      if (x_sum16) x_sum16[k / 16] = _mm512_reduce_add_epi32(q);
      alignas(16) int32_t words[4];
      _mm_store_si128(reinterpret_cast<__m128i*>(words), _mm512_cvtepi32_epi8(q));
      for (int i = 0; i < 4; ++i) xp[(k / 4 + i) * pass_rows] = words[i];
    }
    x_sum[g] = _mm512_reduce_add_epi32(sum);
    x_scale[g] = !finite ? NAN : (inv > 0.f ? absmax / 127.f : 0.f);
  }
}

// How the w4a8 kernel's groups are scaled: a float16 scale and a uint8 zero, a float16
// scale and zero, or GGUF's K-quant records (INFER_INT4_KQUANT).
// GGUF's Q6_K records (INFER_INT4_Q6K).
enum ZeroKind { kZerosUint8 = 0, kZerosHalf = 1, kZerosKQuant = 2, kZerosQ6K = 3 };
constexpr int64_t kKQuantRecord = 320;  // bytes of one (16 outputs, 256 inputs) record
constexpr int64_t kQ6KRecord = 288;     // sc[16][16] int8 | d[16] float16

// The 64 nibble bytes at wo, and the kPlanes bit planes after them: the values of the low
// nibbles' quad (lo) and of the high nibbles' (hi), each byte 0 .. 2^(4 + kPlanes) - 1.
template <int kPlanes>
inline void unpack_values(const uint8_t* wo, __m512i& lo, __m512i& hi) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i w = _mm512_loadu_si512(wo);
  lo = _mm512_and_si512(w, nibble);
  hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
  for (int e = 0; e < kPlanes; ++e) {  // bit 4 + e of each byte, from plane e: a masked add
    uint64_t bits[2];
    std::memcpy(bits, wo + 64 + 16 * e, 16);
    const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << e));
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(bits[0]), lo, bit);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(bits[1]), hi, bit);
  }
}

// Q6_K: rows [m0, m0 + MR) of one pass times column block nb (records: the block's).
template <int MR, bool kOutF32>
inline void q6k_block(const int32_t* xp, int64_t pass_rows, const float* x_scale,
                      const int32_t* x_sum16, const uint8_t* wb, const uint8_t* records,
                      const float* bias, void* y, int64_t m0, int64_t K, int64_t N, int64_t nb,
                      int64_t group) {
  constexpr int64_t kStride = 96;  // bytes per 8 inputs of 16 outputs
  const int64_t groups = K / group, subs = K / 16;
  __m512 out[MR];
  for (int i = 0; i < MR; ++i) out[i] = _mm512_setzero_ps();
  __m512 super_d = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sum[MR];
    for (int i = 0; i < MR; ++i) sum[i] = _mm512_setzero_si512();
    for (int64_t s = g * group / 16; s < (g + 1) * group / 16; ++s) {
      const uint8_t* rec = records + (s / 16) * kQ6KRecord;
      if (s % 16 == 0)  // a super-block's d (groups never straddle one)
        super_d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)));
      __m512i acc[MR];  // from -32 xsum16: the products' sum comes out as sum x (q - 32)
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_set1_epi32(-32 * x_sum16[(m0 + i) * subs + s]);
      for (int64_t o = 2 * s; o < 2 * s + 2; ++o) {
        const uint8_t* wo = wb + o * kStride;
        _mm_prefetch(reinterpret_cast<const char*>(wo) + kAheadBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(wo) + 64 + kAheadBytes, _MM_HINT_T1);
        __m512i lo, hi;
        unpack_values<2>(wo, lo, hi);
        const int32_t* x0 = xp + (2 * o) * pass_rows;
        const int32_t* x1 = x0 + pass_rows;
        for (int i = 0; i < MR; ++i) {
          acc[i] = _mm512_dpbusd_epi32(acc[i], lo, _mm512_set1_epi32(x0[i]));
          acc[i] = _mm512_dpbusd_epi32(acc[i], hi, _mm512_set1_epi32(x1[i]));
        }
      }
      const __m512i sc = _mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * (s % 16))));
      for (int i = 0; i < MR; ++i) sum[i] = _mm512_add_epi32(sum[i], _mm512_mullo_epi32(acc[i], sc));
    }
    for (int i = 0; i < MR; ++i)
      out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]),
                               _mm512_mul_ps(super_d, _mm512_set1_ps(x_scale[(m0 + i) * groups + g])),
                               out[i]);
  }
  for (int i = 0; i < MR; ++i) store_row<kOutF32>(y, m0 + i, N, nb * 16, out[i], bias);
}

// Rows [m0, m0 + MR) of one pass (xp interleaved for it) times column block nb; sb, zb: the
// block's scales and zeros (kZerosKQuant: its records; zb unused).
template <int MR, bool kOutF32, int kZeros, int kPlanes>
inline void w4a8_block(const int32_t* xp, int64_t pass_rows, const float* x_scale,
                       const int32_t* x_sum, const uint8_t* wb, const void* sb,
                       const void* zb, const float* bias, void* y, int64_t m0, int64_t K,
                       int64_t N, int64_t nb, int64_t group) {
  const int64_t groups = K / group;
  constexpr int64_t kStride = 64 + 16 * kPlanes;  // bytes per 8 inputs of 16 outputs
  __m512 out[MR];
  for (int i = 0; i < MR; ++i) out[i] = _mm512_setzero_ps();
  __m512 super_d = _mm512_setzero_ps(), super_dmin = _mm512_setzero_ps();  // (kZerosKQuant)
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
    for (int64_t o = g * group / 8; o < (g + 1) * group / 8; ++o) {
      const uint8_t* wo = wb + o * kStride;
      _mm_prefetch(reinterpret_cast<const char*>(wo) + kAheadBytes, _MM_HINT_T1);
      if (kPlanes) _mm_prefetch(reinterpret_cast<const char*>(wo) + 64 + kAheadBytes, _MM_HINT_T1);
      __m512i lo, hi;
      unpack_values<kPlanes>(wo, lo, hi);
      const int32_t* x0 = xp + (2 * o) * pass_rows;
      const int32_t* x1 = x0 + pass_rows;
      for (int i = 0; i < MR; ++i) {
        acc[i] = _mm512_dpbusd_epi32(acc[i], lo, _mm512_set1_epi32(x0[i]));
        acc[i] = _mm512_dpbusd_epi32(acc[i], hi, _mm512_set1_epi32(x1[i]));
      }
    }
    if constexpr (kZeros == kZerosKQuant) {  // d sc q - dmin m: scale and min in float32
      const uint8_t* rec = static_cast<const uint8_t*>(sb) + (g / 8) * kKQuantRecord;
      const int64_t j = g % 8;
      const auto u8x16 = [](const uint8_t* p) {
        return _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      };
      if (j == 0) {  // a super-block's d and dmin, kept for its 8 groups
        super_d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)));
        super_dmin =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 288)));
      }
      const __m512 ws = _mm512_mul_ps(u8x16(rec + 16 * j), super_d);
      const __m512 zm = _mm512_mul_ps(u8x16(rec + 128 + 16 * j), super_dmin);
      for (int i = 0; i < MR; ++i) {  // (one multiply-add on the running sum)
        const int64_t at = (m0 + i) * groups + g;
        const __m512 t = _mm512_fnmadd_ps(zm, _mm512_set1_ps(static_cast<float>(x_sum[at])),
                                          _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i]), ws));
        out[i] = _mm512_fmadd_ps(t, _mm512_set1_ps(x_scale[at]), out[i]);
      }
      continue;
    }
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(sb) + g * 16)));
    if (kZeros == kZerosHalf) {  // a ratio (GGUF's Q4_1): the zero's product in float32
      const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(zb) + g * 16)));
      for (int i = 0; i < MR; ++i) {
        const int64_t at = (m0 + i) * groups + g;
        const __m512 t = _mm512_fnmadd_ps(z, _mm512_set1_ps(static_cast<float>(x_sum[at])),
                                          _mm512_cvtepi32_ps(acc[i]));
        out[i] = _mm512_fmadd_ps(t, _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[at])), out[i]);
      }
    } else {  // an integer: the group's sum stays exact
      const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(zb) + g * 16)));
      for (int i = 0; i < MR; ++i) {
        const int64_t at = (m0 + i) * groups + g;
        const __m512i t =
            _mm512_sub_epi32(acc[i], _mm512_mullo_epi32(z, _mm512_set1_epi32(x_sum[at])));
        out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t),
                                 _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[at])), out[i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) store_row<kOutF32>(y, m0 + i, N, nb * 16, out[i], bias);
}

// Each thread quantizes all of x into its own scratch (x is M x K bytes against M x K x N
// multiply-adds; no barrier, no lines shared between cores), then threads take contiguous runs
// of column blocks, each block's weights read from memory once and from cache for its further
// passes of up to 8 rows (rows split evenly over the passes).
template <bool kOutF32, int kZeros, int kPlanes>
void w4a8_linear(const uint16_t* x, const uint8_t* packed, const uint16_t* scales,
                 const void* zeros, const float* bias, void* y, int64_t M, int64_t K,
                 int64_t N, int64_t group, int num_threads) {
  constexpr bool kQ6K = kZeros == kZerosQ6K;
  const int64_t zero_bytes = kZeros == kZerosHalf ? 2 : 1;
  const int64_t pass_rows = Passes(M).rows, passes = (M + pass_rows - 1) / pass_rows;
  const int64_t nblocks = N / 16, kquads = K / 4, groups = K / group, subs = kQ6K ? K / 16 : 0;
  const int64_t stride = 64 + 16 * kPlanes;  // bytes per 8 inputs of 16 outputs
  const int64_t record = kZeros == kZerosKQuant ? kKQuantRecord : kQ6KRecord;
#pragma omp parallel num_threads(num_threads)
  {
    auto* xp = static_cast<int32_t*>(infer_simd::thread_scratch(
        (passes * pass_rows * kquads + 2 * M * groups + M * subs) * 4));
    auto* x_scale = reinterpret_cast<float*>(xp + passes * pass_rows * kquads);
    auto* x_sum = reinterpret_cast<int32_t*>(x_scale + M * groups);
    int32_t* x_sum16 = kQ6K ? x_sum + M * groups : nullptr;
    for (int64_t m = 0; m < M; ++m)
      quantize_row(x + m * K, K, group,
                   xp + (m / pass_rows) * pass_rows * kquads + m % pass_rows, pass_rows,
                   x_scale + m * groups, x_sum + m * groups, kQ6K ? x_sum16 + m * subs : nullptr);
#pragma omp for schedule(guided) nowait  // the region's end joins the threads
    for (int64_t b = 0; b < nblocks; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += pass_rows) {
        const int64_t rows = M - m0 < pass_rows ? M - m0 : pass_rows;
        const uint8_t* wb = packed + b * (K / 8) * stride;
        infer_simd::with_count<kPassRows>(rows, [&](auto r) {
          constexpr int MR = decltype(r)::value;
          const auto* block_records = reinterpret_cast<const uint8_t*>(scales) + b * (K / 256) * record;
          if constexpr (kQ6K) {
            q6k_block<MR, kOutF32>(xp + m0 * kquads, pass_rows, x_scale, x_sum16, wb,
                                   block_records, bias, y, m0, K, N, b, group);
          } else {
            const void* block_scales =
                kZeros == kZerosKQuant ? static_cast<const void*>(block_records)
                                       : static_cast<const void*>(scales + b * groups * 16);
            const void* block_zeros =
                kZeros == kZerosKQuant
                    ? nullptr  // (not read)
                    : static_cast<const void*>(static_cast<const uint8_t*>(zeros) +
                                               b * groups * 16 * zero_bytes);
            w4a8_block<MR, kOutF32, kZeros, kPlanes>(xp + m0 * kquads, pass_rows, x_scale,
                                                     x_sum, wb, block_scales, block_zeros, bias,
                                                     y, m0, K, N, b, group);
          }
        });
      }
  }
}
#endif  // INFER_HAVE_W4A8

}  // namespace

extern "C" {

// 1: the int4 kernel (bf16 activations: AVX-512 BF16, or AVX2 in linear_int4_avx2.cpp), 2: the
// w4a8 one (int8 activations), 3: both.
int infer_int4_supported() {
  int kinds = 0;
#if defined(INFER_HAVE_INT4) || defined(INFER_HAVE_AVX2)
  kinds |= 1;
#endif
#ifdef INFER_HAVE_W4A8
  kinds |= 2;
#endif
  return kinds;
}

// y [M, N] (bf16, or float32 with out_f32) from x [M, K] bf16 and a weight packed as above
// (runner/int4.py's pack_int4 builds it). flags: INFER_INT4_W4A8 picks the w4a8 kernel,
// INFER_INT4_HALF_ZEROS says the zeros are float16, the plane count and INFER_INT4_KQUANT /
// INFER_INT4_Q6K (kernels.h) the wider values and the GGUF records.
// N % 16 == 0, group % 16 == 0, K % group == 0.
int infer_int4_linear(const uint16_t* x, const uint8_t* packed, const uint16_t* scales,
                      const void* zeros, const float* bias, void* y, int64_t M, int64_t K,
                      int64_t N, int64_t group, int flags, int out_f32, int num_threads) {
  if (N % 16 || group <= 0 || group % 16 || K % group || M <= 0) return 1;
  const bool half_zeros = flags & INFER_INT4_HALF_ZEROS;
  const int planes = (flags >> INFER_INT4_PLANES_SHIFT) & 3;
  const bool kquant = flags & INFER_INT4_KQUANT, q6k = flags & INFER_INT4_Q6K;
  // 6-bit weights come with Q6_K's records only, and they with 6-bit weights
  if (planes > 2 || (planes == 2) != q6k || (kquant && q6k)) return 1;
  if (flags & INFER_INT4_W4A8) {
#ifdef INFER_HAVE_W4A8
    if (kquant && (group != 32 || K % 256)) return 1;
    if (q6k && (K % 256 || 256 % group)) return 1;
    const auto run = [&](auto out32, auto zero_kind, auto planes) {
      w4a8_linear<decltype(out32)::value, decltype(zero_kind)::value, decltype(planes)::value>(
          x, packed, scales, zeros, bias, y, M, K, N, group, num_threads);
    };
    const auto with_planes = [&](auto out32, auto zero_kind) {
      if (planes == 0) run(out32, zero_kind, std::integral_constant<int, 0>());
      else run(out32, zero_kind, std::integral_constant<int, 1>());
    };
    const auto with_zeros = [&](auto out32) {
      if (q6k) run(out32, std::integral_constant<int, kZerosQ6K>(), std::integral_constant<int, 2>());
      else if (kquant) with_planes(out32, std::integral_constant<int, kZerosKQuant>());
      else if (half_zeros) with_planes(out32, std::integral_constant<int, kZerosHalf>());
      else with_planes(out32, std::integral_constant<int, kZerosUint8>());
    };
    if (out_f32) with_zeros(std::true_type());
    else with_zeros(std::false_type());
    return 0;
#endif
  } else {
    if (planes || kquant || q6k) return 4;  // 5 / 6 bits, K-quant / Q6_K: w4a8 only
#ifdef INFER_HAVE_AVX2
    bool avx2 = flags & INFER_INT4_AVX2;
#ifndef INFER_HAVE_INT4
    avx2 = true;
#endif
    if (avx2)
      return infer_int4_avx2_linear(x, packed, scales, zeros, bias, y, M, K, N, group, half_zeros,
                                    out_f32, num_threads);
#endif
#ifdef INFER_HAVE_INT4
    if (out_f32 && half_zeros)
      int4_bf16_linear<true, true>(x, packed, scales, zeros, bias, y, M, K, N, group, num_threads);
    else if (out_f32)
      int4_bf16_linear<true, false>(x, packed, scales, zeros, bias, y, M, K, N, group, num_threads);
    else if (half_zeros)
      int4_bf16_linear<false, true>(x, packed, scales, zeros, bias, y, M, K, N, group, num_threads);
    else
      int4_bf16_linear<false, false>(x, packed, scales, zeros, bias, y, M, K, N, group,
                                     num_threads);
    return 0;
#endif
  }
  (void)x; (void)packed; (void)scales; (void)zeros; (void)bias; (void)y; (void)out_f32;
  (void)num_threads; (void)half_zeros; (void)planes; (void)kquant; (void)q6k;
  return 2;
}

}  // extern "C"

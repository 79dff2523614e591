// Linear layers with int8 weights and int8 activations (--quantization w8a8) on CPUs with
// AVX-512 VNNI: y[M, N] = (xq . Wq^T) * x_scale[m] * w_scale[n] + bias.
//
// Weights are quantized at load (one float32 scale per output channel, symmetric, -127..127);
// each row of x when the layer runs (one scale per row: absmax / 127, rounded to nearest even).
// VPDPBUSD multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products into an int32
// lane: 64 multiply-adds an instruction, twice VDPBF16PS's 32, from a quarter of bf16's weight
// bytes per multiply. Its first operand is unsigned, so x goes in as xq + 128 and each column's
// 128 * sum(Wq) comes off at the end:
//
//   packed W : [N/16][K/4] rows of 64 bytes: row kq of block nb = the 16 outputs nb*16 .. +15,
//              each as its 4 weights W[n][4kq .. 4kq+3]
//   xp       : per pass of up to 16 rows, [K/4][pass rows] 32-bit words: row r's 4 bytes
//              xq[r][4kq .. 4kq+3] + 128, so one broadcast feeds a row's multiply
//   acc[r]   : 16 int32 sums (one per output) = sum_k (xq + 128) * Wq
//   y[r]     = float(acc[r] - 128 * colsum) * (x_scale[r] * w_scale) + bias
//
// The integer sums are exact (|sum| <= K * 255 * 127 < 2^31 for K < 66,000; the wrapping
// arithmetic stays exact after the offset comes off up to twice that), so a row's result
// depends on nothing but its own values: the same bits in any batch, any pass, any thread count.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define INFER_HAVE_W8A8 1
#endif

namespace {

#ifdef INFER_HAVE_W8A8
constexpr int64_t kPassRows = 16;
constexpr int64_t kAheadBytes = 4096;  // weight prefetch distance into L2, as the bf16 kernel's

// Row m of x (bf16, K values) -> its scale and its bytes xq + 128 into the pass-interleaved xp.
// A row with a NaN or an infinity gets a NaN scale (its outputs NaN, as a float matmul's would
// be non-finite); a row too small for 127 / absmax to be finite is a zero row.
inline float quantize_row(const uint16_t* x, int64_t K, int32_t* xp, int64_t pass_rows) {
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 unordered = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = infer_simd::load_bf16x16(x + k);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
  }
  const float absmax = _mm512_reduce_max_ps(vmax);
  const bool finite = !unordered && std::isfinite(absmax);
  const float inv = finite && absmax > 0.f && std::isfinite(127.f / absmax) ? 127.f / absmax : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t k = 0; k < K; k += 16) {
    // |x * inv| <= 127 (rounded to nearest even, as the reference rounds)
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(infer_simd::load_bf16x16(x + k), vinv));
    const __m128i b = _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128)));
    alignas(16) int32_t words[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(words), b);
    for (int i = 0; i < 4; ++i) xp[(k / 4 + i) * pass_rows] = words[i];
  }
  if (!finite) return NAN;
  return inv > 0.f ? absmax / 127.f : 0.f;
}

// Rows [m0, m0 + MR) (one pass, xp interleaved for it) times column block nb.
template <int MR, bool kOutF32>
inline void w8a8_block(const int32_t* xp, int64_t pass_rows, const int8_t* wb,
                       const int32_t* colsum, const float* w_scale, const float* x_scale,
                       const float* bias, void* y, int64_t m0, int64_t K, int64_t N, int64_t nb) {
  __m512i acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t kq = 0; kq < K / 4; ++kq) {
    _mm_prefetch(reinterpret_cast<const char*>(wb + kq * 64) + kAheadBytes, _MM_HINT_T1);
    const __m512i w = _mm512_loadu_si512(wb + kq * 64);
    const int32_t* xk = xp + kq * pass_rows;
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(xk[i]), w);
  }
  const int64_t col = nb * 16;
  const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(colsum + col), 7);  // 128 * sum
  const __m512 ws = _mm512_loadu_ps(w_scale + col);
  const __m512 b = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
  for (int i = 0; i < MR; ++i) {
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], offset));
    const __m512 v = _mm512_fmadd_ps(sums, _mm512_mul_ps(_mm512_set1_ps(x_scale[m0 + i]), ws), b);
    if (kOutF32)
      _mm512_storeu_ps(static_cast<float*>(y) + (m0 + i) * N + col, v);
    else
      infer_simd::store_bf16x16(static_cast<uint16_t*>(y) + (m0 + i) * N + col, v);
  }
}

template <bool kOutF32>
void w8a8_rows(const int32_t* xp, int64_t pass_rows, const int8_t* wb, const int32_t* colsum,
               const float* w_scale, const float* x_scale, const float* bias, void* y,
               int64_t m0, int64_t rows, int64_t K, int64_t N, int64_t nb) {
  infer_simd::with_count<16>(rows, [&](auto r) {
    w8a8_block<decltype(r)::value, kOutF32>(xp, pass_rows, wb, colsum, w_scale, x_scale, bias,
                                            y, m0, K, N, nb);
  });
}

// Each thread quantizes all of x into its own scratch (no barrier, no lines shared between
// cores; x is M x K bytes against the M x K x N multiply-adds), then threads take contiguous
// runs of column blocks (schedule(guided)), each block's weights read from memory once and
// from cache for its further passes of up to 16 rows (rows split evenly over the passes).
template <bool kOutF32>
void w8a8_linear(const uint16_t* x, const int8_t* packed, const int32_t* colsum,
                 const float* w_scale, const float* bias, void* y, int64_t M, int64_t K,
                 int64_t N, int num_threads) {
  const int64_t passes = (M + kPassRows - 1) / kPassRows;
  const int64_t pass_rows = (M + passes - 1) / passes;
  const int64_t nblocks = N / 16, kquads = K / 4;
#pragma omp parallel num_threads(num_threads)
  {
    auto* xp = static_cast<int32_t*>(
        infer_simd::thread_scratch(passes * pass_rows * kquads * 4 + M * 4));
    auto* x_scale = reinterpret_cast<float*>(xp + passes * pass_rows * kquads);
    for (int64_t m = 0; m < M; ++m)
      x_scale[m] = quantize_row(x + m * K, K,
                                xp + (m / pass_rows) * pass_rows * kquads + m % pass_rows,
                                pass_rows);
#pragma omp for schedule(guided) nowait  // the region's end joins the threads
    for (int64_t b = 0; b < nblocks; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += pass_rows) {
        const int64_t rows = M - m0 < pass_rows ? M - m0 : pass_rows;
        w8a8_rows<kOutF32>(xp + m0 * kquads, pass_rows, packed + b * K * 16, colsum, w_scale,
                           x_scale, bias, y, m0, rows, K, N, b);
      }
  }
}
#endif  // INFER_HAVE_W8A8

}  // namespace

extern "C" {

int infer_w8a8_supported() {
#ifdef INFER_HAVE_W8A8
  return 1;
#else
  return 0;
#endif
}

// Wq [N, K] int8 (row-major) -> the packed layout above, and colsum[n] = sum_k Wq[n][k].
// N % 16 == 0, K % 4 == 0.
int infer_w8a8_pack(const int8_t* weight, int8_t* packed, int32_t* colsum, int64_t N,
                    int64_t K) {
  if (N % 16 || K % 4) return 1;
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t nb = n / 16, kq = k / 4;
      packed[(nb * (K / 4) + kq) * 64 + (n % 16) * 4 + k % 4] = weight[n * K + k];
      sum += weight[n * K + k];
    }
    colsum[n] = sum;
  }
  return 0;
}

// y [M, N] (bf16, or float32 with out_f32) from x [M, K] bf16 and a packed weight.
int infer_w8a8_linear(const uint16_t* x, const int8_t* packed, const int32_t* colsum,
                      const float* w_scale, const float* bias, void* y, int64_t M, int64_t K,
                      int64_t N, int out_f32, int num_threads) {
  if (N % 16 || K % 16 || M <= 0) return 1;
#ifdef INFER_HAVE_W8A8
  if (out_f32) w8a8_linear<true>(x, packed, colsum, w_scale, bias, y, M, K, N, num_threads);
  else w8a8_linear<false>(x, packed, colsum, w_scale, bias, y, M, K, N, num_threads);
  return 0;
#else
  (void)x; (void)packed; (void)colsum; (void)w_scale; (void)bias; (void)y; (void)out_f32;
  (void)num_threads;
  return 2;
#endif
}

}  // extern "C"

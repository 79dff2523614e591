// Linear layers on CPUs with AVX2 and FMA but neither AMX nor AVX-512 BF16 (AMD Zen 2/3, Intel
// before Cooper Lake): y[M, N] = x[M, K] . W[N, K]^T (+ bias), on linear.cpp's packed tiles.
//
// No instruction here multiplies bf16, so each 64-byte tile row (16 outputs x one bf16 pair of
// K) is widened in registers: the pair's low half shifted up is the float32 weight of k, its
// high half masked is the weight of k + 1. Each widened vector then feeds one float32 FMA per
// row of x, with x widened to float32 once per call and laid out so the rows of a group sit
// side by side for each k:
//
//   xg      : [groups][K][R] float32, xg[g][k][i] = x[g*R + i][k] (rows past M are 0)
//   tile row: | n0:(k, k+1) | n1:(k, k+1) | ... | n15:(k, k+1) |   (bf16 pairs, 2 x 32 bytes)
//               \_ lo = pair << 16: W[n][k];  hi = pair & 0xffff0000: W[n][k+1]
//   acc[i][n] = fma(x[i][k+1], hi[n], fma(x[i][k], lo[n], acc[i][n]))     for k = 0, 2, 4, ...
//
// Every (row, output) is one chain of FMAs in the order of K, from zero, then + bias and one
// rounding: the same bits whatever the other rows are and whichever block shape ran it.
//
// Shape (16 ymm registers): blocks of 4 rows x 16 outputs, 8 accumulators, so each broadcast of
// x feeds two FMAs and each widened weight four. Measured on a 2-core Zen 3 VM (the ~110M
// Llama's 12 layers of linears): against passes of up to 8 rows x 8 outputs, 7.6 -> 4.6 ms at 1
// row (half a 64-byte tile row per pass had each line walked twice), 4-10% faster at 8-64 rows.
// With 12 accumulators GCC spilled them to the stack every iteration (46 GFLOP/s on one core,
// whose FMA peak is 100); with 8 it does not (~85).

#include <cstdint>
#include <omp.h>

#include "kernels.h"
#include "simd.h"

#ifdef INFER_HAVE_AVX2

namespace {

constexpr int64_t kBlockRows = 4;   // rows per block (4 x 16 outputs: 8 accumulators)
constexpr int64_t kChunkRows = 96;  // rows walked against one panel
constexpr int64_t kPanel = 4;       // 16-column blocks per panel

// x [M, K] bf16 -> xg with groups of R rows (see the top of the file); called inside a parallel
// region, whose threads share the work.
inline void widen_rows(const uint16_t* x, float* xg, int64_t M, int64_t K, int64_t R) {
  const int64_t groups = (M + R - 1) / R;
#pragma omp for collapse(2) schedule(static)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t k = 0; k < K; k += 8) {
      float* dst = xg + (g * K + k) * R;
      for (int64_t i = 0; i < R; ++i) {
        const int64_t m = g * R + i;
        for (int64_t j = 0; j < 8; ++j)
          dst[j * R + i] = m < M ? infer_simd::bf16_to_f32(x[m * K + k + j]) : 0.f;
      }
    }
}

// MR rows (MR <= 4) of group xg (groups of kBlockRows) against the 16 outputs of one block.
template <int MR, bool kOutF32>
inline void fma_block(const float* xg, const uint16_t* wb, const float* bias, void* y,
                      int64_t m0, int64_t K, int64_t N, int64_t col) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  using infer_simd::pair_hi;
  using infer_simd::pair_lo;
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    const auto* w = reinterpret_cast<const __m256i*>(wb + kp * 32);
    const float* x0 = xg + 2 * kp * kBlockRows;
    const __m256 lo0 = pair_lo(_mm256_loadu_si256(w)), lo1 = pair_lo(_mm256_loadu_si256(w + 1));
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x0 + i);
      acc[i][0] = _mm256_fmadd_ps(xv, lo0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, lo1, acc[i][1]);
    }
    const __m256 hi0 = pair_hi(_mm256_loadu_si256(w)), hi1 = pair_hi(_mm256_loadu_si256(w + 1));
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x0 + kBlockRows + i);
      acc[i][0] = _mm256_fmadd_ps(xv, hi0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, hi1, acc[i][1]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 b = bias ? _mm256_loadu_ps(bias + col + 8 * h) : _mm256_setzero_ps();
    for (int i = 0; i < MR; ++i)
      infer_simd::store_out8<kOutF32>(y, (m0 + i) * N + col + 8 * h, _mm256_add_ps(acc[i][h], b));
  }
}

template <bool kOutF32>
inline void block_rows(const float* xg, const uint16_t* wb, const float* bias, void* y,
                       int64_t m0, int64_t rows, int64_t K, int64_t N, int64_t col) {
  infer_simd::with_count<4>(rows, [&](auto r) {
    fma_block<decltype(r)::value, kOutF32>(xg, wb, bias, y, m0, K, N, col);
  });
}

// One parallel region: x is widened, then (after the loop's barrier) threads take 64-column
// panels one at a time; within a panel, 96-row chunks (in L2) in 4-row blocks, the panel's
// weights read from memory on the first chunk.
template <bool kOutF32>
void fma_linear(const uint16_t* x, const uint16_t* packed, const float* bias, void* y,
                int64_t M, int64_t K, int64_t N, int num_threads) {
  const int64_t nblocks = N / 16, block_elems = (K / 32) * 512;
  const int64_t npanels = (nblocks + kPanel - 1) / kPanel;
  const int64_t groups = (M + kBlockRows - 1) / kBlockRows;
  auto* xg = static_cast<float*>(infer_simd::thread_scratch(groups * kBlockRows * K * 4));
#pragma omp parallel num_threads(num_threads)
  {
    widen_rows(x, xg, M, K, kBlockRows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < npanels; ++p) {
      const int64_t b1 = (p + 1) * kPanel < nblocks ? (p + 1) * kPanel : nblocks;
      for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
        const int64_t c1 = c0 + kChunkRows < M ? c0 + kChunkRows : M;
        for (int64_t b = p * kPanel; b < b1; ++b)
          for (int64_t m0 = c0; m0 < c1; m0 += kBlockRows) {
            const int64_t rows = c1 - m0 < kBlockRows ? c1 - m0 : kBlockRows;
            block_rows<kOutF32>(xg + m0 * K, packed + b * block_elems, bias, y, m0, rows, K, N,
                               b * 16);
          }
      }
    }
  }
}

}  // namespace

// bf16 packed tiles only (int8 weights are widened in AMX tiles).
int infer_fma_linear(const uint16_t* x, const uint16_t* packed, const float* bias, void* y,
                     int64_t M, int64_t K, int64_t N, int out_f32, int num_threads) {
  if (out_f32) fma_linear<true>(x, packed, bias, y, M, K, N, num_threads);
  else fma_linear<false>(x, packed, bias, y, M, K, N, num_threads);
  return 0;
}

#endif  // INFER_HAVE_AVX2

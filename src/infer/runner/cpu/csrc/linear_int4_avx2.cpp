// Linear layers with 4-bit weights on CPUs with AVX2 and FMA but no AVX-512 BF16 (Intel's
// desktop cores, Skylake-class Xeons, AMD Zen 2/3): --quantization int4, GPTQ and AWQ folders,
// GGUF's 4-bit groups. The weights are linear_int4.cpp's int4 layout, as runner/int4.py packs
// them for the AVX-512 kernel (weight = scale * (q - zero) per group of `group` inputs):
//
//   64 bytes per (16 outputs, 8 inputs k = 8o .. 8o+7); output c's 32-bit lane (4c .. 4c+3)
//   holds two 16-bit words h = 0, 1, nibble r of word h = q[n][8o + 2r + h]:
//
//     lane c: | q(8o+7) q(8o+5) q(8o+3) q(8o+1) | q(8o+6) q(8o+4) q(8o+2) q(8o) |
//               bits 28..16: h = 1 (odd inputs)     bits 12..0: h = 0 (even inputs)
//
// Nothing here multiplies bf16 or bytes, so every weight becomes a float32 in registers, one
// 32-byte half of a row (8 outputs) at a time. For r = 0..3, t = lane >> 4r:
//
//   even input 8o + 2r:     t & 0xF                      -> converted: q
//   odd input  8o + 2r + 1: (t & 0xF0000) | 0x43000000   -> the float 128 + q (128 is
//                           0x43000000, whose last mantissa bits count ones from bit 16)
//
// five instructions per 16 weights, no conversion for the odd half. Each feeds one float32 FMA
// per row of x, and per group the offsets come off against the group's sums of x:
//
//   y[m][n] = sum_g scale[g][n] * (acc[m][g][n] - zero[g][n] * xsum[m][g] - 128 * xodd[m][g])
//   acc[m][g][n] = sum_{k in g} x[m][k] * (q[n][k] + (k odd ? 128 : 0))
//
// each acc in four FMA chains (one per r, in the order of k, added at the group's end). The
// float32 sums carry the 128s: ~7 of their 24 bits, far below bf16's 8 (as the AVX-512
// kernel's). A lone row runs both 8-output halves of a block at once (8 chains in flight).
// From 12 rows on (groups of up to 128), each group of a block is unpacked once into floats
// on the stack and rows in sixes run its chains one after another (r outer) against both
// halves, the weights the FMAs' memory operands (rows_unpacked: 12 chains in flight); rows
// left in fours do the same with the weights unpacked in registers (block_quad: 8 chains,
// each unpacked vector feeding four rows and each broadcast of x two halves); a pair left
// over goes against one half, then the other. A block's rows run on one thread, so a weight
// line comes from memory once. x is widened to
// float32 once per call, the two rows of a pair side by side for each k (linear_avx2.cpp's
// layout, in groups of 2):
//
//   xg : [pairs of rows][K][2] float32      xs : [M][groups][2] float32 (xsum, xodd)
//
// Where the time goes (2-core Zen 2, the ~110M Llama's 48 linears, `infer bench kernels
// --cases int4`): a lone row at ~46 GFLOP/s, twice the bf16 kernel's rate per layer; fours at
// ~110 (the pairs' way: ~90; each broadcast of x fed one FMA there, and their four chains
// left no registers for more rows or halves). Fours are bound by their chains' latency: two
// dependent FMAs per 8 inputs in each of the 8 (fives spilled sums and ran slower); sixes
// over unpacked weights, by the FMAs themselves: ~120 GFLOP/s at 12 rows, ~140 at 256
// (six rows alone: 6% slower than a four and a pair, hence from 12).
//
// Every (row, output) is the same chain in the same order whatever the other rows are, so a
// row's bits do not depend on its batch, its pass or the thread count.

#include <cstdint>
#include <type_traits>
#include <omp.h>

#include "kernels.h"
#include "simd.h"

#ifdef INFER_HAVE_AVX2

namespace {

constexpr int64_t kRows = 2;          // rows per pass (x's layout: the rows of a pass side by side)
constexpr int64_t kChunkRows = 96;    // rows walked against one panel (x's chunk in cache)
constexpr int64_t kPanel = 4;         // 16-output blocks per panel
constexpr int64_t kAheadBytes = 4096; // weight prefetch distance into L2
constexpr int kQuad = 4;               // rows per block_quad() (5: slower, sums spilled)
static_assert(kQuad % kRows == 0, "the passes after the quads start on a pair");

// x [M, K] bf16 -> xg (above) and each row's group sums, in the order of k (a row's sums are
// its own); inside a parallel region, whose threads share the rows. (An odd M's last pair has
// no second row: its slots are left as they are, a lone row being run alone.)
inline void widen(const uint16_t* x, float* xg, float* xs, int64_t M, int64_t K,
                  int64_t group) {
  const int64_t groups = K / group;
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    float* dst = xg + (m / kRows) * K * kRows + m % kRows;
    const uint16_t* row = x + m * K;
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f, odd = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
        const float a = infer_simd::bf16_to_f32(row[k]), b = infer_simd::bf16_to_f32(row[k + 1]);
        dst[k * kRows] = a;
        dst[(k + 1) * kRows] = b;
        sum += a;
        sum += b;
        odd += b;
      }
      xs[(m * groups + g) * 2] = sum;
      xs[(m * groups + g) * 2 + 1] = odd;
    }
  }
}

// 8 uint8 or float16 zeros of one group -> float32.
template <bool kHalfZeros>
inline __m256 load_zeros(const void* zb, int64_t at) {
  if (kHalfZeros)
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(zb) + at)));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(zb) + at))));
}

// Inputs 8o + 2r (even) and 8o + 2r + 1 (odd) of 8 outputs from their 32 packed bytes v, as
// floats: q, and 128 + q with no conversion (the top of the file). Every pass decodes here.
inline void unpack_pair(__m256i v, int r, __m256& even, __m256& odd) {
  const __m256i t = _mm256_srli_epi32(v, 4 * r);
  even = _mm256_cvtepi32_ps(_mm256_and_si256(t, _mm256_set1_epi32(0xF)));
  odd = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(t, _mm256_set1_epi32(0xF0000)),
                                            _mm256_set1_epi32(0x43000000)));
}

// A group's end for one row and 8 outputs: its four chains added, the offsets taken off
// (s: the row's xsum and xodd of the group; z: the zeros), times the scales ws, into out.
// Every pass ends its groups here, so the passes' bits agree.
inline __m256 group_end(__m256 c0, __m256 c1, __m256 c2, __m256 c3, __m256 z, __m256 ws,
                        const float* s, __m256 out) {
  const __m256 off = _mm256_fmadd_ps(z, _mm256_set1_ps(s[0]), _mm256_set1_ps(128.f * s[1]));
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3));
  return _mm256_fmadd_ps(_mm256_sub_ps(sum, off), ws, out);
}

// Rows [m0, m0 + MR) (xp: their pass in xg) times H halves from `half` on (8 outputs each) of
// block nb; wb, sb, zb: the block's weights, scales and zeros. Each (row, 8 outputs) sums a
// group in four chains, one per r (one chain had each FMA wait on the one before: a batch-1
// pass ran at a quarter of the rate), added at the group's end: MR x H x 4 sums + MR x H
// totals fit the 16 registers for MR x H <= 2. The small loops are unrolled before GCC lays
// out the arrays (`#pragma GCC unroll`): left to its later unrolling it kept the sums in an
// array on the stack and stored every one of them on each step (8 stores a step of the pair
// loop; with the pragma none): ~12% of the time at 1 and 16 rows.
template <int MR, int H, bool kOutF32, bool kHalfZeros>
inline void block(const float* xp, const float* xs, const uint8_t* wb, const uint16_t* sb,
                  const void* zb, const float* bias, void* y, int64_t m0, int64_t K, int64_t N,
                  int64_t nb, int half, int64_t group) {
  const int64_t groups = K / group;
  __m256 out[MR][H];
  #pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    #pragma GCC unroll 16
    for (int h = 0; h < H; ++h) out[i][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[MR][H][4];
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      #pragma GCC unroll 16
      for (int h = 0; h < H; ++h)
        #pragma GCC unroll 16
        for (int r = 0; r < 4; ++r) acc[i][h][r] = _mm256_setzero_ps();
    for (int64_t o = g * group / 8; o < (g + 1) * group / 8; ++o) {
      const uint8_t* wo = wb + o * 64;
      if (half == 0) _mm_prefetch(reinterpret_cast<const char*>(wo) + kAheadBytes, _MM_HINT_T1);
      __m256i w[H];
      #pragma GCC unroll 16
      for (int h = 0; h < H; ++h)
        w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + 32 * (half + h)));
      const float* xk = xp + 8 * o * kRows;  // row i's input 8o + j at xk[j * kRows + i]
      #pragma GCC unroll 16
      for (int r = 0; r < 4; ++r)
        #pragma GCC unroll 16
        for (int h = 0; h < H; ++h) {
          __m256 even, odd;
          unpack_pair(w[h], r, even, odd);
          #pragma GCC unroll 16
          for (int i = 0; i < MR; ++i) {
            __m256& a = acc[i][h][r];
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + (2 * r) * kRows + i), even, a);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + (2 * r + 1) * kRows + i), odd, a);
          }
        }
    }
    #pragma GCC unroll 16
    for (int h = 0; h < H; ++h) {
      const int64_t at = g * 16 + 8 * (half + h);
      const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + at)));
      const __m256 z = load_zeros<kHalfZeros>(zb, at);
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const float* s = xs + ((m0 + i) * groups + g) * 2;
        out[i][h] = group_end(acc[i][h][0], acc[i][h][1], acc[i][h][2], acc[i][h][3], z, ws, s,
                              out[i][h]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int h = 0; h < H; ++h) {
    const int64_t col = nb * 16 + 8 * (half + h);
    const __m256 b = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      infer_simd::store_out8<kOutF32>(y, (m0 + i) * N + col, _mm256_add_ps(out[i][h], b));
  }
}

// Rows [m0, m0 + 4) (two passes of xg from xp on) times both halves of block nb, a group's
// four chains one after another (r outer, each over the group's inputs in the order of k):
// one unpacked weight vector feeds four rows and one broadcast of x both halves, against
// block()'s one row and one half, with 8 sums in flight. Each (row, output, r) chain takes the
// same products in the same order as in block(), and the group's end adds them the same way:
// the bits are block()'s. The finished chains and the outputs wait in memory (a store each a
// group).
template <int MR, bool kOutF32, bool kHalfZeros>
inline void block_quad(const float* xg, const float* xs, const uint8_t* wb, const uint16_t* sb,
                       const void* zb, const float* bias, void* y, int64_t m0, int64_t K,
                       int64_t N, int64_t nb, int64_t group) {
  const int64_t groups = K / group;
  const float* xr[MR];  // row i's input k at xr[i][k * kRows]
  #pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) xr[i] = xg + ((m0 + i) / kRows) * K * kRows + (m0 + i) % kRows;
  __m256 out[MR][2];
  #pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    #pragma GCC unroll 16
    for (int h = 0; h < 2; ++h) out[i][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 done[4][MR][2];
    #pragma GCC unroll 1
    for (int r = 0; r < 4; ++r) {
      __m256 acc[MR][2];
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
        #pragma GCC unroll 16
        for (int h = 0; h < 2; ++h) acc[i][h] = _mm256_setzero_ps();
      for (int64_t o = g * group / 8; o < (g + 1) * group / 8; ++o) {
        const uint8_t* wo = wb + o * 64;
        if (r == 0) _mm_prefetch(reinterpret_cast<const char*>(wo) + kAheadBytes, _MM_HINT_T1);
        const int64_t k = (8 * o + 2 * r) * kRows;
        __m256 even[2], odd[2];
        #pragma GCC unroll 16
        for (int h = 0; h < 2; ++h) {
          unpack_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + 32 * h)), r,
                      even[h], odd[h]);
        }
        #pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          const float* xi = xr[i] + k;
          const __m256 xe = _mm256_broadcast_ss(xi), xo = _mm256_broadcast_ss(xi + kRows);
          #pragma GCC unroll 16
          for (int h = 0; h < 2; ++h) {
            acc[i][h] = _mm256_fmadd_ps(xe, even[h], acc[i][h]);
            acc[i][h] = _mm256_fmadd_ps(xo, odd[h], acc[i][h]);
          }
        }
      }
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
        #pragma GCC unroll 16
        for (int h = 0; h < 2; ++h) done[r][i][h] = acc[i][h];
    }
    #pragma GCC unroll 16
    for (int h = 0; h < 2; ++h) {
      const int64_t at = g * 16 + 8 * h;
      const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + at)));
      const __m256 z = load_zeros<kHalfZeros>(zb, at);
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const float* s = xs + ((m0 + i) * groups + g) * 2;
        out[i][h] = group_end(done[0][i][h], done[1][i][h], done[2][i][h], done[3][i][h], z, ws,
                              s, out[i][h]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int h = 0; h < 2; ++h) {
    const int64_t col = nb * 16 + 8 * h;
    const __m256 b = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
    #pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
      infer_simd::store_out8<kOutF32>(y, (m0 + i) * N + col, _mm256_add_ps(out[i][h], b));
  }
}

// Rows [m0, m1) (a multiple of 6, m0 even) times block nb, group by group: the group's weights
// unpacked once into w (the floats q, 128 + q for odd inputs, as block() makes them in
// registers), then each six rows run a group's four chains one after another against both
// halves, the weights read from w as the FMAs' memory operands: 12 chains in flight, no
// unpacking per row. Each (row, output, r) chain takes the same products in the same order as
// in block(), and the group's end adds them the same way: the bits are block()'s. The outputs
// wait in outb between groups. For groups of at most kMaxSlice inputs (w lives on the stack).
constexpr int kSix = 6;
constexpr int64_t kMaxSlice = 128;
constexpr int64_t kUnpackedFrom = 12;  // rows (6: 6% slower than a four and a pair)

template <bool kOutF32, bool kHalfZeros>
inline void rows_unpacked(const float* xg, const float* xs, const uint8_t* wb, const uint16_t* sb,
                          const void* zb, const float* bias, void* y, int64_t m0, int64_t m1,
                          int64_t K, int64_t N, int64_t nb, int64_t group) {
  constexpr int MR = kSix;
  const int64_t groups = K / group, per = group / 8;
  alignas(32) float w[kMaxSlice / 8][4][2][16];  // [o][r][even, odd][output]
  alignas(32) float outb[kChunkRows][16];
  for (int64_t m = 0; m < m1 - m0; ++m)
    for (int c = 0; c < 16; c += 8) _mm256_store_ps(outb[m] + c, _mm256_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t o = 0; o < per; ++o) {
      const uint8_t* wo = wb + (g * per + o) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(wo) + kAheadBytes, _MM_HINT_T1);
      #pragma GCC unroll 16
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wo + 32 * h));
        #pragma GCC unroll 16
        for (int r = 0; r < 4; ++r) {
          __m256 even, odd;
          unpack_pair(v, r, even, odd);
          _mm256_store_ps(w[o][r][0] + 8 * h, even);
          _mm256_store_ps(w[o][r][1] + 8 * h, odd);
        }
      }
    }
    __m256 ws[2], z[2];
    #pragma GCC unroll 16
    for (int h = 0; h < 2; ++h) {
      const int64_t at = g * 16 + 8 * h;
      ws[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + at)));
      z[h] = load_zeros<kHalfZeros>(zb, at);
    }
    for (int64_t m = m0; m < m1; m += MR) {
      const float* xr[MR];  // row i's input k at xr[i][k * kRows]
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
        xr[i] = xg + ((m + i) / kRows) * K * kRows + (m + i) % kRows + 8 * g * per * kRows;
      __m256 done[4][MR][2];
      #pragma GCC unroll 1
      for (int r = 0; r < 4; ++r) {
        __m256 acc[MR][2];
        #pragma GCC unroll 16
        for (int i = 0; i < MR; ++i)
          #pragma GCC unroll 16
          for (int h = 0; h < 2; ++h) acc[i][h] = _mm256_setzero_ps();
        for (int64_t o = 0; o < per; ++o) {
          const int64_t k = (8 * o + 2 * r) * kRows;
          #pragma GCC unroll 16
          for (int i = 0; i < MR; ++i) {
            const __m256 xe = _mm256_broadcast_ss(xr[i] + k);
            const __m256 xo = _mm256_broadcast_ss(xr[i] + k + kRows);
            #pragma GCC unroll 16
            for (int h = 0; h < 2; ++h) {
              acc[i][h] = _mm256_fmadd_ps(xe, _mm256_load_ps(w[o][r][0] + 8 * h), acc[i][h]);
              acc[i][h] = _mm256_fmadd_ps(xo, _mm256_load_ps(w[o][r][1] + 8 * h), acc[i][h]);
            }
          }
        }
        #pragma GCC unroll 16
        for (int i = 0; i < MR; ++i)
          #pragma GCC unroll 16
          for (int h = 0; h < 2; ++h) done[r][i][h] = acc[i][h];
      }
      #pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const float* s = xs + ((m + i) * groups + g) * 2;
        #pragma GCC unroll 16
        for (int h = 0; h < 2; ++h) {
          float* ob = outb[m - m0 + i] + 8 * h;
          _mm256_store_ps(ob, group_end(done[0][i][h], done[1][i][h], done[2][i][h],
                                        done[3][i][h], z[h], ws[h], s, _mm256_load_ps(ob)));
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int h = 0; h < 2; ++h) {
    const int64_t col = nb * 16 + 8 * h;
    const __m256 b = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
    for (int64_t m = m0; m < m1; ++m)
      infer_simd::store_out8<kOutF32>(y, m * N + col,
                                      _mm256_add_ps(_mm256_load_ps(outb[m - m0] + 8 * h), b));
  }
}

// One parallel region: x widened (then the loop's barrier), threads take panels of 4 blocks;
// within a panel, 96-row chunks, each block's rows in passes: a lone row against both halves
// at once, pairs of rows against one half, then the other (so a weight line comes from memory
// once, on the first).
template <bool kOutF32, bool kHalfZeros>
void int4_linear(const uint16_t* x, const uint8_t* packed, const uint16_t* scales,
                 const void* zeros, const float* bias, void* y, int64_t M, int64_t K, int64_t N,
                 int64_t group, int num_threads) {
  const int64_t zero_bytes = kHalfZeros ? 2 : 1;
  const int64_t nblocks = N / 16, groups = K / group;
  const int64_t npanels = (nblocks + kPanel - 1) / kPanel;
  const int64_t padded = (M + kRows - 1) / kRows * kRows;
  auto* xg = static_cast<float*>(infer_simd::thread_scratch((padded * K + M * groups * 2) * 4));
  float* xs = xg + padded * K;
#pragma omp parallel num_threads(num_threads)
  {
    widen(x, xg, xs, M, K, group);
#pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < npanels; ++p) {
      const int64_t b1 = (p + 1) * kPanel < nblocks ? (p + 1) * kPanel : nblocks;
      for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
        const int64_t c1 = c0 + kChunkRows < M ? c0 + kChunkRows : M;
        for (int64_t b = p * kPanel; b < b1; ++b) {
          const uint8_t* wb = packed + b * K * 8;
          const uint16_t* sb = scales + b * groups * 16;
          const void* zb = static_cast<const uint8_t*>(zeros) + b * groups * 16 * zero_bytes;
          const auto run = [&](auto mr, auto h, int64_t m0, int half) {
            block<decltype(mr)::value, decltype(h)::value, kOutF32, kHalfZeros>(
                xg + (m0 / kRows) * K * kRows + m0 % kRows, xs, wb, sb, zb, bias, y, m0, K, N,
                b, half, group);
          };
          using One = std::integral_constant<int, 1>;
          using Two = std::integral_constant<int, 2>;
          int64_t m0 = c0;
          if (group <= kMaxSlice && c1 - c0 >= kUnpackedFrom) {
            const int64_t m1 = c0 + (c1 - c0) / kSix * kSix;
            rows_unpacked<kOutF32, kHalfZeros>(xg, xs, wb, sb, zb, bias, y, c0, m1, K, N, b,
                                               group);
            m0 = m1;
          }
          for (; m0 + kQuad <= c1; m0 += kQuad)
            block_quad<kQuad, kOutF32, kHalfZeros>(xg, xs, wb, sb, zb, bias, y, m0, K, N, b,
                                                   group);
          for (int half = 0; half < 2; ++half)
            for (int64_t m = m0; m + 1 < c1; m += 2) run(Two(), One(), m, half);
          if ((c1 - m0) % 2) run(One(), Two(), c1 - 1, 0);
        }
      }
    }
  }
}

}  // namespace

int infer_int4_avx2_linear(const uint16_t* x, const uint8_t* packed, const uint16_t* scales,
                           const void* zeros, const float* bias, void* y, int64_t M, int64_t K,
                           int64_t N, int64_t group, int half_zeros, int out_f32,
                           int num_threads) {
  if (N % 16 || group <= 0 || group % 8 || K % group || M <= 0) return 1;
  if (out_f32 && half_zeros)
    int4_linear<true, true>(x, packed, scales, zeros, bias, y, M, K, N, group, num_threads);
  else if (out_f32)
    int4_linear<true, false>(x, packed, scales, zeros, bias, y, M, K, N, group, num_threads);
  else if (half_zeros)
    int4_linear<false, true>(x, packed, scales, zeros, bias, y, M, K, N, group, num_threads);
  else
    int4_linear<false, false>(x, packed, scales, zeros, bias, y, M, K, N, group, num_threads);
  return 0;
}

#endif  // INFER_HAVE_AVX2

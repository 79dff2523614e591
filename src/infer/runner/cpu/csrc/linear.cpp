// Linear layers on CPUs with AMX: y[M, N] = x[M, K] . W[N, K]^T (+ bias), decode and prefill.
//
// Decode multiplies a few rows (one per running sequence) by every weight of the model, so the
// step is bound by reading the weights, not by arithmetic. This kernel streams each weight once,
// in the order it is stored, while the AMX units do the multiply-adds from registers:
//
//   packed W : [N/16][K/32] tiles of 16 x 64 bytes, tile (nb, kb) row r = the 16 outputs
//              nb*16 .. nb*16+15, each as the bf16 pair W[n][kb*32 + 2r], W[n][kb*32 + 2r + 1]
//              (the "VNNI" layout TDPBF16PS reads its right operand in)
//   x        : [M, K] bf16, row-major; read as 16-row tiles, rows >= M masked off by the
//              tile's row count
//   y        : [M, N] bf16 (or float32), rows rounded once at the end of K
//
// Each thread owns a contiguous range of 16-column blocks; for one block it keeps up to four
// 16 x 16 float32 accumulators (64 rows of x) in tile registers and walks K once, loading each
// weight tile once and multiplying it into every accumulator. Rows beyond 64 are done in further
// passes over the cached weights; from 64 rows on, 2 x 2 blocks (32 rows x two column blocks)
// load fewer tiles per multiply, for prefill, where the multiplies are the bound.
//
// The summation order over K is fixed (tile by tile, in order), and a row's result does not
// depend on the other rows: the same token gives the same bits in any batch.
//
// int8 weights (weight-only quantization, a float32 scale per output channel) use the same tile
// order at one byte per weight: each tile is widened to bf16 in L1 just ahead of its multiply
// (the integers are exact in bf16) and each column's float32 sums are scaled at the end, so the
// memory stream is half the bytes of bf16.

#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <omp.h>

#include "kernels.h"
#include "simd.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define INFER_HAVE_AMX 1
#endif

namespace {

#ifdef INFER_HAVE_AVX512
// 16 float32 sums -> y[at .. at + 15], float32 or rounded to bf16: every block's epilogue.
template <bool kOutF32>
inline void store_out16(void* y, int64_t at, __m512 v) {
  if (kOutF32)
    _mm512_storeu_ps(static_cast<float*>(y) + at, v);
  else
    infer_simd::store_bf16x16(static_cast<uint16_t*>(y) + at, v);
}

// Row m, columns col .. col + 15 of y = acc * col_scale (int8 weights) + bias (adding zero
// without one, so a -0 sum comes out +0 on every path).
template <bool kOutF32>
inline void store_cols(void* y, int64_t m, int64_t N, int64_t col, __m512 acc,
                       const float* col_scale, const float* bias) {
  const __m512 b = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
  const __m512 v = col_scale ? _mm512_fmadd_ps(acc, _mm512_loadu_ps(col_scale + col), b)
                             : _mm512_add_ps(acc, b);
  store_out16<kOutF32>(y, m * N + col, v);
}
#endif

#ifdef INFER_HAVE_AMX

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// Linux hands out the AMX register state only to processes that ask for it.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0-3 accumulators (16 x 16 float32), 4 the weight tile, 5 a full 16-row x tile,
// 6 the last, partial x tile (rows = tail), 7 a second weight tile (amx_block_2x2, which runs
// with every tile at 16 rows). TDPBF16PS needs the accumulator and the
// x tile to have the same row count, so the accumulator of the partial tile gets `tail` rows.
void configure_tiles(int full, int tail_rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t == full && tail_rows > 0 ? tail_rows : 16);
  }
  cfg.colsb[4] = 64;
  cfg.rows[4] = 16;
  cfg.colsb[5] = 64;
  cfg.rows[5] = 16;
  cfg.colsb[6] = 64;
  cfg.rows[6] = static_cast<uint8_t>(tail_rows > 0 ? tail_rows : 16);
  cfg.colsb[7] = 64;  // the 2 x 2 blocks' second weight tile
  cfg.rows[7] = 16;
  _tile_loadconfig(&cfg);
}


// int8 weights: a tile's 512 bytes -> 512 bf16 (exact for integers), into a small ring that
// runs kRingAhead tiles ahead of the multiplies, with the int8 stream prefetched further ahead
// (measured on the ~110M Llama's projections: 8.5 -> 5 ms for widening alone with the prefetch;
// widening a whole column block first and multiplying after overlapped nothing).
constexpr int kRingSlots = 4, kRingAhead = 2;
constexpr int64_t kInt8PrefetchBytes = 2048;

inline void widen_int8_tile(const int8_t* src, uint16_t* dst) {
  for (int i = 0; i < 512; i += 32) {
    if ((i & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + i + kInt8PrefetchBytes), _MM_HINT_T0);
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    _mm512_store_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// Rows [m0, m0 + rows) of x (rows <= 64, tiles configured for that count) times the 16
// columns of block nb (its kblocks weight tiles at w): four accumulators at most, K walked
// once; then y = acc * col_scale (int8 weights) + bias.
template <bool kOutF32, typename W>
inline void amx_block(const uint16_t* x, const W* w, const float* col_scale, const float* bias,
                      void* y, int64_t m0, int64_t rows, int64_t K, int64_t N, int64_t nb) {
  constexpr bool kInt8 = sizeof(W) == 1;
  const int64_t kblocks = K / 32;
  const int full = static_cast<int>(rows / 16);
  const int mtiles = full + (rows % 16 ? 1 : 0);
  const int64_t xstride = K * 2;  // bytes per row of x
  alignas(64) float acc[64 * 16];
  alignas(64) uint16_t ring[kInt8 ? kRingSlots : 1][512];
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  if constexpr (kInt8)
    for (int64_t kb = 0; kb < kRingAhead && kb < kblocks; ++kb)
      widen_int8_tile(w + kb * 512, ring[kb % kRingSlots]);
  const uint16_t* xb = x + m0 * K;
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    if constexpr (kInt8) {
      if (kb + kRingAhead < kblocks)
        widen_int8_tile(w + (kb + kRingAhead) * 512, ring[(kb + kRingAhead) % kRingSlots]);
      _tile_loadd(4, ring[kb % kRingSlots], 64);
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kb + 8) * 512), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(w + (kb + 8) * 512 + 256), _MM_HINT_T1);
      _tile_loadd(4, w + kb * 512, 64);
    }
    const uint16_t* xk = xb + kb * 32;
    // Tile register numbers must be compile-time constants: unrolled by hand. Tile 5 holds a
    // full 16-row slice of x, tile 6 the partial last one (its accumulator has as many rows).
    if (mtiles >= 1) {
      if (full >= 1) { _tile_loadd(5, xk, xstride); _tile_dpbf16ps(0, 5, 4); }
      else { _tile_loadd(6, xk, xstride); _tile_dpbf16ps(0, 6, 4); }
    }
    if (mtiles >= 2) {
      if (full >= 2) { _tile_loadd(5, xk + 16 * K, xstride); _tile_dpbf16ps(1, 5, 4); }
      else { _tile_loadd(6, xk + 16 * K, xstride); _tile_dpbf16ps(1, 6, 4); }
    }
    if (mtiles >= 3) {
      if (full >= 3) { _tile_loadd(5, xk + 32 * K, xstride); _tile_dpbf16ps(2, 5, 4); }
      else { _tile_loadd(6, xk + 32 * K, xstride); _tile_dpbf16ps(2, 6, 4); }
    }
    if (mtiles >= 4) {
      if (full >= 4) { _tile_loadd(5, xk + 48 * K, xstride); _tile_dpbf16ps(3, 5, 4); }
      else { _tile_loadd(6, xk + 48 * K, xstride); _tile_dpbf16ps(3, 6, 4); }
    }
  }
  if (mtiles >= 1) _tile_stored(0, acc, 64);
  if (mtiles >= 2) _tile_stored(1, acc + 256, 64);
  if (mtiles >= 3) _tile_stored(2, acc + 512, 64);
  if (mtiles >= 4) _tile_stored(3, acc + 768, 64);
  const __m512 b = bias ? _mm512_loadu_ps(bias + nb * 16) : _mm512_setzero_ps();
  const __m512 cs = col_scale ? _mm512_loadu_ps(col_scale + nb * 16) : _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = col_scale ? _mm512_fmadd_ps(_mm512_load_ps(acc + r * 16), cs, b)
                               : _mm512_add_ps(_mm512_load_ps(acc + r * 16), b);
    store_out16<kOutF32>(y, (m0 + r) * N + nb * 16, v);
  }
}

// 32 rows of x times two column blocks (nb, nb + 1) of bf16 weights: 2 x 2 accumulators, so
// each x tile and each weight tile loaded feeds two multiplies (the 4 x 1 block loads an x tile
// per multiply). For prefill, where the step is bound by the multiplies, not by the weights.
// Tiles: 0-3 accumulators, 4 and 5 the two x tiles, 6 and 7 the two weight tiles.
template <bool kOutF32>
inline void amx_block_2x2(const uint16_t* x, const uint16_t* w, const float* bias, void* y,
                          int64_t m0, int64_t K, int64_t N, int64_t nb) {
  const int64_t kblocks = K / 32;
  const int64_t xstride = K * 2;
  const uint16_t* w1 = w + kblocks * 512;
  alignas(64) float acc[4][256];
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint16_t* xb = x + m0 * K;
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    _tile_loadd(6, w + kb * 512, 64);
    _tile_loadd(7, w1 + kb * 512, 64);
    _tile_loadd(4, xb + kb * 32, xstride);
    _tile_loadd(5, xb + 16 * K + kb * 32, xstride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc[0], 64);
  _tile_stored(1, acc[1], 64);
  _tile_stored(2, acc[2], 64);
  _tile_stored(3, acc[3], 64);
  for (int t = 0; t < 4; ++t) {
    const int64_t col = (nb + (t & 1)) * 16, row0 = m0 + (t >> 1) * 16;
    const __m512 b = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < 16; ++r) {
      store_out16<kOutF32>(y, (row0 + r) * N + col, _mm512_add_ps(_mm512_load_ps(acc[t] + r * 16), b));
    }
  }
}

// Threads split the column blocks. Rows go in chunks of up to kChunkRows (a chunk of x stays in
// the core's L2); within a chunk each column block's weights are read from memory once and
// from cache for the chunk's further 64-row passes.
template <bool kOutF32, typename W>
void amx_linear(const uint16_t* x, const W* packed, const float* col_scale, const float* bias,
                void* y, int64_t M, int64_t K, int64_t N, int num_threads) {
  constexpr int64_t kChunkRows = 256;
  constexpr int64_t k2x2MinRows = 64;
  const int64_t nblocks = N / 16, kblocks = K / 32;
#pragma omp parallel num_threads(num_threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t nb0 = nblocks * t / nt, nb1 = nblocks * (t + 1) / nt;
    int configured = -1;  // rows the tiles are configured for
    for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
      const int64_t c1 = c0 + kChunkRows < M ? c0 + kChunkRows : M;
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        int64_t m_start = c0;
        if constexpr (sizeof(W) == 2) {
          // Large batches (prefill): pairs of column blocks, 32 rows at a time; what is left
          // over (an odd last block, fewer than 32 rows) goes through the 4 x 1 blocks below.
          if (M >= k2x2MinRows && nb + 1 < nb1) {
            if (configured != 64) {
              configure_tiles(4, 0);
              configured = 64;
            }
            for (m_start = c0; m_start + 32 <= c1; m_start += 32)
              amx_block_2x2<kOutF32>(x, packed + nb * kblocks * 512, bias, y, m_start, K, N, nb);
            for (int64_t m0 = m_start; m0 < c1; m0 += 64) {
              const int64_t rows = c1 - m0 < 64 ? c1 - m0 : 64;
              if (rows != configured) {
                configure_tiles(static_cast<int>(rows / 16), static_cast<int>(rows % 16));
                configured = static_cast<int>(rows);
              }
              for (int64_t b = nb; b < nb + 2; ++b)
                amx_block<kOutF32>(x, packed + b * kblocks * 512, col_scale, bias, y, m0, rows,
                                   K, N, b);
            }
            ++nb;  // both blocks done
            continue;
          }
        }
        for (int64_t m0 = m_start; m0 < c1; m0 += 64) {
          const int64_t rows = c1 - m0 < 64 ? c1 - m0 : 64;
          if (rows != configured) {
            configure_tiles(static_cast<int>(rows / 16), static_cast<int>(rows % 16));
            configured = static_cast<int>(rows);
          }
          amx_block<kOutF32>(x, packed + nb * kblocks * 512, col_scale, bias, y, m0, rows, K,
                             N, nb);
        }
      }
    }
    _tile_release();
  }
}

#endif  // INFER_HAVE_AMX

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define INFER_HAVE_AVX512_BF16 1

// Without AMX (AMD Zen 4/5, Cooper Lake): the same packed tiles through VDPBF16PS, which
// multiplies a broadcast bf16 pair of x by a tile row (16 outputs x one pair of K) and adds
// into 16 float32 lanes. A block of MR rows x NB column blocks keeps MR * NB accumulators in
// registers and walks K once; each weight row is loaded once per block and used MR times.
//
//   for kb, r:  w[j]   = tile (nb + j, kb) row r              (NB loads, 64 bytes each)
//               x[i]   = broadcast x[m0 + i][kb*32 + 2r .. +1]
//               acc[i][j] += x[i] . w[j]                      (pairwise, float32)
//
// Each row's sums run over K in the same order whatever the other rows are.
template <int MR, int NB, bool kOutF32>
inline void dp_block(const uint16_t* x, const uint16_t* wb, const float* col_scale,
                     const float* bias, void* y, int64_t m0, int64_t K, int64_t N, int64_t nb) {
  const int64_t kblocks = K / 32;
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* xr = x + m0 * K;
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const uint16_t* tile = wb + kb * 512;
    for (int r = 0; r < 16; ++r) {
      __m512bh wv[NB];
      for (int j = 0; j < NB; ++j)
        wv[j] = (__m512bh)_mm512_loadu_si512(tile + j * kblocks * 512 + r * 32);
      const int64_t k = kb * 32 + 2 * r;
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, xr + i * K + k, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MR; ++i)
      store_cols<kOutF32>(y, m0 + i, N, (nb + j) * 16, acc[i][j], col_scale, bias);
}

template <int NB, bool kOutF32>
inline void dp_rows(const uint16_t* x, const uint16_t* wb, const float* col_scale,
                    const float* bias, void* y, int64_t m0, int64_t rows, int64_t K, int64_t N,
                    int64_t nb) {
  infer_simd::with_count<6>(rows, [&](auto r) {
    dp_block<decltype(r)::value, NB, kOutF32>(x, wb, col_scale, bias, y, m0, K, N, nb);
  });
}

// From 7 to 64 rows (decode of a few dozen sequences) the 6-row blocks above read each weight
// from memory on the first pass and again from cache on up to ten more, and those passes wait
// on the multiplies alone. Instead: up to 16 rows against one 16-column block, so one pass of
// 16 rows takes all 16 accumulators and each 64-byte weight row feeds 16 multiplies while the
// next weights stream in (prefetched kTallAheadBytes ahead into L2: one stream per thread, which
// the hardware prefetcher alone keeps too short; into L1 it was slower on Zen 4's 32 KiB L1, the
// ~110M Llama's linears at 8 rows 8.1 -> 6.8 ms, 16 rows 9.3 -> 8.6, same elsewhere). x is
// first interleaved as xp[K/2][pass rows] int32 bf16 pairs, so a pass's rows' pairs for one k
// share a cache line (the rows of x lie K apart: at K = 2048 sixteen of them fall in one L1
// set). The ~110M Llama's linear layers at 16 rows on Zen 5: 6.6-7.0 -> 4.5 ms (the weights'
// read alone: 4.2 ms); 64 rows 16.7 -> 16.2; from ~80 rows the 6 x 4 blocks win.
constexpr int64_t kTallAheadBytes = 8192;
constexpr int64_t kTallMaxRows = 64;

template <int MR, bool kOutF32>
inline void dp_tall_block(const int32_t* xp, int64_t xp_stride, const uint16_t* wb,
                          const float* col_scale, const float* bias, void* y, int64_t m0,
                          int64_t K, int64_t N, int64_t nb) {
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    _mm_prefetch(reinterpret_cast<const char*>(wb + kp * 32) + kTallAheadBytes, _MM_HINT_T1);
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + kp * 32);
    const int32_t* xk = xp + kp * xp_stride;
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(xk[i]), wv);
  }
  for (int i = 0; i < MR; ++i) store_cols<kOutF32>(y, m0 + i, N, nb * 16, acc[i], col_scale, bias);
}

#ifdef INFER_HAVE_BYTE_TABLES
#define INFER_HAVE_INT8_DP 1
// int8 weights (a float32 scale per output channel) without AMX: the same tiles at one byte
// per weight, two tile rows (64 bytes) at a time widened to bf16 in registers by two byte-table
// lookups (simd.h: exact, every integer up to 127 is a bf16), then the bf16 kernels' multiplies
// in the bf16 kernels' order, so a row's bits are the same on every path and in every batch:
//
//   int8 tile rows r, r + 1 (64 bytes) --packed_int8x64_to_bf16--> w0 = row r, w1 = row r + 1
//   acc += x pair (k, k+1) . w0;  acc += x pair (k+2, k+3) . w1;  y = acc * col_scale + bias
//
// Decode streams half the bytes of bf16; the lookups cost 5 instructions per 64 weights next
// to 2 x rows multiplies. Prefill's first 4 rows of a panel widen its weights while
// multiplying and store them (L2) for the bf16 blocks of the other rows.
constexpr int64_t kTallAheadBytes8 = kTallAheadBytes / 2;

template <int MR, bool kOutF32>
inline void dp_tall_block8(const int32_t* xp, int64_t xp_stride, const uint8_t* wb,
                           const float* col_scale, const float* bias, void* y, int64_t m0,
                           int64_t K, int64_t N, int64_t nb) {
  const auto& t = infer_simd::byte_bf16_tables<true>();
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; kp += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(wb + kp * 32) + kTallAheadBytes8, _MM_HINT_T1);
    __m512i w0, w1;
    infer_simd::packed_int8x64_to_bf16(wb + kp * 32, t, w0, w1);
    const int32_t* xk = xp + kp * xp_stride;
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(xk[i]), (__m512bh)w0);
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(xk[xp_stride + i]),
                                (__m512bh)w1);
  }
  for (int i = 0; i < MR; ++i) store_cols<kOutF32>(y, m0 + i, N, nb * 16, acc[i], col_scale, bias);
}

// A few rows (decode of up to 4 sequences, where the weights' stream is the bound): NB column
// blocks side by side, so MR * NB accumulators chain their multiplies independently. With
// `widened` (prefill's first rows) the bf16 weights are also stored there, in the bf16 layout,
// for the panel's further rows.
template <int MR, int NB, bool kOutF32, bool kStore = false>
inline void dp_block8(const uint16_t* x, const uint8_t* wb, const float* col_scale,
                      const float* bias, void* y, int64_t m0, int64_t K, int64_t N, int64_t nb,
                      uint16_t* widened = nullptr) {
  const auto& t = infer_simd::byte_bf16_tables<true>();
  const int64_t kblocks = K / 32;
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* xr = x + m0 * K;
  for (int64_t kp = 0; kp < K / 2; kp += 2) {
    __m512bh x0[MR], x1[MR];
    for (int i = 0; i < MR; ++i) {
      int32_t pair[2];
      std::memcpy(pair, xr + i * K + 2 * kp, 8);
      x0[i] = (__m512bh)_mm512_set1_epi32(pair[0]);
      x1[i] = (__m512bh)_mm512_set1_epi32(pair[1]);
    }
    for (int j = 0; j < NB; ++j) {
      const uint8_t* row = wb + j * kblocks * 512 + kp * 32;
      _mm_prefetch(reinterpret_cast<const char*>(row) + kTallAheadBytes8, _MM_HINT_T1);
      __m512i w0, w1;
      infer_simd::packed_int8x64_to_bf16(row, t, w0, w1);
      if constexpr (kStore) {
        _mm512_store_si512(widened + j * kblocks * 512 + kp * 32, w0);
        _mm512_store_si512(widened + j * kblocks * 512 + kp * 32 + 32, w1);
      }
      for (int i = 0; i < MR; ++i) {
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x0[i], (__m512bh)w0);
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x1[i], (__m512bh)w1);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MR; ++i)
      store_cols<kOutF32>(y, m0 + i, N, (nb + j) * 16, acc[i][j], col_scale, bias);
}

#endif  // INFER_HAVE_BYTE_TABLES

// xp[p][kp][r] = x32[p * pass_rows + r][kp] for the pairs kp in [kp0, kp1) (multiples of 16):
// each pass's rows side by side for every pair of K. A full pass of 16 rows goes as 16 x 16
// blocks transposed in registers; other rows one word at a time.
inline void interleave_pairs(const int32_t* x32, int32_t* xp, int64_t M, int64_t kpairs,
                             int64_t pass_rows, int64_t kp0, int64_t kp1) {
  int64_t m0 = 0;
  if (pass_rows == 16)
    for (; m0 + 16 <= M; m0 += 16) {
      int32_t* dst = xp + m0 * kpairs;
      for (int64_t kp = kp0; kp < kp1; kp += 16) {
        __m512i a[16];
        for (int r = 0; r < 16; ++r) a[r] = _mm512_loadu_si512(x32 + (m0 + r) * kpairs + kp);
        infer_simd::transpose16x16(a);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (kp + j) * 16, a[j]);
      }
    }
  for (int64_t m = m0; m < M; ++m) {
    int32_t* dst = xp + (m / pass_rows) * kpairs * pass_rows + m % pass_rows;
    const int32_t* src = x32 + m * kpairs;
    for (int64_t kp = kp0; kp < kp1; ++kp) dst[kp * pass_rows] = src[kp];
  }
}

// W: uint16_t (bf16 weights) or uint8_t (int8 weights, byte tables).
template <bool kOutF32, typename W>
inline void dp_rows_tall(const int32_t* xp, int64_t xp_stride, const W* wb,
                         const float* col_scale, const float* bias, void* y, int64_t m0,
                         int64_t rows, int64_t K, int64_t N, int64_t nb) {
  infer_simd::with_count<16>(rows, [&](auto r) {
    constexpr int R = decltype(r)::value;
#ifdef INFER_HAVE_INT8_DP
    if constexpr (sizeof(W) == 1)
      dp_tall_block8<R, kOutF32>(xp, xp_stride, wb, col_scale, bias, y, m0, K, N, nb);
    else
#endif
      dp_tall_block<R, kOutF32>(xp, xp_stride, wb, col_scale, bias, y, m0, K, N, nb);
  });
}

// Up to 64 rows (decode): x interleaved, then passes of up to 16 rows over one column block at a
// time.
// Threads take contiguous runs of blocks, long ones first and shorter toward the end
// (schedule(guided)): each thread's weights stay one forward stream for the prefetch, a
// thread that loses its core to the HTTP process or the client for a while has its remaining
// blocks taken by the others, and neither waits long for the other at the end of the call
// (a panel per grab, as below, left ~10% of a 768-column call to one thread: 5.5 -> 4.5 ms).
//
// More rows (prefill): threads take the column panels (4 blocks = 64 outputs) one at a time,
// first come first served; rows go in chunks that stay in L2, 6 at a time, the panel's
// weights read from memory on the first pass, from cache after.
template <bool kOutF32, typename W>
void dp_linear(const uint16_t* x, const W* packed, const float* col_scale, const float* bias,
               void* y, int64_t M, int64_t K, int64_t N, int num_threads) {
  constexpr bool kInt8 = sizeof(W) == 1;
  constexpr int64_t kChunkRows = 96, kRows = 6, kPanel = 4;
  const int64_t nblocks = N / 16, npanels = (nblocks + kPanel - 1) / kPanel;
  const int64_t block_elems = K * 16;  // one column block's weights
  // int8 weights take the tall passes from 5 rows (dp_block8 keeps 4 x 4 accumulators at most).
  const int64_t tall_from = kInt8 ? 5 : kRows + 1;
#ifdef INFER_HAVE_INT8_DP
  if constexpr (kInt8)
    if (M < tall_from) {
      // Up to 4 rows: each thread a contiguous run of column panels, one stream of weights.
#pragma omp parallel for num_threads(num_threads) schedule(guided)
      for (int64_t p = 0; p < npanels; ++p) {
        const int64_t nb = p * kPanel, nbs = nblocks - nb < kPanel ? nblocks - nb : kPanel;
        const W* wb = packed + nb * block_elems;
        infer_simd::with_count<4>(M, [&](auto r) {
          infer_simd::with_count<4>(nbs, [&](auto b) {
            dp_block8<decltype(r)::value, decltype(b)::value, kOutF32>(x, wb, col_scale, bias,
                                                                        y, 0, K, N, nb);
          });
        });
      }
      return;
    }
#endif
  if (M >= tall_from && M <= kTallMaxRows) {
    // Rows split evenly over the passes (33 rows: 11 + 11 + 11, not 16 + 16 + 1, whose
    // one-row pass re-read the weights for one multiply each: the ~110M Llama's linears at 33
    // rows 20.3 -> 18.1 ms, 17 rows 11.9 -> 9.8 on Zen 4); x interleaved per pass, pass_rows words per pair.
    const int64_t kpairs = K / 2, passes = (M + 15) / 16, pass_rows = (M + passes - 1) / passes;
    const auto* x32 = reinterpret_cast<const int32_t*>(x);
    const int64_t xp_bytes = passes * pass_rows * kpairs * 4;
    // On two threads each interleaves the whole of x into its own scratch: no barrier before
    // the blocks, and no scratch lines written by one core and then read by the other on every
    // call (a shared copy, split over the threads, took ~3% of a decode step's samples on a
    // 2-core Zen 4, most of them stores waiting for lines to come back from the other core).
    // With more threads that copy's cost would grow with their number: they split one shared
    // copy and meet at the loop's barrier (not measured on such a machine).
    const bool own_copy = num_threads <= 2;
    auto* shared = own_copy ? nullptr : static_cast<int32_t*>(infer_simd::thread_scratch(xp_bytes));
#pragma omp parallel num_threads(num_threads)
    {
      int32_t* xp = shared;
      if (own_copy) {
        xp = static_cast<int32_t*>(infer_simd::thread_scratch(xp_bytes));
        interleave_pairs(x32, xp, M, kpairs, pass_rows, 0, kpairs);
      } else {
#pragma omp for
        for (int64_t kb = 0; kb < kpairs / 16; ++kb)
          interleave_pairs(x32, xp, M, kpairs, pass_rows, kb * 16, kb * 16 + 16);
      }
#pragma omp for schedule(guided) nowait  // the region's end joins the threads
      for (int64_t b = 0; b < nblocks; ++b) {
        // int8: every pass widens the block's weights again, in registers. Widening a block
        // once into scratch for the passes left its first read of memory with no multiplies
        // to overlap (~110M Llama's linears at 32 rows: 17.3 ms per pass vs 22.4 widened once).
        const W* wb = packed + b * block_elems;
        for (int64_t m0 = 0; m0 < M; m0 += pass_rows) {
          const int64_t rows = M - m0 < pass_rows ? M - m0 : pass_rows;
          dp_rows_tall<kOutF32>(xp + m0 * kpairs, pass_rows, wb, col_scale, bias, y, m0, rows, K,
                                N, b);
        }
      }
    }
    return;
  }
  // int8 weights: a panel's first 4 rows widen its weights while multiplying them and store
  // the bf16 in the thread's scratch (in L2) for the chunks' further rows. Widening the panel
  // first, apart, left its read from memory with no multiplies to overlap (64-token prompts
  // at 16 sequences: int8 0.94x bf16's tokens/s).
  constexpr int64_t kWidenRows = 4;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
  for (int64_t p = 0; p < npanels; ++p) {
    const int64_t nb = p * kPanel, nbs = nblocks - nb < kPanel ? nblocks - nb : kPanel;
    const uint16_t* wb;
    int64_t first = 0;  // rows done
    if constexpr (kInt8) {
#ifdef INFER_HAVE_INT8_DP
      auto* widened = static_cast<uint16_t*>(infer_simd::thread_scratch<1>(kPanel * block_elems * 2));
      const W* w8 = packed + nb * block_elems;
      infer_simd::with_count<4>(nbs, [&](auto b) {
        dp_block8<kWidenRows, decltype(b)::value, kOutF32, true>(x, w8, col_scale, bias, y, 0,
                                                                  K, N, nb, widened);
      });
      wb = widened;
      first = kWidenRows;
#endif
    } else {
      wb = packed + nb * block_elems;
    }
    for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
      const int64_t c1 = c0 + kChunkRows < M ? c0 + kChunkRows : M;
      for (int64_t m0 = c0 > first ? c0 : first; m0 < c1; m0 += kRows) {
        const int64_t rows = c1 - m0 < kRows ? c1 - m0 : kRows;
        infer_simd::with_count<4>(nbs, [&](auto b) {
          dp_rows<decltype(b)::value, kOutF32>(x, wb, col_scale, bias, y, m0, rows, K, N, nb);
        });
      }
    }
  }
}

#endif  // INFER_HAVE_AVX512_BF16

// W [N, K] row-major (bf16 or int8) -> the packed tile layout above. N % 16 == 0, K % 32 == 0.
template <typename T>
int pack_tiles(const T* weight, T* packed, int64_t N, int64_t K) {
  if (N % 16 || K % 32) return 1;
  const int64_t kblocks = K / 32;
#pragma omp parallel for
  for (int64_t nb = 0; nb < N / 16; ++nb)
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      T* tile = packed + (nb * kblocks + kb) * 512;
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t n = 0; n < 16; ++n)
          for (int64_t j = 0; j < 2; ++j)
            tile[r * 32 + n * 2 + j] = weight[(nb * 16 + n) * K + kb * 32 + 2 * r + j];
    }
  return 0;
}

}  // namespace

extern "C" {

// Which kernel infer_tiled_linear runs here: 2 AMX, 1 AVX-512 BF16, 3 AVX2 FMA on widened
// weights (linear_avx2.cpp; bf16 weights only), 0 none. int8 weights: infer_packed_linear_int8.
int infer_packed_linear_kind() {
#ifdef INFER_HAVE_AMX
  if (amx_permitted()) return 2;
#endif
#if defined(INFER_HAVE_AVX512_BF16)
  return 1;
#elif defined(INFER_HAVE_AVX2)
  return 3;
#else
  return 0;
#endif
}

// Whether infer_tiled_linear takes int8 weights here: with AMX, or AVX-512 BF16 with VBMI's
// byte tables.
int infer_packed_linear_int8() {
  const int kind = infer_packed_linear_kind();
#ifdef INFER_HAVE_INT8_DP
  if (kind == 1) return 1;
#endif
  return kind == 2 ? 1 : 0;
}

int infer_tile_pack_weight(const uint16_t* weight, uint16_t* packed, int64_t N, int64_t K) {
  return pack_tiles(weight, packed, N, K);
}

// int8: the AMX tiles; on the AVX-512 BF16 kernel each 64 bytes of them further as
// packed_int8x64_to_bf16 reads them (simd.h).
int infer_tile_pack_int8(const int8_t* weight, int8_t* packed, int64_t N, int64_t K) {
  const int rc = pack_tiles(weight, packed, N, K);
#ifdef INFER_HAVE_INT8_DP
  if (rc == 0 && infer_packed_linear_kind() == 1) {
    for (int64_t i = 0; i < N * K; ++i)  // sign and magnitude hold -127 .. 127 only
      if (weight[i] == -128) return 3;
#pragma omp parallel for
    for (int64_t i = 0; i < N * K; i += 64) {
      int8_t group[64];
      std::memcpy(group, packed + i, 64);
      infer_simd::pack_sign_magnitude64(group, reinterpret_cast<uint8_t*>(packed + i));
    }
  }
#endif
  return rc;
}

// y = (x . W^T) * col_scale + bias. x [M, K] bf16; packed from infer_tile_pack_weight (bf16,
// col_scale null) or infer_tile_pack_int8 (weight_bytes 1, col_scale float32 [N]); bias float32
// [N] or null; y [M, N] bf16 (out_f32 = 0) or float32 (out_f32 = 1).
int infer_tiled_linear(const uint16_t* x, const void* packed, int weight_bytes,
                       const float* col_scale, const float* bias, void* y, int64_t M, int64_t K,
                       int64_t N, int out_f32, int num_threads) {
  if (N % 16 || K % 32 || M <= 0) return 1;
  if (weight_bytes != 2 && (weight_bytes != 1 || !col_scale)) return 1;
  if (weight_bytes == 2 && col_scale) return 1;  // column scales belong to int8 weights
  const int kind = infer_packed_linear_kind();
#ifdef INFER_HAVE_AMX
  if (kind == 2) {
    const auto* w16 = static_cast<const uint16_t*>(packed);
    const auto* w8 = static_cast<const int8_t*>(packed);
    if (weight_bytes == 2 && out_f32) amx_linear<true>(x, w16, col_scale, bias, y, M, K, N, num_threads);
    else if (weight_bytes == 2) amx_linear<false>(x, w16, col_scale, bias, y, M, K, N, num_threads);
    else if (out_f32) amx_linear<true>(x, w8, col_scale, bias, y, M, K, N, num_threads);
    else amx_linear<false>(x, w8, col_scale, bias, y, M, K, N, num_threads);
    return 0;
  }
#endif
#ifdef INFER_HAVE_AVX512_BF16
  auto dp = [&](const auto* w) {  // bf16 (uint16_t) or int8 (uint8_t, byte tables) weights
    if (out_f32) dp_linear<true>(x, w, col_scale, bias, y, M, K, N, num_threads);
    else dp_linear<false>(x, w, col_scale, bias, y, M, K, N, num_threads);
    return 0;
  };
  if (kind == 1 && weight_bytes == 2) return dp(static_cast<const uint16_t*>(packed));
#ifdef INFER_HAVE_INT8_DP
  if (kind == 1 && weight_bytes == 1) return dp(static_cast<const uint8_t*>(packed));
#endif
#endif
#ifdef INFER_HAVE_AVX2
  if (kind == 3 && weight_bytes == 2)
    return infer_fma_linear(x, static_cast<const uint16_t*>(packed), bias, y, M, K, N, out_f32,
                            num_threads);
#endif
  (void)x; (void)packed; (void)bias; (void)y; (void)out_f32; (void)num_threads; (void)kind;
  return 2;
}

}  // extern "C"

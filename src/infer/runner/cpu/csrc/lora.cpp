// Batched LoRA: y[row] += scale * B_slot (A_slot x[row]) for the rows of each adapter slot.
//
//   infer_lora_apply   one projection's low-rank update for a step's rows, grouped by slot
//
// A step's rows are grouped by the adapter slot they use (rows without an adapter are in no
// group); each group reads only its own slot's weights, so a batch of 8 adapters costs one call
// and reads 8 adapters, however the rows are spread, and an unused slot is never read.
//
// A projection may be fused (q|k|v, gate|up): it has P parts, each with its own A and B, whose
// outputs sit side by side in y. Layouts (bf16; R = the pool's largest rank rounded up to 16,
// K2 = ceil(K / 2)):
//
//   A   [S][P][K2][R][2]  A[s][p][k2][j] = (lora_A[j][2 k2], lora_A[j][2 k2 + 1]) of part p
//                         (zero past its rank and past K): the pair order of VDPBF16PS, so one
//                         instruction adds 16 outputs' products with x[2 k2], x[2 k2 + 1]
//   Bt  [S][N16][R][16]   Bt[s][o / 16][j][o % 16] = lora_B[o][j] of the part that owns
//                         output column o (N16 = ceil(N / 16)): a tile of columns is one
//                         contiguous run of memory
//   part_off [P + 1]      part p owns columns part_off[p] .. part_off[p+1]
//   scale[S][P], rank[S][P]   (rank 0: the adapter does not touch that part)
//
//   shrink : xa[i][p*R + j] = sum_k x[row_i][k] * lora_A_p[j][k]            (float32 sums)
//   expand : y[row_i][o]   += scale[s][p] * sum_j xa[i][p*R + j] * lora_B[o][j],  o in part p
//
// Neither step reduces across a vector's lanes: the shrink's lanes are 16 outputs j, the
// expand's 16 output columns. y is rounded to bf16 once, after the whole update. Each row's
// result depends only on its own x and slot, never on the other rows of the step.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>

#include "kernels.h"
#include "simd.h"

namespace {

using infer_simd::bf16_to_f32;
using infer_simd::f32_to_bf16;

constexpr int64_t kTile = 256;       // output columns per expand work item
constexpr int64_t kRows = 8;         // rows sharing one pass over a block of A or Bt
constexpr int64_t kChunk = 4 * kRows;  // rows per shrink work item (prefill groups split)
constexpr int64_t kAhead = 16;        // software prefetch distance, in cache lines of A

// The pair (x[2 k2], x[2 k2 + 1]) as one 32-bit word (the second 0 past an odd K).
inline uint32_t x_pair(const uint16_t* x, int64_t k2, int64_t K) {
  if (2 * k2 + 1 < K) {
    uint32_t w;
    std::memcpy(&w, x + 2 * k2, 4);
    return w;
  }
  return x[2 * k2];
}

// xa[i][j0 + j] for j < 16 and NR rows: one 16-output block of a part's A. NR is a template
// argument so the accumulators stay in registers (a runtime count spills them to the stack).
template <int NR>
inline void shrink_block(const uint16_t* x, int64_t x_stride, const int64_t* rows,
                         const uint16_t* a, int64_t K, int64_t R, float* xa, int64_t xa_stride) {
  const int64_t K2 = (K + 1) / 2;
#if defined(INFER_HAVE_AVX512) && defined(__AVX512BF16__)
  const uint16_t* xr[NR];
  __m512 acc[NR];
  for (int i = 0; i < NR; ++i) {
    xr[i] = x + rows[i] * x_stride;
    acc[i] = _mm512_setzero_ps();
  }
  const int64_t full = K / 2;  // pairs with both elements inside the row
  for (int64_t k2 = 0; k2 < full; ++k2) {
    // One cache line of A a step, read once: fetch ahead (a lone core's streaming read
    // otherwise waits on memory latency).
    _mm_prefetch(reinterpret_cast<const char*>(a + (k2 + kAhead) * R * 2), _MM_HINT_T0);
    const __m512bh w = (__m512bh)_mm512_loadu_si512(a + k2 * R * 2);
    for (int i = 0; i < NR; ++i) {
      int32_t pair;
      std::memcpy(&pair, xr[i] + 2 * k2, 4);
      acc[i] = _mm512_dpbf16_ps(acc[i], w, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
  if (full < K2) {  // K odd: the last element pairs with 0
    const __m512bh w = (__m512bh)_mm512_loadu_si512(a + full * R * 2);
    for (int i = 0; i < NR; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], w, (__m512bh)_mm512_set1_epi32(xr[i][K - 1]));
  }
  for (int i = 0; i < NR; ++i) _mm512_storeu_ps(xa + i * xa_stride, acc[i]);
#else
  for (int i = 0; i < NR; ++i) {
    const uint16_t* xr = x + rows[i] * x_stride;
    float acc[16] = {};
    for (int64_t k2 = 0; k2 < K2; ++k2) {
      const float x0 = bf16_to_f32(xr[2 * k2]);
      const float x1 = 2 * k2 + 1 < K ? bf16_to_f32(xr[2 * k2 + 1]) : 0.f;
      const uint16_t* w = a + k2 * R * 2;
      for (int64_t j = 0; j < 16; ++j)
        acc[j] += bf16_to_f32(w[2 * j]) * x0 + bf16_to_f32(w[2 * j + 1]) * x1;
    }
    for (int64_t j = 0; j < 16; ++j) xa[i * xa_stride + j] = acc[j];
  }
#endif
}

// y[rows[i]][o] += sc * sum_j xa_i[j] * B[o][j] for o in [lo, hi), i < NR (xa_i = xi + i xs);
// bt: the slot's blocks [N16][R][16].
template <int NR>
inline void expand_rows(const float* xi, int64_t xs, const uint16_t* bt, int64_t R, int64_t r,
                        int64_t lo, int64_t hi, float sc, uint16_t* y, int64_t y_stride,
                        const int64_t* rows) {
#ifdef INFER_HAVE_AVX512
  using namespace infer_simd;
  for (int64_t blk = lo / 16; blk * 16 < hi; ++blk) {
    const int64_t o = blk * 16;
    const int64_t first = lo > o ? lo - o : 0, last = hi < o + 16 ? hi - o : 16;
    const __mmask16 m = static_cast<__mmask16>(((1u << last) - 1) & ~((1u << first) - 1));
    const uint16_t* b = bt + blk * R * 16;
    for (int64_t line = 0; line < R * 32; line += 64)  // the next block's rows, ahead
      _mm_prefetch(reinterpret_cast<const char*>(b + R * 16 * kAhead / 4) + line, _MM_HINT_T0);
    __m512 acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < r; ++j) {
      const __m512 bj = load_bf16x16(b + j * 16);
      for (int i = 0; i < NR; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xi[i * xs + j]), bj, acc[i]);
    }
    for (int i = 0; i < NR; ++i) {
      uint16_t* yr = y + rows[i] * y_stride + o;
      const __m512 sum = _mm512_fmadd_ps(_mm512_set1_ps(sc), acc[i], maskz_load_bf16x16(m, yr));
      mask_store_bf16x16(yr, m, sum);
    }
  }
#else
  for (int64_t o = lo; o < hi; ++o) {
    const uint16_t* b = bt + (o / 16) * R * 16 + o % 16;
    for (int i = 0; i < NR; ++i) {
      float acc = 0.f;
      for (int64_t j = 0; j < r; ++j) acc += xi[i * xs + j] * bf16_to_f32(b[j * 16]);
      uint16_t* yr = y + rows[i] * y_stride;
      yr[o] = f32_to_bf16(bf16_to_f32(yr[o]) + sc * acc);
    }
  }
#endif
}

// Runtime row counts (1..kRows) to the templates.
template <template <int> class F, typename... Args>
inline void by_rows(int64_t n, Args... args) {
  switch (n) {
    case 1: F<1>::run(args...); break;
    case 2: F<2>::run(args...); break;
    case 3: F<3>::run(args...); break;
    case 4: F<4>::run(args...); break;
    case 5: F<5>::run(args...); break;
    case 6: F<6>::run(args...); break;
    case 7: F<7>::run(args...); break;
    default: F<8>::run(args...); break;
  }
}

template <int NR>
struct Shrink {
  template <typename... Args>
  static void run(Args... args) { shrink_block<NR>(args...); }
};

template <int NR>
struct Expand {
  template <typename... Args>
  static void run(Args... args) { expand_rows<NR>(args...); }
};

}  // namespace

extern "C" {

int infer_lora_apply(const uint16_t* x, int64_t x_stride, uint16_t* y, int64_t y_stride,
                     int64_t K, int64_t N, const uint16_t* A, const uint16_t* Bt,
                     const float* scale, const int32_t* rank, const int64_t* part_off, int64_t P,
                     int64_t R, const int64_t* rows, const int64_t* group_slot,
                     const int64_t* group_start, const int64_t* group_len, int64_t num_groups,
                     int num_threads) {
  if (num_groups <= 0) return 0;
  if (P <= 0 || R <= 0 || R % 16 || part_off[P] != N) return 1;
  const int64_t num_rows = group_start[num_groups - 1] + group_len[num_groups - 1];
  const int64_t PR = P * R, K2 = (K + 1) / 2, N16 = (N + 15) / 16;
  std::vector<float> xa(static_cast<size_t>(num_rows * PR), 0.f);
  // The shrink's work items: (group, part, block of 16 outputs, chunk of rows), packed as
  // (group << 40) | (part << 32) | (block << 20) | chunk.
  std::vector<int64_t> items;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t s = group_slot[g];
    const int64_t chunks = (group_len[g] + kChunk - 1) / kChunk;
    for (int64_t p = 0; p < P; ++p)
      for (int64_t b = 0; b * 16 < rank[s * P + p]; ++b)
        for (int64_t c = 0; c < chunks; ++c) items.push_back((g << 40) | (p << 32) | (b << 20) | c);
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  // The expand's work items: (group, tile of kTile output columns). A tile reads each of the
  // slot's rank rows of Bt over its columns once and applies them to kRows rows at a time.
  const int64_t num_tiles = (N + kTile - 1) / kTile;
  const int64_t num_expand = num_groups * num_tiles;
  const int threads = num_rows * N >= 4096 ? num_threads : 1;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t it = 0; it < num_items; ++it) {
      const int64_t item = items[it];
      const int64_t g = item >> 40, p = (item >> 32) & 0xff, b = (item >> 20) & 0xfff;
      const int64_t c = item & 0xfffff;
      const uint16_t* a = A + ((group_slot[g] * P + p) * K2 * R + b * 16) * 2;
      const int64_t first = group_start[g] + c * kChunk;
      const int64_t end = std::min(group_start[g] + group_len[g], first + kChunk);
      for (int64_t i0 = first; i0 < end; i0 += kRows) {
        const int64_t n = end - i0 < kRows ? end - i0 : kRows;
        by_rows<Shrink>(n, x, x_stride, rows + i0, a, K, R, &xa[i0 * PR + p * R + b * 16], PR);
      }
    }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < num_expand; ++it) {
      const int64_t g = it / num_tiles, c0 = (it % num_tiles) * kTile;
      const int64_t c1 = c0 + kTile < N ? c0 + kTile : N;
      const int64_t s = group_slot[g], first = group_start[g], end = first + group_len[g];
      for (int64_t p = 0; p < P; ++p) {
        const int64_t lo = part_off[p] > c0 ? part_off[p] : c0;
        const int64_t hi = part_off[p + 1] < c1 ? part_off[p + 1] : c1;
        const int64_t r = rank[s * P + p];
        if (lo >= hi || r == 0) continue;
        const float sc = scale[s * P + p];
        for (int64_t i0 = first; i0 < end; i0 += kRows) {
          const int64_t n = end - i0 < kRows ? end - i0 : kRows;
          by_rows<Expand>(n, &xa[i0 * PR + p * R], PR, Bt + s * N16 * R * 16, R, r, lo, hi,
                          sc, y, y_stride, rows + i0);
        }
      }
    }
  }
  return 0;
}

}  // extern "C"

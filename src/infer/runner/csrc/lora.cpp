// Batched LoRA: y[row] += scale * B_slot (A_slot x[row]) for the rows of each adapter slot.
//
//   infer_lora_apply   one projection's low-rank update for a step's rows, grouped by slot
//
// A step's rows are grouped by the adapter slot they use (rows without an adapter are in no
// group); each group reads only its own slot's weights, so a batch of 8 adapters costs one call
// and reads 8 adapters, however the rows are spread, and an unused slot is never read.
//
// A projection may be fused (q|k|v, gate|up): it has P parts, each with its own A and B, whose
// outputs sit side by side in y. Layouts (bf16, R = the pool's largest rank):
//
//   A   [S][P][R][K]    A[s][p][j] = row j of part p's lora_A (zero rows past its rank)
//   Bt  [S][R][N]       Bt[s][j][o] = lora_B[o][j] of the part that owns output column o
//   part_off [P + 1]    part p owns columns part_off[p] .. part_off[p+1]
//   scale[S][P], rank[S][P]   (rank 0: the adapter does not touch that part)
//
//   shrink : xa[i][p*R + j] = sum_k x[row_i][k] * A[s][p][j][k]      (float32)
//   expand : y[row_i][o]   += scale[s][p] * sum_j xa[i][p*R + j] * Bt[s][j][o],  o in part p
//
// y is rounded to bf16 once, after the whole update. Each row's result depends only on its own
// x and slot, never on the other rows of the step.

#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>

#include "simd.h"

namespace {

using infer_simd::bf16_to_f32;
using infer_simd::f32_to_bf16;

inline float dot_bf16(const uint16_t* a, const uint16_t* b, int64_t k) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < k; ++i) acc += bf16_to_f32(a[i]) * bf16_to_f32(b[i]);
  return acc;
}

}  // namespace

extern "C" {

int infer_lora_apply(const uint16_t* x, int64_t x_stride, uint16_t* y, int64_t y_stride,
                     int64_t K, int64_t N, const uint16_t* A, const uint16_t* Bt,
                     const float* scale, const int32_t* rank, const int64_t* part_off, int64_t P,
                     int64_t R, const int64_t* rows, const int64_t* group_slot,
                     const int64_t* group_start, const int64_t* group_len, int64_t num_groups,
                     int num_threads) {
  if (num_groups <= 0) return 0;
  if (P <= 0 || R <= 0 || part_off[P] != N) return 1;
  const int64_t num_rows = group_start[num_groups - 1] + group_len[num_groups - 1];
  const int64_t PR = P * R;
  std::vector<float> xa(static_cast<size_t>(num_rows * PR), 0.f);
  // The shrink's work items: (group, part, rank row); each reads one row of A once for all of
  // the group's rows.
  std::vector<int64_t> items;
  items.reserve(static_cast<size_t>(num_groups * PR));
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t s = group_slot[g];
    for (int64_t p = 0; p < P; ++p)
      for (int64_t j = 0; j < rank[s * P + p]; ++j) items.push_back((g * P + p) * R + j);
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  // Output columns in blocks of 64 (the expand's work items).
  const int64_t num_blocks = (N + 63) / 64;
  const int threads = num_rows * N >= 4096 ? num_threads : 1;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t it = 0; it < num_items; ++it) {
      const int64_t item = items[it];
      const int64_t j = item % R, gp = item / R, p = gp % P, g = gp / P;
      const uint16_t* a = A + ((group_slot[g] * P + p) * R + j) * K;
      for (int64_t i = group_start[g]; i < group_start[g] + group_len[g]; ++i)
        xa[i * PR + p * R + j] = dot_bf16(x + rows[i] * x_stride, a, K);
    }
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < num_blocks; ++blk) {
      const int64_t o0 = blk * 64, o1 = o0 + 64 < N ? o0 + 64 : N;
      float acc[64];
      for (int64_t g = 0; g < num_groups; ++g) {
        const int64_t s = group_slot[g];
        for (int64_t p = 0; p < P; ++p) {
          const int64_t lo = part_off[p] > o0 ? part_off[p] : o0;
          const int64_t hi = part_off[p + 1] < o1 ? part_off[p + 1] : o1;
          const int64_t r = rank[s * P + p];
          if (lo >= hi || r == 0) continue;
          const float sc = scale[s * P + p];
          for (int64_t i = group_start[g]; i < group_start[g] + group_len[g]; ++i) {
            const float* xi = &xa[i * PR + p * R];
            for (int64_t o = lo; o < hi; ++o) acc[o - lo] = 0.f;
            for (int64_t j = 0; j < r; ++j) {
              const float v = xi[j];
              const uint16_t* b = Bt + (s * R + j) * N;
#pragma omp simd
              for (int64_t o = lo; o < hi; ++o) acc[o - lo] += v * bf16_to_f32(b[o]);
            }
            uint16_t* yr = y + rows[i] * y_stride;
#pragma omp simd
            for (int64_t o = lo; o < hi; ++o)
              yr[o] = f32_to_bf16(bf16_to_f32(yr[o]) + sc * acc[o - lo]);
          }
        }
      }
    }
  }
  return 0;
}

}  // extern "C"

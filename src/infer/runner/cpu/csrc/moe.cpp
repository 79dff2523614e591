// A mixture-of-experts layer on the CPU (model/moe.py's SparseMoE, bfloat16), and Qwen 3's
// per-head q/k norms: what the fused decode loop (csrc/decode_layers.cpp) calls for a sparse
// layer, and what SparseMoE itself calls on a CPU, so both paths give the same bits.
//
//   x [rows, hidden] -> router (bf16 logits, float32 sums) -> softmax (float32) -> top k, ties
//   as torch.topk breaks them -> (renormalised over the k) -> (Mixtral: float32 weights; Qwen:
//   rounded to bf16) -> the (row, slot) pairs grouped by expert, in transformers' order ->
//   each chosen expert once over its rows: gate_up, act(gate) * up, down (the packed bf16,
//   int8, w8a8 or 4-bit kernels, so only the chosen experts' weights are read) -> each row's
//   out = sum over its experts in ascending id of bf16(y * weight), each add rounded to bf16
//   (transformers' index_add order) -> (+ bf16(sigmoid(x . shared_gate) * shared_expert(x)))
//
// With a few rows per expert (decode) the experts run side by side, one per thread, each
// kernel on one thread; with more (prefill) one after another, each on every thread. The
// kernels compute each output from its whole row and column whatever the thread count, so the
// bits do not depend on the choice.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using infer_simd::bf16_to_f32;
using infer_simd::f32_to_bf16;
using infer_simd::round_bf16;

// x . w over n bf16 values, float32 sums in 16 lanes then added lane by lane (a fixed order).
float dot_bf16(const uint16_t* x, const uint16_t* w, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += bf16_to_f32(x[i + j]) * bf16_to_f32(w[i + j]);
  for (int j = 0; i + j < n; ++j) lanes[j] += bf16_to_f32(x[i + j]) * bf16_to_f32(w[i + j]);
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += lanes[j];
  return s;
}

// torch.topk's order on CPU (largest, sorted): NaN first, then greater values; equal values
// where the same sequence of std:: heap / nth_element / sort calls puts them.
using Elem = std::pair<float, int64_t>;
struct TopKGreater {
  bool operator()(const Elem& a, const Elem& b) const {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  }
};

void topk(const float* p, int64_t n, int64_t k, std::vector<Elem>& queue, int32_t* ids,
          float* values) {
  const TopKGreater comp;
  const bool use_heap = k * 64 <= n;
  queue.resize(use_heap ? k : n);
  for (int64_t j = 0; j < static_cast<int64_t>(queue.size()); ++j) queue[j] = {p[j], j};
  if (use_heap) {
    std::make_heap(queue.begin(), queue.end(), comp);
    for (int64_t j = k; j < n; ++j) {
      const Elem v{p[j], j};
      if (comp(v, queue.front())) {
        std::pop_heap(queue.begin(), queue.end(), comp);
        queue.back() = v;
        std::push_heap(queue.begin(), queue.end(), comp);
      }
    }
    std::sort_heap(queue.begin(), queue.end(), comp);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), comp);
    std::sort(queue.begin(), queue.begin() + k - 1, comp);
  }
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = static_cast<int32_t>(queue[j].second);
    values[j] = queue[j].first;
  }
}

// One row's routing: its k experts (torch.topk's order) and their weights.
void route_row(const InferMoE& m, const uint16_t* xr, int64_t hidden, float* probs,
               std::vector<Elem>& queue, int32_t* ids, float* weights) {
  const int64_t e_n = m.num_experts;
  float mx = -INFINITY;
  for (int64_t e = 0; e < e_n; ++e) {
    probs[e] = round_bf16(dot_bf16(xr, m.router + e * hidden, hidden));  // bf16 logits
    mx = std::fmax(mx, probs[e]);
  }
  float sum = 0.f;
  for (int64_t e = 0; e < e_n; ++e) {
    probs[e] = std::exp(probs[e] - mx);
    sum += probs[e];
  }
  for (int64_t e = 0; e < e_n; ++e) probs[e] /= sum;
  topk(probs, e_n, m.top_k, queue, ids, weights);
  if (m.norm_topk) {
    float s = 0.f;
    for (int64_t j = 0; j < m.top_k; ++j) s += weights[j];
    for (int64_t j = 0; j < m.top_k; ++j) weights[j] /= s;
  }
  if (!m.float32_weights)
    for (int64_t j = 0; j < m.top_k; ++j) weights[j] = round_bf16(weights[j]);
}

// A gated MLP over n contiguous rows: gate_up -> act_mul -> down.
int gated_mlp(const InferLinear& gate_up, const InferLinear& down, int64_t inter,
              const uint16_t* x, uint16_t* gu, uint16_t* act_out, uint16_t* y, int64_t n, int act,
              int num_threads) {
  int rc = infer_linear_run(gate_up, x, gu, n, num_threads);
  if (!rc) rc = infer_act_mul(gu, act_out, n, inter, act, num_threads);
  if (!rc) rc = infer_linear_run(down, act_out, y, n, num_threads);
  return rc;
}

struct Scratch {
  std::vector<float> probs, weights;
  std::vector<int32_t> ids, pair_of;  // pair_of[t * k + j]: the pair of row t's j-th expert
  std::vector<int64_t> counts, starts, fill, pair_row;
  std::vector<float> pair_weight;
  std::vector<uint16_t> xs, gu, act, ys, shared;
  std::vector<Elem> queue;
};

}  // namespace

extern "C" {

int infer_qk_norm(uint16_t* qkv, int64_t qkv_n, int64_t rows, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, const uint16_t* q_norm,
                  const uint16_t* k_norm, float eps, int num_threads) {
  const bool fork = rows > 1 && rows * qkv_n >= (1 << 15);
  int rc = 0;
#pragma omp parallel for num_threads(fork ? num_threads : 1) reduction(| : rc)
  for (int64_t t = 0; t < rows; ++t) {
    uint16_t* q = qkv + t * qkv_n;
    uint16_t* k = q + num_heads * head_dim;
    rc |= infer_add_rms_norm(q, nullptr, q_norm, nullptr, q, num_heads, head_dim, eps, 1);
    rc |= infer_add_rms_norm(k, nullptr, k_norm, nullptr, k, num_kv_heads, head_dim, eps, 1);
  }
  return rc;
}

int infer_moe(const InferMoE* mp, const uint16_t* x, uint16_t* out, int64_t rows, int64_t hidden,
              int act, int num_threads) {
  const InferMoE& m = *mp;
  const int64_t E = m.num_experts, k = m.top_k, pairs = rows * k, inter = m.inter;
  if (k < 1 || k > E || k > 256) return 1;
  // The calling thread's buffers (a reference: OpenMP's threads read these, not their own).
  thread_local Scratch scratch;
  Scratch& s = scratch;
  s.probs.resize(rows * E);
  s.weights.resize(pairs);
  s.ids.resize(pairs);
  s.pair_of.resize(pairs);
  s.counts.assign(E, 0);
  s.starts.resize(E + 1);
  s.fill.resize(E);
  s.pair_row.resize(pairs);
  s.pair_weight.resize(pairs);
  s.xs.resize(pairs * hidden);
  s.gu.resize(pairs * 2 * inter);
  s.act.resize(pairs * inter);
  s.ys.resize(pairs * hidden);

  // 1. Route every row (rows are independent: split over the threads when there are many).
  if (rows >= 8) {
#pragma omp parallel num_threads(num_threads)
    {
      std::vector<Elem> queue;
#pragma omp for
      for (int64_t t = 0; t < rows; ++t)
        route_row(m, x + t * hidden, hidden, s.probs.data() + t * E, queue, s.ids.data() + t * k,
                  s.weights.data() + t * k);
    }
  } else {
    for (int64_t t = 0; t < rows; ++t)
      route_row(m, x + t * hidden, hidden, s.probs.data() + t * E, s.queue, s.ids.data() + t * k,
                s.weights.data() + t * k);
  }

  // 2. Group the (row, slot) pairs by expert: slot-major, stable, so an expert's rows come by
  //    slot, then row (transformers' order).
  for (int64_t p = 0; p < pairs; ++p) ++s.counts[s.ids[p]];
  s.starts[0] = 0;
  for (int64_t e = 0; e < E; ++e) s.starts[e + 1] = s.starts[e] + s.counts[e];
  for (int64_t e = 0; e < E; ++e) s.fill[e] = s.starts[e];
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t at = s.fill[s.ids[t * k + j]]++;
      s.pair_row[at] = t;
      s.pair_weight[at] = s.weights[t * k + j];
      s.pair_of[t * k + j] = static_cast<int32_t>(at);
    }
  std::vector<int64_t> active;
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e)
    if (s.counts[e]) {
      active.push_back(e);
      most = std::max(most, s.counts[e]);
      if (m.expert_rows) m.expert_rows[e] += s.counts[e];
    }
  for (int64_t p = 0; p < pairs; ++p)
    std::memcpy(s.xs.data() + p * hidden, x + s.pair_row[p] * hidden, hidden * 2);

  // 3. Each chosen expert once over its rows.
  auto run = [&](int64_t e, int threads) {
    const int64_t a = s.starts[e], n = s.counts[e];
    return gated_mlp(m.gate_up[e], m.down[e], inter, s.xs.data() + a * hidden,
                     s.gu.data() + a * 2 * inter, s.act.data() + a * inter,
                     s.ys.data() + a * hidden, n, act, threads);
  };
  int rc = 0;
  const int64_t n_active = static_cast<int64_t>(active.size());
  if (num_threads > 1 && most <= 16 && n_active >= num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) reduction(| : rc)
    for (int64_t i = 0; i < n_active; ++i) rc |= run(active[i], 1);
  } else {
    for (int64_t i = 0; i < n_active && !rc; ++i) rc = run(active[i], num_threads);
  }
  if (rc) return 10 + rc;

  // 4. Qwen2-MoE's shared expert, over every row.
  const bool shared = m.shared_gate_up != nullptr;
  if (shared) {
    const int64_t si = m.shared_inter;
    s.shared.resize(rows * (hidden + 3 * si));
    uint16_t* sy = s.shared.data();
    rc = gated_mlp(*m.shared_gate_up, *m.shared_down, si, x, sy + rows * hidden,
                   sy + rows * (hidden + 2 * si), sy, rows, act, num_threads);
    if (rc) return 20 + rc;
  }

  // 5. Each row: its experts' weighted outputs in ascending expert order, each product and each
  //    sum rounded to bf16 (then the gated shared expert's).
  const bool fork = rows >= 8;
#pragma omp parallel for num_threads(fork ? num_threads : 1)
  for (int64_t t = 0; t < rows; ++t) {
    int32_t order[256];
    int64_t kk = 0;
    for (int64_t j = 0; j < k && kk < 256; ++j) order[kk++] = s.pair_of[t * k + j];
    std::sort(order, order + kk);  // pairs are grouped by expert: ascending pair = ascending id
    uint16_t* o = out + t * hidden;
    for (int64_t d = 0; d < hidden; ++d) o[d] = 0;
    for (int64_t j = 0; j < kk; ++j) {
      const int64_t p = order[j];
      const float w = s.pair_weight[p];
      const uint16_t* y = s.ys.data() + p * hidden;
      for (int64_t d = 0; d < hidden; ++d)
        o[d] = f32_to_bf16(bf16_to_f32(o[d]) + round_bf16(bf16_to_f32(y[d]) * w));
    }
    if (shared) {
      const float g = round_bf16(dot_bf16(x + t * hidden, m.shared_gate, hidden));
      const float gate = round_bf16(1.f / (1.f + std::exp(-g)));
      const uint16_t* y = s.shared.data() + t * hidden;
      for (int64_t d = 0; d < hidden; ++d)
        o[d] = f32_to_bf16(bf16_to_f32(o[d]) + round_bf16(gate * bf16_to_f32(y[d])));
    }
  }
  return 0;
}

}  // extern "C"

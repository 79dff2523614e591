// The decoder layers of an all-decode step in one call (runner/cpu/decode_fast.py's loop, in C++).
//
// Each layer is the same eight kernel calls the Python loop makes, with the same arguments, so
// the results are the same bits; what goes is the interpreter and ctypes between them (~100
// calls a step at a few microseconds each: ~0.3 ms of a 5-10 ms step).
//
//   x -> add_rms_norm(x += pending) -> normed -> qkv linear -> rope + KV store -> decode
//   attention -> o linear -> add_rms_norm(x += o) -> gate_up linear -> act_mul -> down linear
//   -> pending (added to x by the next layer's norm, or the final norm after the last)
//
// Qwen 3's q/k norms run on the qkv row before the rope; a sparse layer's MLP is infer_moe
// (csrc/moe.cpp: router, top-k, the chosen experts only, their weighted sum). With LoRA
// adapters, each adapted projection's output gets its rows' low-rank updates (csrc/lora.cpp)
// right after the linear kernel.

#include <cstdint>

#include "kernels.h"

extern "C" {

struct InferDecodeLayer {
  const uint16_t* attn_norm;
  const uint16_t* mlp_norm;
  InferLinear qkv, o, gate_up, down;
  float scale;
  int64_t window;
  void* key_cache;
  void* value_cache;
  uint16_t* key_scales;  // null for a plain cache
  uint16_t* value_scales;
  const uint16_t* q_norm;  // Qwen 3's per-head RMSNorms of q and k, before rope (null: none)
  const uint16_t* k_norm;
  const InferMoE* moe;     // a mixture of experts in place of gate_up / act_mul / down
  const InferLoRA* lora[4];  // LoRA slots of qkv, o, gate_up, down (null: not adapted)
};

// The model's shapes and the step buffers ([max_rows, width] bf16 each).
struct InferDecodeModel {
  int64_t hidden, inter, qkv_n, num_heads, num_kv_heads, head_dim, block_size;
  float eps;
  int act, kv_kind;
  uint16_t *x, *normed, *qkv, *attn, *o, *gate_up, *act_out, *down;
  const InferLoRAStep* lora_step;  // this step's adapter rows (null: none)
};

// Runs every layer over `rows` decode tokens; x holds their embeddings on entry and the
// residual stream before the last layer's MLP output on return (that output is in down).
// Returns 0, or 100 * (layer + 1) + the failing kernel's code.
int infer_decode_layers(const InferDecodeLayer* layers, int64_t num_layers,
                        const InferDecodeModel* m, int64_t rows, const uint16_t* cos,
                        const uint16_t* sin, const int64_t* slots, const int32_t* block_tables,
                        const int32_t* context_lens, int64_t max_blocks, int num_threads) {
  auto linear = [&](const InferLinear& w, const uint16_t* in, uint16_t* out) {
    return infer_linear_run(w, in, out, rows, num_threads);
  };
  // A projection's LoRA update, added to its output before anything reads it.
  const InferLoRAStep* step = m->lora_step;
  auto lora = [&](const InferLoRA* w, const uint16_t* in, int64_t k, uint16_t* out, int64_t n) {
    if (!w || !step) return 0;
    return infer_lora_apply(in, k, out, n, k, n, w->a, w->bt, w->scale, w->rank, w->part_off,
                            w->num_parts, w->max_rank, step->rows, step->group_slot,
                            step->group_start, step->group_len, step->num_groups, num_threads);
  };
  const int64_t q_size = m->num_heads * m->head_dim;
  for (int64_t i = 0; i < num_layers; ++i) {
    const InferDecodeLayer& l = layers[i];
    const uint16_t* pending = i > 0 ? m->down : nullptr;
    int rc = infer_add_rms_norm(m->x, pending, l.attn_norm, pending ? m->x : nullptr, m->normed,
                                rows, m->hidden, m->eps, num_threads);
    if (!rc) rc = linear(l.qkv, m->normed, m->qkv);
    if (!rc) rc = lora(l.lora[0], m->normed, m->hidden, m->qkv, m->qkv_n);
    if (!rc && l.q_norm) rc = infer_qk_norm(m->qkv, m->qkv_n, rows, m->num_heads,
                                           m->num_kv_heads, m->head_dim, l.q_norm, l.k_norm,
                                           m->eps, num_threads);
    if (!rc)
      rc = infer_rope_write_kv(m->qkv, cos, sin, m->kv_kind, l.key_cache, l.value_cache,
                               l.key_scales, l.value_scales, slots, rows, m->qkv_n,
                               m->num_heads, m->num_kv_heads, m->head_dim, num_threads);
    if (!rc)
      rc = infer_decode_attention(1, m->kv_kind, m->qkv, m->qkv_n, l.key_cache, l.value_cache,
                                  l.key_scales, l.value_scales, m->attn, block_tables,
                                  context_lens, rows, m->num_heads, m->num_kv_heads,
                                  m->head_dim, m->block_size, max_blocks, l.scale, l.window,
                                  num_threads);
    if (!rc) rc = linear(l.o, m->attn, m->o);
    if (!rc) rc = lora(l.lora[1], m->attn, q_size, m->o, m->hidden);
    if (!rc)
      rc = infer_add_rms_norm(m->x, m->o, l.mlp_norm, m->x, m->normed, rows, m->hidden, m->eps,
                              num_threads);
    if (l.moe) {
      if (!rc) rc = infer_moe(l.moe, m->normed, m->down, rows, m->hidden, m->act, num_threads);
    } else {
      if (!rc) rc = linear(l.gate_up, m->normed, m->gate_up);
      if (!rc) rc = lora(l.lora[2], m->normed, m->hidden, m->gate_up, 2 * m->inter);
      if (!rc) rc = infer_act_mul(m->gate_up, m->act_out, rows, m->inter, m->act, num_threads);
      if (!rc) rc = linear(l.down, m->act_out, m->down);
      if (!rc) rc = lora(l.lora[3], m->act_out, m->inter, m->down, m->hidden);
    }
    if (rc) return static_cast<int>(100 * (i + 1)) + rc;
  }
  return 0;
}

}  // extern "C"

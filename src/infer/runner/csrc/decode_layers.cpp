// The decoder layers of an all-decode step in one call (runner/decode_fast.py's loop, in C++).
//
// Each layer is the same eight kernel calls the Python loop makes, with the same arguments, so
// the results are the same bits; what goes is the interpreter and ctypes between them (~100
// calls a step at a few microseconds each: ~0.3 ms of a 5-10 ms step).
//
//   x -> add_rms_norm(x += pending) -> normed -> qkv linear -> rope + KV store -> decode
//   attention -> o linear -> add_rms_norm(x += o) -> gate_up linear -> act_mul -> down linear
//   -> pending (added to x by the next layer's norm, or the final norm after the last)

#include <cstdint>

#include "kernels.h"

extern "C" {

// One linear layer's packed weight (infer_tiled_linear's arguments; with colsum,
// infer_w8a8_linear's; with a group size, infer_int4_linear's).
struct InferLinear {
  const void* weight;
  int64_t weight_bytes;
  const float* col_scale;  // int8 weights only
  const float* bias;
  int64_t n, k;
  const int32_t* colsum;  // w8a8 weights only
  const uint16_t* group_scales;  // 4-bit weights only: float16 [n/16][k/group][16]
  const uint8_t* group_zeros;    // and their zeros
  int64_t group_size;            // 0: not 4-bit
  int64_t int8_activations;      // 4-bit: the w4a8 kernel
};

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
};

// The model's shapes and the step buffers ([max_rows, width] bf16 each).
struct InferDecodeModel {
  int64_t hidden, inter, qkv_n, num_heads, num_kv_heads, head_dim, block_size;
  float eps;
  int act, kv_kind;
  uint16_t *x, *normed, *qkv, *attn, *o, *gate_up, *act_out, *down;
};

// Runs every layer over `rows` decode tokens; x holds their embeddings on entry and the
// residual stream before the last layer's MLP output on return (that output is in down).
// Returns 0, or 100 * (layer + 1) + the failing kernel's code.
int infer_decode_layers(const InferDecodeLayer* layers, int64_t num_layers,
                        const InferDecodeModel* m, int64_t rows, const uint16_t* cos,
                        const uint16_t* sin, const int64_t* slots, const int32_t* block_tables,
                        const int32_t* context_lens, int64_t max_blocks, int num_threads) {
  auto linear = [&](const InferLinear& w, const uint16_t* in, uint16_t* out) {
    if (w.group_size)
      return infer_int4_linear(in, static_cast<const uint8_t*>(w.weight), w.group_scales,
                               w.group_zeros, w.bias, out, rows, w.k, w.n, w.group_size,
                               static_cast<int>(w.int8_activations), 0, num_threads);
    if (w.colsum)
      return infer_w8a8_linear(in, static_cast<const int8_t*>(w.weight), w.colsum, w.col_scale,
                               w.bias, out, rows, w.k, w.n, 0, num_threads);
    return infer_tiled_linear(in, w.weight, static_cast<int>(w.weight_bytes), w.col_scale,
                              w.bias, out, rows, w.k, w.n, 0, num_threads);
  };
  for (int64_t i = 0; i < num_layers; ++i) {
    const InferDecodeLayer& l = layers[i];
    const uint16_t* pending = i > 0 ? m->down : nullptr;
    int rc = infer_add_rms_norm(m->x, pending, l.attn_norm, pending ? m->x : nullptr, m->normed,
                                rows, m->hidden, m->eps, num_threads);
    if (!rc) rc = linear(l.qkv, m->normed, m->qkv);
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
    if (!rc)
      rc = infer_add_rms_norm(m->x, m->o, l.mlp_norm, m->x, m->normed, rows, m->hidden, m->eps,
                              num_threads);
    if (!rc) rc = linear(l.gate_up, m->normed, m->gate_up);
    if (!rc) rc = infer_act_mul(m->gate_up, m->act_out, rows, m->inter, m->act, num_threads);
    if (!rc) rc = linear(l.down, m->act_out, m->down);
    if (rc) return static_cast<int>(100 * (i + 1)) + rc;
  }
  return 0;
}

}  // extern "C"

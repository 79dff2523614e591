"""A Llama-family model's forward pass without Python in the layer loop.

At decode sizes a layer's kernels take tens of microseconds each, and the Python around them
(module calls, dispatch checks, tensor allocations, argument marshalling) cost ~3 ms of an
11.5 ms batch-1 step of the ~110M Llama. :class:`FastDecoder` runs the same kernels in the same
order as the module code, straight from precomputed arguments into buffers allocated once::

    x = embed(ids)                                   (the residual stream, in place)
    for each layer:
        x, normed = x + pending, attn_norm(...)      add_rms_norm
        qkv = qkv_proj(normed)                       tiled linear (bf16, int8 or w8a8 weights)
        rope(q, k) in place; k, v -> cache          rope_write_kv
        attn = decode_attention(q, cache)            (q read in place from qkv; in a step with
                                                      prefill chunks: AttentionContext.attend)
        o = o_proj(attn)
        x, normed = x + o, mlp_norm(...)
        pending = down(act(gate) * up)(normed)       tiled linear, act_mul, tiled linear
    hidden = norm(x + pending)

In an all-decode step the loop over the layers itself is one C++ call (csrc/decode_layers.cpp:
the same kernel calls, from ``ctypes`` structures built once). The results are bit-for-bit those
of the module path (same kernels, same inputs; tested). It
takes every step that fits its buffers (max(max_num_seqs, max_num_batched_tokens) rows), and only
models where every piece has its kernel: CPU bfloat16, tiled linear layers, a decoder without
sandwich norms or an embedding scale, one rope for every layer, and a supported activation;
anything else takes the module path. Qwen 3's q/k norms run in place on the qkv row before the
rope (``infer_qk_norm``); a sparse layer's MLP is one ``infer_moe`` call (csrc/moe.cpp, the
function :class:`infer.model.moe.SparseMoE` itself calls on a CPU; runner/cpu/moe_kernel.py).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from infer.model.llama import PlainDecoder
from infer.model.moe import SparseMoE
from infer.runner.attention import AttentionContext, KVCache
from infer.runner.cpu.fused_ops import cpu_ops
from infer.runner.cpu.kernels import (
    ACT_MUL_CODES,
    CpuKernels,
    DecodeLayer,
    DecodeModel,
    LinearArgs,
    LoRAArgs,
    cpu_kernels,
)
from infer.runner.cpu.prepack import TiledLinear
from infer.runner.int4 import Int4Linear
from infer.runner.kv_quant import KIND_CODES
from infer.runner.lora.layers import LoRALinear, LoRAState
from infer.runner.quant import Int8Linear, W8A8Linear

logger = logging.getLogger("infer.runner")


def _linear_args(module: torch.nn.Module) -> tuple | None:
    """(packed weight ptr, bytes per weight, column scales ptr, bias ptr, N, K, column sums ptr
    (w8a8 only), group scales ptr, group zeros ptr, group size, the 4-bit kernel's flags
    (4-bit only)), or None."""
    colsum = None
    if isinstance(module, Int4Linear):
        if module.mode != "kernel" or module.padded or module.perm is not None:
            return None
        bias = module.fbias
        return (
            module.packed.data_ptr(), 0, None, None if bias is None else bias.data_ptr(),
            module.out_features, module.in_features, None, module.scales.data_ptr(),
            module.zeros.data_ptr(), module.group_size, module.kernel_flags,
        )  # fmt: skip
    if isinstance(module, TiledLinear):
        weight, scales, bias = module.packed_weight, None, module.bias
    elif isinstance(module, Int8Linear) and module.mode == "tiled":
        weight, scales, bias = module.q, module.scale, module.fbias
    elif isinstance(module, W8A8Linear) and not module.padded:
        weight, scales, bias, colsum = module.packed, module.scale, module.fbias, module.colsum
    else:
        return None
    return (
        weight.data_ptr(),
        weight.element_size(),
        None if scales is None else scales.data_ptr(),
        None if bias is None else bias.data_ptr(),
        module.out_features,
        module.in_features,
        None if colsum is None else colsum.data_ptr(),
        None,
        None,
        0,
        0,
    )


# A sparse layer's unused dense MLP slots.
_NO_LINEAR = (None, 0, None, None, 0, 0, None, None, None, 0, 0)


def _unwrap(module: torch.nn.Module) -> tuple[torch.nn.Module, LoRAArgs | None]:
    """A projection's own linear layer, and its LoRA slots if adapters wrap it."""
    if isinstance(module, LoRALinear):
        return module.base, module.c_args
    return module, None


def _c_layer(layer: tuple) -> DecodeLayer:
    (_, attn_norm, mlp_norm, qkv, o, gate_up, down, scale, window, kc, vc, ks, vs, qn, kn,
     moe, loras) = layer  # fmt: skip
    lora_ptrs = (ctypes.c_void_p * 4)(*(None if a is None else ctypes.addressof(a) for a in loras))
    return DecodeLayer(attn_norm, mlp_norm, LinearArgs(*qkv), LinearArgs(*o),
                       LinearArgs(*gate_up), LinearArgs(*down), scale, window, kc, vc, ks, vs,
                       qn, kn, None if moe is None else moe.address, lora_ptrs)  # fmt: skip


class FastDecoder:
    """Runs a model's :class:`~infer.model.llama.PlainDecoder` for steps of up to ``max_rows``
    tokens."""

    def __init__(self, plain: PlainDecoder, cache: KVCache, kernels: CpuKernels, max_rows: int,
                 layers: list[tuple]) -> None:  # fmt: skip
        self.plain = plain
        self.cache = cache
        self.k = kernels
        self.layers = layers
        self.max_rows = max_rows
        self.lora_state: LoRAState | None = None  # set by build() when adapters wrap the model
        self.hidden = plain.hidden_size
        self.heads, self.kv_heads, self.head_dim = (
            plain.num_heads,
            plain.num_kv_heads,
            plain.head_dim,
        )
        self.eps = plain.rms_norm_eps
        assert plain.activation is not None
        self.act = ACT_MUL_CODES[plain.activation]
        self.inter = plain.intermediate_size
        self.kind = KIND_CODES[cache.kind]
        self.qkv_n = (plain.num_heads + 2 * plain.num_kv_heads) * plain.head_dim
        self.final_norm = plain.final_norm.weight.data_ptr()
        self.cos_table, self.sin_table = plain.rope_cos, plain.rope_sin

        def buf(n: int) -> torch.Tensor:
            return torch.empty(max_rows, n, dtype=torch.bfloat16)

        self.x, self.normed, self.out = (
            buf(self.hidden),
            buf(self.hidden),
            buf(self.hidden),
        )
        self.qkv, self.attn, self.o = (
            buf(self.qkv_n),
            buf(self.heads * self.head_dim),
            buf(self.hidden),
        )
        self.gate_up, self.act_out, self.down = (
            buf(2 * self.inter),
            buf(self.inter),
            buf(self.hidden),
        )
        self.cos, self.sin = buf(self.head_dim), buf(self.head_dim)  # fmt: skip
        # The same, for the C++ loop over the layers (all-decode steps).
        self.c_layers = (DecodeLayer * len(layers))(*(_c_layer(layer) for layer in layers))
        self.c_model = DecodeModel(
            self.hidden, self.inter, self.qkv_n, self.heads, self.kv_heads, self.head_dim,
            cache.block_size, self.eps, self.act, self.kind,
            *(t.data_ptr() for t in (self.x, self.normed, self.qkv, self.attn, self.o,
                                     self.gate_up, self.act_out, self.down)),
        )  # fmt: skip

    @staticmethod
    def build(model: torch.nn.Module, cache: KVCache, max_rows: int) -> FastDecoder | None:
        """The fast path for this model and cache, or None where the module path must run."""
        kernels = cpu_kernels()
        plain_decoder = getattr(model, "plain_decoder", None)
        plain = plain_decoder() if plain_decoder is not None else None
        if kernels is None or plain is None or cache.dtype != torch.bfloat16:
            return None
        if plain.embed.dtype != torch.bfloat16 or plain.activation is None:
            return None
        if plain.head_dim % 2 or plain.head_dim > 512:
            return None
        layers = []
        for i, layer in enumerate(plain.layers):
            mlp = layer.mlp
            moe = None
            if isinstance(mlp, SparseMoE):  # one C++ call for the routing and the experts
                ops = cpu_ops()
                moe = mlp.fused_kernel(ops) if ops is not None else None
                if moe is None:
                    return None
                projections = [layer.qkv_proj, layer.o_proj]
            else:
                projections = [layer.qkv_proj, layer.o_proj, mlp.gate_up_proj, mlp.down_proj]
            unwrapped = [_unwrap(m) for m in projections]
            loras = tuple(a for _, a in unwrapped) + (None,) * (4 - len(unwrapped))
            linears = [_linear_args(m) for m, _ in unwrapped] + [_NO_LINEAR] * (4 - len(unwrapped))
            if any(a is None for a in linears):
                return None
            if layer.attn_norm.weight.dtype != torch.bfloat16:
                return None
            norms = (layer.q_norm, layer.k_norm)
            if any(n is not None and n.weight.dtype != torch.bfloat16 for n in norms):
                return None
            qn, kn = (None, None) if norms[0] is None else (n.weight.data_ptr() for n in norms)
            k_cache, v_cache = cache.layer(i)
            k_scales, v_scales = cache.layer_scales(i)
            layers.append((
                i, layer.attn_norm.weight.data_ptr(), layer.mlp_norm.weight.data_ptr(), *linears,
                layer.scale, layer.sliding_window or 0,
                k_cache.data_ptr(), v_cache.data_ptr(),
                None if k_scales is None else k_scales.data_ptr(),
                None if v_scales is None else v_scales.data_ptr(), qn, kn, moe, loras,
            ))  # fmt: skip
        fast = FastDecoder(plain, cache, kernels, max_rows, layers)
        # LoRA adapters: the step's grouping, shared by every wrapper (runner/lora/layers.py).
        fast.lora_state = next(
            (m.state for m in model.modules() if isinstance(m, LoRALinear)), None
        )
        buffers = sum(b.numel() * b.element_size() for b in vars(fast).values()
                      if isinstance(b, torch.Tensor) and b.dim() == 2 and b.shape[0] == max_rows)  # fmt: skip
        logger.info("fast forward path: %d-token buffers, %.1f MiB", max_rows, buffers / 2**20)
        return fast

    def covers(self, ctx: AttentionContext) -> bool:
        """Whether this step fits the buffers (a prompt longer than the token budget may not)."""
        return ctx.num_tokens <= self.max_rows

    def _qkv_views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv[:rows]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (
            qkv[:, :q_size].view(rows, self.heads, self.head_dim),
            qkv[:, q_size : q_size + kv_size].view(rows, self.kv_heads, self.head_dim),
            qkv[:, q_size + kv_size :].view(rows, self.kv_heads, self.head_dim),
        )

    def _linear(self, x: int, args: tuple, y: int, rows: int) -> None:
        w, wbytes, scales, bias, n, k, *extra = args
        self.k.linear_into(x, w, wbytes, scales, bias, y, rows, k, n, *extra)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` (a view of a buffer the next call overwrites)."""
        rows = input_ids.shape[0]
        k = self.k
        x, normed = self.x[:rows], self.normed[:rows]
        torch.index_select(self.plain.embed, 0, input_ids, out=x)
        torch.index_select(self.cos_table, 0, positions, out=self.cos[:rows])
        torch.index_select(self.sin_table, 0, positions, out=self.sin[:rows])
        cos, sin, slots = self.cos.data_ptr(), self.sin.data_ptr(), ctx.slot_mapping.data_ptr()
        batch = None if self.lora_state is None else self.lora_state.batch
        step = None if batch is None else batch.c_step
        self.c_model.lora_step = None if step is None else ctypes.addressof(step)
        if ctx.all_decode:  # every layer in one C++ call
            tables, lens = ctx.decode_tables()
            k.decode_layers_into(self.c_layers, len(self.layers), self.c_model, rows, cos, sin,
                                 slots, tables.data_ptr(), lens.data_ptr(), tables.shape[1])  # fmt: skip
            return self._final_norm(rows, self.down.data_ptr())
        xp, np_, qkv = x.data_ptr(), normed.data_ptr(), self.qkv.data_ptr()
        o, gu, act, down = (
            self.o.data_ptr(),
            self.gate_up.data_ptr(),
            self.act_out.data_ptr(),
            self.down.data_ptr(),
        )
        # Prefill chunks in the step: the same kernels from Python, with the attention module's
        # own code for attention.
        h, hkv, d = self.heads, self.kv_heads, self.head_dim
        pending = None
        hidden, inter = self.hidden, self.inter

        def lora(args: LoRAArgs | None, x: int, k_in: int, y: int, n: int) -> None:
            if args is not None and step is not None:
                k.lora_into(x, k_in, y, n, k_in, n, args, step)

        for (i, attn_norm, mlp_norm, qkv_args, o_args, gu_args, down_args, scale, window,
             kc, vc, ks, vs, qn, kn, moe, loras) in self.layers:  # fmt: skip
            k.add_rms_norm_into(xp, pending, attn_norm, xp if pending else None, np_, rows,
                                self.hidden, self.eps)  # fmt: skip
            self._linear(np_, qkv_args, qkv, rows)
            lora(loras[0], np_, hidden, qkv, self.qkv_n)
            if qn is not None:
                k.qk_norm_into(qkv, self.qkv_n, rows, h, hkv, d, qn, kn, self.eps)
            k.rope_write_kv_into(qkv, cos, sin, self.kind, kc, vc, ks, vs, slots, rows,
                                 self.qkv_n, h, hkv, d)  # fmt: skip
            q, key, value = self._qkv_views(rows)
            out = ctx.attend(i, q, key, value, scale=scale, sliding_window=window or None,
                             kv_stored=True).reshape(rows, h * d).contiguous()  # fmt: skip
            self._linear(out.data_ptr(), o_args, o, rows)
            lora(loras[1], out.data_ptr(), h * d, o, hidden)
            k.add_rms_norm_into(xp, o, mlp_norm, xp, np_, rows, self.hidden, self.eps)
            if moe is not None:
                k.moe_into(moe.args, np_, down, rows, self.hidden, self.act)
            else:
                self._linear(np_, gu_args, gu, rows)
                lora(loras[2], np_, hidden, gu, 2 * inter)
                k.act_mul_into(gu, act, rows, self.inter, self.act)
                self._linear(act, down_args, down, rows)
                lora(loras[3], act, inter, down, hidden)
            pending = down
        return self._final_norm(rows, pending)

    def _final_norm(self, rows: int, pending: int) -> torch.Tensor:
        out = self.out[:rows]
        xp = self.x.data_ptr()
        self.k.add_rms_norm_into(xp, pending, self.final_norm, xp, out.data_ptr(), rows,
                                 self.hidden, self.eps)  # fmt: skip
        return out

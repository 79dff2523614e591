"""The Llama family: one decoder shared by Llama, Qwen 2/3 and Gemma 3, switched by a config.

Per layer::

    x ─┬─ norm ─ qkv_proj ─ (q/k norm) ─ rope ─ attend ─ o_proj ─ (post norm) ─┐
       └────────────────────────────────────────────────────────────────────(+)─ x'
    x'─┬─ norm ─ gate_up_proj ─ act(gate) * up ─ down_proj ─ (post norm) ─────┐
       └────────────────────────────────────────────────────────────────────(+)─ out

The "(...)" steps are switched on by :class:`DecoderConfig` flags (Qwen 3 and Gemma 3 add the
q/k norms; Gemma 3 adds the post norms, an embedding scale and per-layer sliding windows with
their own rope base). In a mixture of experts (Mixtral, Qwen MoE: ``DecoderConfig.moe``) a
sparse layer's gated MLP is a :class:`~infer.model.moe.SparseMoE` instead. The subclasses only
translate their ``config.json`` dialect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.model.layers import (
    CausalLM,
    GatedMLP,
    RMSNorm,
    WeightSource,
    embedding,
    plus_one,
)
from infer.model.moe import MoEConfig, SparseMoE, moe_weight_sources, parse_moe
from infer.model.ops import fused_ops
from infer.model.parallel import (
    COLUMN,
    ROW,
    ROW_BIAS,
    VOCAB,
    get_tensor_parallel,
)
from infer.model.rope import RopeConfig, apply_rope, rope_config_from_dict, rope_params, rope_tables

if TYPE_CHECKING:  # the attention backend is the runner's: models only call it
    from infer.model.attention import Attention


@dataclass(frozen=True)
class DecoderConfig:
    """Everything the shared decoder needs; one entry per layer in ``ropes``/``sliding_windows``."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    ropes: tuple[RopeConfig, ...]
    sliding_windows: tuple[int | None, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False  # Gemma: norms on the attention and MLP outputs too
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + weight)
    activation: str = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    embed_scale: float | None = None
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = False
    moe: MoEConfig | None = None  # Mixtral, Qwen MoE: experts in the layers it marks sparse
    # Every token attends to its whole input (an encoder: EmbeddingGemma); a sliding window
    # is then the keys at most that many positions away on either side.
    bidirectional: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if len(self.ropes) != self.num_layers or len(self.sliding_windows) != self.num_layers:
            raise ValueError("per-layer rope/sliding window settings must cover every layer")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ValueError("per-layer expert settings must cover every layer")

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` routes to experts (else it has the dense MLP)."""
        return self.moe is not None and self.moe.sparse_layers[layer_idx]


def require(config: dict[str, Any], key: str) -> Any:
    """``config[key]`` or a ``ValueError`` naming the missing field."""
    if config.get(key) is None:
        raise ValueError(f"config.json has no {key!r}")
    return config[key]


def common_fields(config: dict[str, Any], rms_norm_eps: float = 1e-6) -> dict[str, Any]:
    """The fields every Llama-like ``config.json`` spells the same way (``rms_norm_eps``: the
    family's default)."""
    hidden = require(config, "hidden_size")
    heads = require(config, "num_attention_heads")
    return dict(
        hidden_size=hidden,
        intermediate_size=require(config, "intermediate_size"),
        num_layers=require(config, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        vocab_size=require(config, "vocab_size"),
        max_position_embeddings=config.get("max_position_embeddings") or 2048,
        rms_norm_eps=config.get("rms_norm_eps", rms_norm_eps),
    )


def uniform_rope(
    config: dict[str, Any], fields: dict[str, Any], default_theta: float = 10_000.0
) -> tuple[RopeConfig, ...]:
    """The same rope for every layer (Llama, Qwen)."""
    params = rope_params(config, "full_attention", default_theta)
    rope = rope_config_from_dict(params, fields["head_dim"], fields["max_position_embeddings"])
    return (rope,) * fields["num_layers"]


WindowRule = Callable[[dict[str, Any], int], bool]  # (config.json, layer) -> does it slide


def every_layer(config: dict[str, Any], layer: int) -> bool:
    return True


def from_max_window_layers(config: dict[str, Any], layer: int) -> bool:
    """Qwen 2 / 3: the layers from ``max_window_layers`` on."""
    return layer >= config.get("max_window_layers", 28)


def layer_windows(
    config: dict[str, Any],
    num_layers: int,
    rule: WindowRule | None = every_layer,
    switch: bool | None = None,
    default_window: int | None = None,
) -> tuple[int | None, ...]:
    """Per-layer sliding window, as transformers reads each family's ``config.json``.

    ``layer_types`` says which layers slide where the config has it; else ``rule`` (None: the
    family never slides, as Llama ignores a ``sliding_window``). ``switch``: the default of
    Qwen's ``use_sliding_window`` when the config leaves it out (None: the family has no such
    switch; a window is used when given, as Mistral's). ``default_window``: the window of a
    config without a ``sliding_window`` key (Mistral's 4096; a null one is no window).
    """
    window = config.get("sliding_window", default_window)
    on = config.get("use_sliding_window", switch) if switch is not None else True
    if not window or not on or rule is None:
        return (None,) * num_layers
    types = config.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        return tuple(window if t == "sliding_attention" else None for t in types)
    return tuple(window if rule(config, i) else None for i in range(num_layers))


def uniform_decoder_config(
    config: dict[str, Any],
    windows: WindowRule | None = every_layer,
    window_switch: bool | None = None,
    default_window: int | None = None,
    rope_theta: float = 10_000.0,
    rms_norm_eps: float = 1e-6,
    **family: Any,
) -> DecoderConfig:
    """A :class:`DecoderConfig` for the families that use one rope for every layer (Llama,
    Mistral, Qwen): the common fields, rope, per-layer windows (``windows``, ``window_switch``
    and ``default_window``: see :func:`layer_windows`), activation and embedding tying from
    ``config.json``, plus the family's own switches in ``family``. ``rope_theta`` and
    ``rms_norm_eps``: the family's defaults for a config that leaves them out."""
    fields = common_fields(config, rms_norm_eps)
    return DecoderConfig(
        **fields,
        ropes=uniform_rope(config, fields, rope_theta),
        sliding_windows=layer_windows(
            config, fields["num_layers"], windows, window_switch, default_window
        ),
        activation=config.get("hidden_act", "silu"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        **family,
    )


class DecoderAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # Tensor parallelism: this rank's heads (column-parallel qkv, row-parallel o_proj).
        self.tp = tp = get_tensor_parallel()
        self.num_heads = tp.local(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.local(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_windows[layer_idx]
        self.bidirectional = cfg.bidirectional
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def _norm_in_place(self, qkv: torch.Tensor, attn: Attention) -> bool:
        """Run the q/k norms in place on ``qkv`` by the fused decode loop's C++ kernel (CPU
        bf16), so that the rope and KV store kernel takes the row next; False: not here."""
        ops = fused_ops(qkv)
        if self.q_norm is None or self.k_norm is None or ops is None or not ops.fuses_qk_norm:
            return False
        if self.q_norm.weight.dtype != qkv.dtype or not attn.can_store_rotated(qkv):
            return False
        ops.qk_norm_into(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                         self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)  # fmt: skip
        return True

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        t = x.shape[0]
        heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x)
        if not self.bidirectional and (
            self._norm_in_place(qkv, attn) or (self.q_norm is None and attn.can_store_rotated(qkv))
        ):
            # One kernel rotates q and k in place and stores k, v in the cache.
            q, k, v = attn.rotate_and_store(
                self.layer_idx, qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim
            )
            out = attn.attend(
                self.layer_idx,
                q,
                k,
                v,
                scale=self.scale,
                sliding_window=self.sliding_window,
                kv_stored=True,
            )
            return self.tp.all_reduce(self.o_proj(out.reshape(t, self.q_size)))
        qk = qkv[:, : self.q_size + self.kv_size].view(t, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = apply_rope(self.q_norm(qk[:, : self.num_heads]), cos, sin)
            k = apply_rope(self.k_norm(qk[:, self.num_heads :]), cos, sin)
        else:  # rotate q and k heads in one go
            q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        if self.bidirectional:  # (nothing cached: the whole input is in this step)
            out = attn.attend_bidirectional(q, k, v, scale=self.scale, window=self.sliding_window)
        else:
            out = attn.attend(
                self.layer_idx, q, k, v, scale=self.scale, sliding_window=self.sliding_window
            )
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.q_size)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.attn_norm = RMSNorm(cfg.hidden_size, eps)
        self.attn = DecoderAttention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps)
        self.mlp: GatedMLP | SparseMoE
        if cfg.moe is not None and cfg.is_sparse(layer_idx):
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.activation)
        else:
            self.mlp = GatedMLP(
                cfg.hidden_size, cfg.intermediate_size, cfg.activation, cfg.mlp_bias
            )
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps) if cfg.sandwich_norms else None
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, eps) if cfg.sandwich_norms else None

    def forward(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: Attention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, pending)`` -> the residual stream and this layer's output, not yet added to it
        (the next layer's norm adds it in the same pass; ``pending`` is None for layer 0)."""
        x, normed = self.attn_norm.add_forward(x, pending)
        h = self.attn(normed, cos, sin, attn)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x, normed = self.mlp_norm.add_forward(x, h)
        h = self.mlp(normed)
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x, h


@dataclass(frozen=True)
class PlainLayer:
    """One decoder layer in the plain pre-norm shape a fused step replays::

    x, normed = x + pending, attn_norm(x + pending)
    pending   = o_proj(attend(rope(q_norm/k_norm(qkv_proj(normed)))))
    x, normed = x + pending, mlp_norm(x + pending)
    pending   = mlp(normed)
    """

    attn_norm: RMSNorm
    qkv_proj: nn.Module
    q_norm: RMSNorm | None  # Qwen 3's per-head norms, on q and k before the rope
    k_norm: RMSNorm | None
    o_proj: nn.Module
    scale: float
    sliding_window: int | None
    mlp_norm: RMSNorm
    mlp: GatedMLP | SparseMoE


@dataclass(frozen=True)
class PlainDecoder:
    """:class:`DecoderLM` as the plain loop (``x = embed(ids)``, the layers, ``norm(x +
    pending)``): what a fused step (the CPU's ``runner/cpu/decode_fast.py``) reads instead of
    the modules' internals, so a change to the layer shows here, next to it."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    activation: str | None  # the fused act(gate) * up's name (None: no fused kernel for it)
    embed: torch.Tensor  # [vocab, hidden]
    rope_cos: torch.Tensor  # [max positions, head_dim], one table for every layer
    rope_sin: torch.Tensor
    final_norm: RMSNorm
    layers: tuple[PlainLayer, ...]


class DecoderLM(CausalLM):
    """The shared decoder; subclasses implement :meth:`parse_config` for their dialect."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = get_tensor_parallel()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, vocab_parallel=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, self.tp.vocab_rows(cfg.vocab_size), bias=False)
        )
        # Layers with equal rope settings share one cos/sin table (Gemma 3 has two kinds).
        self._ropes = sorted(set(cfg.ropes), key=cfg.ropes.index)
        self._layer_rope = [self._ropes.index(r) for r in cfg.ropes]
        self._embed_scale: torch.Tensor | None = None

    def init_buffers(self, device: torch.device | str, dtype: torch.dtype) -> None:
        for j, rope in enumerate(self._ropes):
            cos, sin = rope_tables(rope, self.cfg.max_position_embeddings, dtype, device)
            self.register_buffer(f"rope_cos_{j}", cos, persistent=False)
            self.register_buffer(f"rope_sin_{j}", sin, persistent=False)
        if self.cfg.embed_scale is not None:
            # Rounded to the model dtype first, as the reference implementation does.
            scale = torch.tensor(self.cfg.embed_scale, dtype=dtype, device=device)
            self.register_buffer("embed_scale", scale, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: Attention,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``embeds``: ``(rows, vectors)`` that take those rows' place after the embedding (an
        image's features in place of its placeholder tokens: model/llava.py)."""
        x = self.tp.embed(self.embed_tokens.weight, input_ids)
        if self.cfg.embed_scale is not None:
            x = x * self.embed_scale
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        trig = [
            (
                getattr(self, f"rope_cos_{j}")[positions].unsqueeze(1),
                getattr(self, f"rope_sin_{j}")[positions].unsqueeze(1),
            )
            for j in range(len(self._ropes))
        ]
        pending: torch.Tensor | None = None
        for layer, j in zip(self.layers, self._layer_rope, strict=True):
            cos, sin = trig[j]
            x, pending = layer(x, pending, cos, sin, attn)
        return self.norm.add_forward(x, pending)[1]

    def plain_decoder(self) -> PlainDecoder | None:
        """This model as the plain pre-norm loop, or None where its layers do more: sandwich
        norms, an embedding scale, per-layer rope tables (Gemma 3)."""
        cfg = self.cfg
        if cfg.sandwich_norms or cfg.embed_scale is not None or len(self._ropes) != 1:
            return None
        first_mlp = self.layers[0].mlp
        gated = first_mlp.experts[0] if isinstance(first_mlp, SparseMoE) else first_mlp
        return PlainDecoder(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            activation=gated.fused_act,
            embed=self.embed_tokens.weight,
            rope_cos=self.rope_cos_0,
            rope_sin=self.rope_sin_0,
            final_norm=self.norm,
            layers=tuple(
                PlainLayer(
                    attn_norm=layer.attn_norm,
                    qkv_proj=layer.attn.qkv_proj,
                    q_norm=layer.attn.q_norm,
                    k_norm=layer.attn.k_norm,
                    o_proj=layer.attn.o_proj,
                    scale=layer.attn.scale,
                    sliding_window=layer.attn.sliding_window,
                    mlp_norm=layer.mlp_norm,
                    mlp=layer.mlp,
                )
                for layer in self.layers
            ),
        )

    def vocab_projection_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def cuda_graph_safe(self) -> bool:
        # Which experts run (and on how many rows) is read back from the device each step.
        return self.cfg.moe is None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.project_to_vocab(hidden).float()
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def weight_sources(self) -> dict[str, WeightSource]:
        cfg = self.cfg
        norm_transform = plus_one if cfg.norm_plus_one else None

        def norm(names: tuple[str, ...]) -> WeightSource:
            return WeightSource(names, norm_transform)

        src: dict[str, WeightSource] = {
            "embed_tokens.weight": WeightSource(("model.embed_tokens.weight",), shard=VOCAB),
            "norm.weight": norm(("model.norm.weight",)),
        }
        if self.lm_head is not None:
            src["lm_head.weight"] = WeightSource(("lm_head.weight",), shard=VOCAB)
        # Llama calls the pre-MLP norm "post_attention_layernorm"; Gemma uses that name for the
        # norm on the attention output and "pre_feedforward_layernorm" before the MLP.
        mlp_norm = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
        for i in range(cfg.num_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            a = f"{hf}.self_attn"
            qkv = ("q_proj", "k_proj", "v_proj")
            src[f"{ours}.attn.qkv_proj.weight"] = WeightSource(
                tuple(f"{a}.{p}.weight" for p in qkv), shard=COLUMN
            )
            if cfg.qkv_bias:
                src[f"{ours}.attn.qkv_proj.bias"] = WeightSource(
                    tuple(f"{a}.{p}.bias" for p in qkv), shard=COLUMN
                )
            src[f"{ours}.attn.o_proj.weight"] = WeightSource((f"{a}.o_proj.weight",), shard=ROW)
            if cfg.o_bias:
                src[f"{ours}.attn.o_proj.bias"] = WeightSource(
                    (f"{a}.o_proj.bias",), shard=ROW_BIAS
                )
            if cfg.qk_norm:
                src[f"{ours}.attn.q_norm.weight"] = norm((f"{a}.q_norm.weight",))
                src[f"{ours}.attn.k_norm.weight"] = norm((f"{a}.k_norm.weight",))
            if cfg.moe is not None and cfg.is_sparse(i):
                src.update(moe_weight_sources(f"{ours}.mlp", hf, cfg.moe))
            else:
                src.update(self._dense_mlp_sources(ours, f"{hf}.mlp"))
            src[f"{ours}.attn_norm.weight"] = norm((f"{hf}.input_layernorm.weight",))
            src[f"{ours}.mlp_norm.weight"] = norm((f"{hf}.{mlp_norm}.weight",))
            if cfg.sandwich_norms:
                src[f"{ours}.post_attn_norm.weight"] = norm(
                    (f"{hf}.post_attention_layernorm.weight",)
                )
                src[f"{ours}.post_mlp_norm.weight"] = norm(
                    (f"{hf}.post_feedforward_layernorm.weight",)
                )
        return src

    def _dense_mlp_sources(self, ours: str, m: str) -> dict[str, WeightSource]:
        """A dense layer's gated MLP (``m``: its checkpoint prefix, ``model.layers.{i}.mlp``)."""
        src = {
            f"{ours}.mlp.gate_up_proj.weight": WeightSource(
                (f"{m}.gate_proj.weight", f"{m}.up_proj.weight"), shard=COLUMN
            ),
            f"{ours}.mlp.down_proj.weight": WeightSource((f"{m}.down_proj.weight",), shard=ROW),
        }
        if self.cfg.mlp_bias:
            src[f"{ours}.mlp.gate_up_proj.bias"] = WeightSource(
                (f"{m}.gate_proj.bias", f"{m}.up_proj.bias"), shard=COLUMN
            )
            src[f"{ours}.mlp.down_proj.bias"] = WeightSource(
                (f"{m}.down_proj.bias",), shard=ROW_BIAS
            )
        return src


class LlamaForCausalLM(DecoderLM):
    """Llama 1/2/3 (GQA, rope scaling "linear"/"llama3"/"yarn", optional biases, tied or not)."""

    architecture = "LlamaForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        bias = bool(config.get("attention_bias", False))
        return uniform_decoder_config(
            config, windows=None, qkv_bias=bias, o_bias=bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
        )  # fmt: skip


class MistralForCausalLM(DecoderLM):
    """Mistral: Llama without biases, every layer attending to the last ``sliding_window``."""

    architecture = "MistralForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        return uniform_decoder_config(config, default_window=4096)


class MixtralForCausalLM(DecoderLM):
    """Mixtral: Mistral whose every MLP is a mixture of experts (softmax over the experts, the
    top ``num_experts_per_tok`` of ``num_local_experts``, renormalised over those k)."""

    architecture = "MixtralForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        num_layers = require(config, "num_hidden_layers")
        moe = parse_moe(
            config,
            num_layers,
            experts_fields=("num_local_experts", "num_experts"),
            width_field="intermediate_size",
            float32_weights=True,
            norm_topk_prob=True,
            checkpoint_block="block_sparse_moe",
            checkpoint_projs=("w1", "w3", "w2"),
        )
        # (transformers' Mixtral defaults: rope_theta 1e6, rms_norm_eps 1e-5)
        return uniform_decoder_config(config, rope_theta=1e6, rms_norm_eps=1e-5, moe=moe)

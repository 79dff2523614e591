"""Nomic BERT (``NomicBertModel``: nomic-embed-text v1 / v1.5), an encoder with BERT's post-norm
layers but rotary positions and a gated MLP, and no biases::

    x = LayerNorm(word[ids] + token_type[0])                  (no position table)
    per layer:
        q, k, v = Wqkv(x);  q, k = rope(q), rope(k)           (rotate-half, base 1000)
        x = LayerNorm(x + out_proj(attention(q, k, v)))       (every token sees every token)
        x = LayerNorm(x + fc2(silu(fc12(x)) * fc11(x)))       (fc12 the gate, fc11 the up)

The tensors are named as Nomic's code published them (``emb_ln``,
``encoder.layers.N.attn.Wqkv``, ``mlp.fc11``, ``fc12``, ``fc2``, ``norm1``, ``norm2``), which
transformers' own ``NomicBertModel`` also writes; ``config.json`` in either's names (Nomic's
GPT-2 style ``n_embd``, ``n_layer``, ``rotary_emb_base``, ...; transformers' ``hidden_size``,
``rope_parameters``, ...). Pooling, truncation and serving are BERT's (:mod:`infer.model.bert`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.model.bert import BertModel, EncoderShape, check_heads
from infer.model.layers import CausalLM, WeightSource, activation
from infer.model.rope import RopeConfig, apply_rope, rope_tables

if TYPE_CHECKING:
    from infer.model.attention import Attention


@dataclass(frozen=True)
class NomicBertConfig(EncoderShape):
    rope: RopeConfig
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: str = "silu"
    bias: bool = False  # q/k/v, the attention output and the down projection (GTE's have)
    position_offset: int = 0  # (BERT's field: rotary positions start at 0)


def rotary_self_attention(
    layer: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attn: Attention,
    window: int | None = None,
) -> torch.Tensor:
    """``layer.attn_out`` of the bidirectional attention of ``x``'s fused q/k/v projection
    (``layer.qkv_proj``), q and k rotated: the attention half of a rotary encoder layer (Nomic
    BERT, GTE, ModernBERT; ``window``: a local layer's reach)."""
    t = x.shape[0]
    q, k, v = layer.qkv_proj(x).view(t, 3, layer.num_heads, layer.head_dim).unbind(1)
    out = attn.attend_bidirectional(
        apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, scale=layer.scale, window=window
    )
    return layer.attn_out(out.reshape(t, -1))


class NomicBertLayer(nn.Module):
    """One post-norm layer (the module doc; GTE's too, with biases); gate and up fused into one
    projection, gate first."""

    def __init__(self, cfg: NomicBertConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.inter = inter
        self.qkv_proj = nn.Linear(h, 3 * h, bias=cfg.bias)
        self.attn_out = nn.Linear(h, h, bias=cfg.bias)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.gate_up = nn.Linear(h, 2 * inter, bias=False)
        self.down = nn.Linear(inter, h, bias=cfg.bias)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = activation(cfg.activation)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        return self.mlp(self.attn_norm(x + rotary_self_attention(self, x, cos, sin, attn)))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP's half of the layer, with its residual and norm."""
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.out_norm(x + self.down(self.act(gate) * up))


class NomicBertModel(BertModel):
    """A Nomic BERT encoder: final hidden states ``[T, hidden]`` for pooling."""

    architecture = "NomicBertModel"
    checkpoint_aliases = (("", "nomic_bert."),)
    layer_class: type[NomicBertLayer] = NomicBertLayer

    def __init__(self, cfg: NomicBertConfig) -> None:  # type: ignore[override]
        CausalLM.__init__(self)
        self.cfg = cfg  # type: ignore[assignment]
        self.sep_token_id: int | None = None
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.token_type_embeddings = (
            nn.Embedding(cfg.type_vocab_size, h) if cfg.type_vocab_size else None
        )
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(  # type: ignore[assignment]
            self.layer_class(cfg, i) for i in range(cfg.num_layers)
        )

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> NomicBertConfig:  # type: ignore[override]
        nomic = "n_embd" in config  # (Nomic's own config names, GPT-2's)

        def field(ours: str, theirs: str, default: Any = None) -> Any:
            value = config.get(theirs if nomic else ours, default)
            if value is None:
                raise ValueError(f"config.json has no {theirs if nomic else ours}")
            return value

        hidden, heads = field("hidden_size", "n_embd"), field("num_attention_heads", "n_head")
        check_heads(hidden, heads, "n_embd/n_head" if nomic else "hidden_size/num_attention_heads")
        if nomic:
            unsupported = {
                "rotary_emb_fraction": (config.get("rotary_emb_fraction", 1.0), (1.0, 1)),
                "rotary_emb_interleaved": (config.get("rotary_emb_interleaved", False), (False,)),
                "rotary_scaling_factor": (config.get("rotary_scaling_factor"), (None,)),
                "prenorm": (config.get("prenorm", False), (False,)),
                "qkv_proj_bias": (config.get("qkv_proj_bias", False), (False,)),
                "mlp_fc1_bias": (config.get("mlp_fc1_bias", False), (False,)),
                "mlp_fc2_bias": (config.get("mlp_fc2_bias", False), (False,)),
                "activation_function": (config.get("activation_function", "swiglu"), ("swiglu",)),
                "rotary_emb_scale_base": (config.get("rotary_emb_scale_base"), (None,)),
                "parallel_block": (config.get("parallel_block", False), (False,)),
            }
            for key, (value, allowed) in unsupported.items():
                if value not in allowed:
                    raise ValueError(f"Nomic BERT with {key}={value!r} is not supported "
                                     f"(infer runs {key}={allowed[0]!r})")  # fmt: skip
            theta = float(config.get("rotary_emb_base", 1000.0))
            act = "silu"
        else:
            params = config.get("rope_parameters") or {}
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"Nomic BERT with rope_type {params['rope_type']!r} is not "
                                 "supported (infer runs the default rope)")  # fmt: skip
            theta = float(params.get("rope_theta", config.get("rope_theta", 1000.0)))
            act = config.get("hidden_act", "silu")
        head_dim = hidden // heads
        if config.get("head_dim") not in (None, head_dim):
            raise ValueError(f"head_dim {config['head_dim']} is not hidden size / heads "
                             f"({head_dim}): not supported")  # fmt: skip
        return NomicBertConfig(
            hidden_size=hidden,
            num_layers=field("num_hidden_layers", "n_layer"),
            num_heads=heads,
            vocab_size=config["vocab_size"],
            # (Nomic's n_positions is 8192, past the 2,048 it was trained for: llama.cpp
            # caps it there too)
            max_position_embeddings=min(
                field("max_position_embeddings", "n_positions", 2048),
                config.get("max_trained_positions") or 1 << 30,
            ),  # fmt: skip
            intermediate_size=field("intermediate_size", "n_inner"),
            rope=RopeConfig(theta=theta, head_dim=head_dim),
            type_vocab_size=config.get("type_vocab_size", 2) or 0,
            layer_norm_eps=field("layer_norm_eps", "layer_norm_epsilon", 1e-12),
            activation=act,
        )

    def init_buffers(self, device: torch.device | str, dtype: torch.dtype) -> None:
        cfg: NomicBertConfig = self.cfg  # type: ignore[assignment]
        cos, sin = rope_tables(cfg.rope, cfg.max_position_embeddings, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        x = self.embed_norm(self._add_token_types(self.word_embeddings(input_ids), input_ids,
                                                  positions))  # fmt: skip
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return x

    def weight_sources(self) -> dict[str, WeightSource]:
        def plain(name: str) -> WeightSource:
            return WeightSource((name,))

        src = {
            "word_embeddings.weight": plain("embeddings.word_embeddings.weight"),
            "embed_norm.weight": plain("emb_ln.weight"),
            "embed_norm.bias": plain("emb_ln.bias"),
        } | self._type_source()
        for i in range(self.cfg.num_layers):
            ours, theirs = f"layers.{i}.", f"encoder.layers.{i}."
            for mine, parts in (("qkv_proj", ("attn.Wqkv",)), ("attn_out", ("attn.out_proj",)),
                                ("gate_up", ("mlp.fc12", "mlp.fc11")), ("down", ("mlp.fc2",)),
                                ("attn_norm", ("norm1",)), ("out_norm", ("norm2",))):  # fmt: skip
                src[f"{ours}{mine}.weight"] = WeightSource(
                    tuple(f"{theirs}{p}.weight" for p in parts)
                )
            src[f"{ours}attn_norm.bias"] = plain(f"{theirs}norm1.bias")
            src[f"{ours}out_norm.bias"] = plain(f"{theirs}norm2.bias")
        return src

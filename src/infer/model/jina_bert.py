"""Jina BERT v2 (jina-embeddings-v2-base-en, -small-en: Jina's ``JinaBertModel``, published as
``JinaBertForMaskedLM`` with model_type ``bert`` and ``position_embedding_type: alibi``), an
encoder of 8,192 positions with BERT's post-norm layers, no position table, ALiBi, and a GELU
gated MLP::

    x = LayerNorm(word[ids] + token_type[0])
    per layer:
        x = LayerNorm(x + dense(attention(q, k, v)))   head h's score of key j for query i
                                                        gains -slope_h * |i - j|
        x = LayerNorm(x + wo(gelu(a) * b)),  a, b = gated_layers(x)     (a: the first half)

The slopes are ALiBi's geometric series: for n heads a power of two, ``2 ** (-8 (h + 1) / n)``;
otherwise those of the power of two below n, then every other slope of the one above. The bias
of every distance is made once (``[heads, 2 * positions - 1]``) and added inside the attention
(:meth:`AttentionContext.attend_bidirectional`'s ``distance_bias``).

Tensors as Jina's code names them (``bert.`` prefixed too)::

    embeddings.word_embeddings, .token_type_embeddings, .LayerNorm
    encoder.layer.N.attention.self.query / key / value, attention.output.dense / .LayerNorm
    encoder.layer.N.mlp.gated_layers (no bias), mlp.wo, mlp.layernorm

Jina's code model (jina-embeddings-v2-base-code, its code ``jina-bert-v2-qk-post-norm``, which
``auto_map`` names) normalizes q and k, adds the layer's input twice, and keeps its MLP's up half
first::

    q, k = LayerNorm_q(query(x)), LayerNorm_k(key(x))
    a = LayerNorm(x + dense(attention(q, k, v)));  x = layer_norm_1(x + a)
    x = layer_norm_2(x + down_layer(u * gelu(g))),  u, g = up_gated_layer(x)   (u: the first half)

Pooling and serving are BERT's (:mod:`infer.model.bert`). Jina's rerankers are not served.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.model.bert import (
    EncoderShape,
    check_heads,
    embedding_sources,
    plain,
    post_norm_layer_sources,
)
from infer.model.layers import WeightSource
from infer.model.nomic_bert import NomicBertLayer, NomicBertModel

if TYPE_CHECKING:
    from infer.model.attention import Attention


@dataclass(frozen=True)
class JinaBertConfig(EncoderShape):
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"
    bias: bool = True  # (q/k/v, the attention output and wo; gated_layers has none)
    position_offset: int = 0
    qk_post_norm: bool = False  # the code model's layers (the module doc)


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's slope of each head (the module doc)."""

    def series(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    below = 2 ** math.floor(math.log2(num_heads))
    if below == num_heads:
        return series(num_heads)
    return series(below) + alibi_slopes(2 * below)[0::2][: num_heads - below]


class JinaBertLayer(NomicBertLayer):
    """One post-norm layer (the module doc): Nomic BERT's with ALiBi in place of rotations;
    the code model's with its q / k norms and second residual."""

    def __init__(self, cfg: JinaBertConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)  # type: ignore[arg-type]
        h = cfg.hidden_size
        self.qk_norms = (
            nn.ModuleList(nn.LayerNorm(h, eps=cfg.layer_norm_eps) for _ in range(2))
            if cfg.qk_post_norm else None
        )  # fmt: skip
        self.norm_1 = nn.LayerNorm(h, eps=cfg.layer_norm_eps) if cfg.qk_post_norm else None

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, alibi: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        if self.qk_norms is not None:  # (over the whole width, before the heads split)
            q, k = self.qk_norms[0](q), self.qk_norms[1](k)
        q, k, v = (z.reshape(t, self.num_heads, self.head_dim) for z in (q, k, v))
        out = attn.attend_bidirectional(q, k, v, scale=self.scale, distance_bias=alibi)
        y = self.attn_norm(x + self.attn_out(out.reshape(t, -1)))
        return self.mlp(y if self.norm_1 is None else self.norm_1(x + y))


class JinaBertModel(NomicBertModel):
    """A Jina BERT v2 encoder: final hidden states ``[T, hidden]`` for pooling."""

    architecture = "JinaBertModel"
    checkpoint_aliases = (("", "bert."),)
    layer_class = JinaBertLayer

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> JinaBertConfig:  # type: ignore[override]
        kind = config.get("position_embedding_type", "alibi")
        if kind != "alibi":
            raise ValueError(f"Jina BERT with position_embedding_type {kind!r} is not "
                             "supported (alibi)")  # fmt: skip
        mlp = config.get("feed_forward_type", "geglu")
        if mlp != "geglu":
            raise ValueError(f"Jina BERT with feed_forward_type {mlp!r} is not supported "
                             "(geglu)")  # fmt: skip
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        check_heads(hidden, heads)
        return JinaBertConfig(
            hidden_size=hidden,
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            intermediate_size=config["intermediate_size"],
            type_vocab_size=config.get("type_vocab_size", 2) or 0,
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            activation="gelu",  # (Jina's gated MLP: exact GELU, whatever hidden_act says)
            # (its own code, as auto_map names it; infer's key in a GGUF file's folder)
            qk_post_norm=bool(config.get("qk_post_norm"))
            or "qk-post-norm" in json.dumps(config.get("auto_map") or {}),
        )

    def make_classifier(self, num_labels: int) -> Any:
        raise ValueError("a Jina BERT sequence classifier (jina-reranker) is not supported; its "
                         "embedding models are")  # fmt: skip

    def init_buffers(self, device: torch.device | str, dtype: torch.dtype) -> None:
        reach = self.cfg.max_position_embeddings - 1
        slopes = torch.tensor(alibi_slopes(self.cfg.num_heads), dtype=torch.float32)
        apart = torch.arange(-reach, reach + 1, dtype=torch.float32).abs()
        # (float32 whatever the model's dtype: the kernel adds it to float32 scores)
        self.register_buffer("alibi", (-slopes[:, None] * apart).to(device), persistent=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        x = self.embed_norm(self._add_token_types(x, input_ids, positions))
        for layer in self.layers:
            x = layer(x, self.alibi, attn)
        return x

    def weight_sources(self) -> dict[str, WeightSource]:
        cfg: JinaBertConfig = self.cfg  # type: ignore[assignment]
        attention = "attention.self."
        parts = {"attn_out": "attention.output.dense", "attn_norm": "attention.output.LayerNorm"}
        if cfg.qk_post_norm:
            parts |= {"qk_norms.0": f"{attention}layer_norm_q", "qk_norms.1":
                      f"{attention}layer_norm_k", "norm_1": "layer_norm_1",
                      "down": "mlp.down_layer", "out_norm": "layer_norm_2"}  # fmt: skip
        else:
            parts |= {"down": "mlp.wo", "out_norm": "mlp.layernorm"}
        src = embedding_sources(positions=False) | self._type_source() | post_norm_layer_sources(
            cfg.num_layers, "encoder.layer.{}.",
            (f"{attention}query", f"{attention}key", f"{attention}value"), parts,
        )  # fmt: skip
        inter = cfg.intermediate_size
        for i in range(cfg.num_layers):  # (the gated MLP's one projection has no bias)
            mlp = f"encoder.layer.{i}.mlp."
            src[f"layers.{i}.gate_up.weight"] = (
                # (the code model's holds the up half first; ours takes the gate's first)
                WeightSource((f"{mlp}up_gated_layer.weight",),
                             rows=tuple(range(inter, 2 * inter)) + tuple(range(inter)))
                if cfg.qk_post_norm else plain(f"{mlp}gated_layers.weight")
            )  # fmt: skip
        return src

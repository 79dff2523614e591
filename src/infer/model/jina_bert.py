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

Pooling and serving are BERT's (:mod:`infer.model.bert`). Jina's code models (q/k norms,
``up_gated_layer``) and rerankers are not served.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from infer.model.bert import EncoderShape, embedding_sources, plain, post_norm_layer_sources
from infer.model.layers import WeightSource
from infer.model.nomic_bert import NomicBertLayer, NomicBertModel

if TYPE_CHECKING:
    from infer.model.attention import Attention


@dataclass(frozen=True)
class JinaBertConfig(EncoderShape):
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_position_embeddings: int
    intermediate_size: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"
    bias: bool = True  # (q/k/v, the attention output and wo; gated_layers has none)
    position_offset: int = 0


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's slope of each head (the module doc)."""

    def series(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    below = 2 ** math.floor(math.log2(num_heads))
    if below == num_heads:
        return series(num_heads)
    return series(below) + alibi_slopes(2 * below)[0::2][: num_heads - below]


class JinaBertLayer(NomicBertLayer):
    """One post-norm layer (the module doc): Nomic BERT's with ALiBi in place of rotations."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, alibi: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        out = attn.attend_bidirectional(q, k, v, scale=self.scale, distance_bias=alibi)
        return self.mlp(self.attn_norm(x + self.attn_out(out.reshape(t, -1))))


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
        if hidden % heads:
            raise ValueError(f"hidden_size={hidden} is not a multiple of "
                             f"num_attention_heads={heads}")  # fmt: skip
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
        attention = "attention.self."
        src = embedding_sources(positions=False) | self._type_source() | post_norm_layer_sources(
            self.cfg.num_layers, "encoder.layer.{}.",
            (f"{attention}query", f"{attention}key", f"{attention}value"),
            {"attn_out": "attention.output.dense", "attn_norm": "attention.output.LayerNorm",
             "down": "mlp.wo", "out_norm": "mlp.layernorm"},
        )  # fmt: skip
        for i in range(self.cfg.num_layers):  # (the gated MLP's one projection has no bias)
            src[f"layers.{i}.gate_up.weight"] = plain(f"encoder.layer.{i}.mlp.gated_layers.weight")
        return src

"""ModernBERT (``ModernBertModel``: modernbert-embed, gte-modernbert), an encoder with pre-norm
layers, rotary positions, a GELU-gated MLP, no biases, and local attention in most layers::

    x = LayerNorm(tok[ids])                                   (no position table, no types)
    per layer i:
        h = LayerNorm(x)                                      (layer 0: x itself)
        q, k, v = Wqkv(h);  q, k = rope_i(q), rope_i(k)       (global layers: base 160k;
        x = x + Wo(attention_i(q, k, v))                       local ones: 10k, and each token
        x = x + Wo'(gelu(a) * b),  a, b = Wi(LayerNorm(x))     sees those at most 64 away)
    x = LayerNorm(x)

Which layers are global: ``layer_types`` (transformers' config) or every
``global_attn_every_n_layers``-th (the published one); the local reach is
``local_attention // 2`` positions on either side. LayerNorms without a bias unless
``norm_bias``. Pooling and serving are BERT's (:mod:`infer.model.bert`). A
``ModernBertForSequenceClassification`` (a cross-encoder: gte-reranker-modernbert) pools as its
``classifier_pooling`` says (the first token, or the mean of every token), then
``classifier(LayerNorm(act(dense(pooled))))`` (:class:`ModernBertClassifierHead`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.model.bert import BertModel, EncoderShape, check_heads
from infer.model.layers import CausalLM, WeightSource, activation
from infer.model.nomic_bert import rotary_self_attention
from infer.model.rope import RopeConfig, rope_tables

if TYPE_CHECKING:
    from infer.model.attention import Attention


@dataclass(frozen=True)
class ModernBertConfig(EncoderShape):
    global_rope: RopeConfig
    local_rope: RopeConfig
    local_layers: tuple[bool, ...]  # per layer: local attention (else global)
    local_reach: int  # a local layer's token sees keys at most this far away
    norm_eps: float = 1e-5
    norm_bias: bool = False
    activation: str = "gelu"
    type_vocab_size: int = 1  # (none: BERT's field, so no token types are made)
    position_offset: int = 0
    # a sequence classifier's head: what it pools (CLS or MEAN), its activation and dense bias
    classifier_pooling: str = "CLS"
    classifier_activation: str = "gelu"
    classifier_bias: bool = False


class ModernBertClassifierHead(nn.Module):
    """A ModernBERT sequence classifier's head over the pooled state:
    ``classifier(LayerNorm(act(dense(h))))``, float32 logits ``[N, num_labels]``. Plain
    parameters, not ``nn.Linear``s, so packing and quantization pass it by."""

    def __init__(self, cfg: ModernBertConfig, num_labels: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.dense_weight = nn.Parameter(torch.empty(h, h))
        self.dense_bias = nn.Parameter(torch.empty(h)) if cfg.classifier_bias else None
        self.act = activation(cfg.classifier_activation)
        self.norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.weight = nn.Parameter(torch.empty(num_labels, h))
        self.bias = nn.Parameter(torch.empty(num_labels))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        pooled = self.norm(self.act(F.linear(hidden, self.dense_weight, self.dense_bias)))
        return F.linear(pooled, self.weight, self.bias).float()


class ModernBertLayer(nn.Module):
    """One pre-norm layer (the module doc)."""

    def __init__(self, cfg: ModernBertConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.local_reach if cfg.local_layers[layer_idx] else None
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.inter = inter
        self.attn_norm = (
            None if layer_idx == 0 else nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        )
        self.qkv_proj = nn.Linear(h, 3 * h, bias=False)
        self.attn_out = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.wi = nn.Linear(h, 2 * inter, bias=False)
        self.down = nn.Linear(inter, h, bias=False)
        self.act = activation(cfg.activation)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        h = x if self.attn_norm is None else self.attn_norm(x)
        x = x + rotary_self_attention(self, h, cos, sin, attn, self.window)
        a, b = self.wi(self.mlp_norm(x)).split(self.inter, dim=-1)
        return x + self.down(self.act(a) * b)


class ModernBertModel(BertModel):
    """A ModernBERT encoder: final hidden states ``[T, hidden]`` for pooling."""

    architecture = "ModernBertModel"
    checkpoint_aliases = (("", "model."),)

    def __init__(self, cfg: ModernBertConfig) -> None:  # type: ignore[override]
        CausalLM.__init__(self)
        self.cfg = cfg  # type: ignore[assignment]
        self.sep_token_id: int | None = None
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.layers = nn.ModuleList(  # type: ignore[assignment]
            ModernBertLayer(cfg, i) for i in range(cfg.num_layers)
        )
        self.final_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> ModernBertConfig:  # type: ignore[override]
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        check_heads(hidden, heads)
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                raise ValueError(f"ModernBERT with {key}=true is not supported")
        layers = config["num_hidden_layers"]
        types = config.get("layer_types")
        if types is None:
            every = config.get("global_attn_every_n_layers", 3)
            types = ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
        if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types {types!r}: one of full_attention / "
                             f"sliding_attention per layer ({layers})")  # fmt: skip
        if int(config.get("local_attention", 128)) < 2:
            raise ValueError(f"local_attention {config['local_attention']}: a local layer must "
                             "see at least its neighbours (2 or more)")  # fmt: skip
        params = config.get("rope_parameters") or {}
        head_dim = hidden // heads
        pooling = config.get("classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"ModernBERT with classifier_pooling={pooling!r} is not supported "
                             "(cls or mean)")  # fmt: skip

        def rope(kind: str, old_key: str, default: float) -> RopeConfig:
            own = params.get(kind) or {}
            if own.get("rope_type", "default") != "default" or config.get("rope_scaling"):
                raise ValueError("ModernBERT with a rope scaling is not supported")
            theta = own.get("rope_theta", config.get(old_key, default))
            return RopeConfig(theta=float(theta), head_dim=head_dim)

        return ModernBertConfig(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            intermediate_size=config["intermediate_size"],
            global_rope=rope("full_attention", "global_rope_theta", 160_000.0),
            local_rope=rope("sliding_attention", "local_rope_theta", 10_000.0),
            local_layers=tuple(t == "sliding_attention" for t in types),
            local_reach=int(config.get("local_attention", 128)) // 2,
            norm_eps=config.get("norm_eps", 1e-5),
            norm_bias=bool(config.get("norm_bias", False)),
            activation=config.get("hidden_activation", "gelu"),
            classifier_pooling=pooling.upper(),
            classifier_activation=config.get("classifier_activation", "gelu"),
            classifier_bias=bool(config.get("classifier_bias", False)),
        )

    def init_buffers(self, device: torch.device | str, dtype: torch.dtype) -> None:
        cfg: ModernBertConfig = self.cfg  # type: ignore[assignment]
        for name, rope in (("global", cfg.global_rope), ("local", cfg.local_rope)):
            cos, sin = rope_tables(rope, cfg.max_position_embeddings, dtype, device)
            self.register_buffer(f"{name}_cos", cos, persistent=False)
            self.register_buffer(f"{name}_sin", sin, persistent=False)

    @property
    def classifier_pooling(self) -> str:  # type: ignore[override]
        return self.cfg.classifier_pooling  # type: ignore[attr-defined]

    def make_classifier(self, num_labels: int) -> ModernBertClassifierHead:  # type: ignore[override]
        return ModernBertClassifierHead(self.cfg, num_labels)  # type: ignore[arg-type]

    def classifier_sources(self, ours: str = "classifier.") -> dict[str, WeightSource]:
        cfg: ModernBertConfig = self.cfg  # type: ignore[assignment]
        src = {f"{ours}dense_weight": WeightSource(("head.dense.weight",)),
               f"{ours}weight": WeightSource(("classifier.weight",)),
               f"{ours}bias": WeightSource(("classifier.bias",))}  # fmt: skip
        if cfg.classifier_bias:
            src[f"{ours}dense_bias"] = WeightSource(("head.dense.bias",))
        for suffix in ("weight", "bias") if cfg.norm_bias else ("weight",):
            src[f"{ours}norm.{suffix}"] = WeightSource((f"head.norm.{suffix}",))
        return src

    # A token classifier's head is its sequence classifier's, over every token's state.
    def make_token_classifier(self, num_labels: int) -> ModernBertClassifierHead:
        return self.make_classifier(num_labels)

    def token_classifier_sources(self) -> dict[str, WeightSource]:
        return self.classifier_sources("token_classifier.")

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        x = self.embed_norm(self.word_embeddings(input_ids))
        tables = {
            local: (getattr(self, f"{name}_cos")[positions].unsqueeze(1),
                    getattr(self, f"{name}_sin")[positions].unsqueeze(1))
            for local, name in ((False, "global"), (True, "local"))
        }  # fmt: skip
        for layer in self.layers:
            x = layer(x, *tables[layer.window is not None], attn)
        return self.final_norm(x)

    def weight_sources(self) -> dict[str, WeightSource]:
        cfg: ModernBertConfig = self.cfg  # type: ignore[assignment]
        suffixes = ("weight", "bias") if cfg.norm_bias else ("weight",)

        def plain(name: str) -> WeightSource:
            return WeightSource((name,))

        src = {"word_embeddings.weight": plain("embeddings.tok_embeddings.weight")}
        for norm, theirs in (("embed_norm", "embeddings.norm"), ("final_norm", "final_norm")):
            for suffix in suffixes:
                src[f"{norm}.{suffix}"] = plain(f"{theirs}.{suffix}")
        for i in range(cfg.num_layers):
            ours, theirs = f"layers.{i}.", f"layers.{i}."
            names = {"qkv_proj": "attn.Wqkv", "attn_out": "attn.Wo", "wi": "mlp.Wi",
                     "down": "mlp.Wo"}  # fmt: skip
            for mine, name in names.items():
                src[f"{ours}{mine}.weight"] = plain(f"{theirs}{name}.weight")
            for norm in ("attn_norm", "mlp_norm") if i else ("mlp_norm",):
                for suffix in suffixes:
                    src[f"{ours}{norm}.{suffix}"] = plain(f"{theirs}{norm}.{suffix}")
        return src

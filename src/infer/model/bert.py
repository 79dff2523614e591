"""BERT-family encoders (``BertModel``, ``RobertaModel``, ``XLMRobertaModel``): the embedding
models most retrieval setups run (BGE, E5, all-MiniLM, multilingual-E5, BGE-M3).

Unlike the decoders, every token attends to every token of its input (no causal mask) and
nothing is generated: a prompt runs whole in one step and its final hidden states are pooled
(CLS or mean, as its sentence-transformers files say). Absolute learned positions (RoBERTa's
start after its padding id), a token-type embedding (type 0: one text per input), and
post-norm layers::

    x = LayerNorm(word[ids] + position[pos] + token_type[0])
    per layer:
        x = LayerNorm(x + dense(attention(q, k, v of x)))        q, k, v with biases
        x = LayerNorm(x + output(act(intermediate(x))))          act: GELU (erf)

Checkpoint names as ``BertModel.save_pretrained`` writes them (``embeddings.*``,
``encoder.layer.N.*``); a task model's (``bert.`` / ``roberta.`` prefixed) load too.

A ``*ForSequenceClassification`` checkpoint (a cross-encoder reranker: BGE-reranker,
ms-marco-MiniLM) adds :class:`EncoderClassifierHead` over the first token's state, and a BERT
pair's second text takes token type 1 (every token after the input's first ``[SEP]``, as the
tokenizer's pair encoding marks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.model.layers import CausalLM, WeightSource, activation

if TYPE_CHECKING:  # the attention backend is the runner's: models only call it
    from infer.model.attention import Attention


@dataclass(frozen=True)
class EncoderShape:
    """What every encoder config holds: its sizes, and heads that each have their own k and v,
    all as wide as ``hidden_size / num_heads``."""

    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_position_embeddings: int
    intermediate_size: int

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def check_heads(hidden: int, heads: int, names: str = "hidden_size/num_attention_heads") -> None:
    """ValueError unless ``heads`` heads split ``hidden`` evenly (``names``: the config's keys
    for the two, for the message)."""
    if hidden % heads:
        hidden_key, heads_key = names.split("/")
        raise ValueError(f"{hidden_key}={hidden} is not a multiple of {heads_key}={heads}")


@dataclass(frozen=True)
class BertConfig(EncoderShape):
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"
    # RoBERTa: positions count from padding_idx + 1 (its position table's first rows unused)
    position_offset: int = 0


class BertLayer(nn.Module):
    """One post-norm encoder layer (the module doc); q, k and v fused into one projection."""

    def __init__(self, cfg: BertConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h = cfg.hidden_size
        self.qkv_proj = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(h, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = activation(cfg.activation)

    def forward(
        self, x: torch.Tensor, attn: Attention, distance_bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        out = attn.attend_bidirectional(q, k, v, scale=self.scale, distance_bias=distance_bias)
        x = self.attn_norm(x + self.attn_out(out.reshape(t, -1)))
        return self.out_norm(x + self.output(self.act(self.intermediate(x))))


class EncoderClassifierHead(nn.Module):
    """A BERT / RoBERTa sequence classifier's head over the first token's final state:
    ``out(act(dense(h)))``, act tanh (BERT's pooler then its ``classifier``; RoBERTa's
    ``classifier.dense`` then ``classifier.out_proj``) or ReLU (DistilBERT's
    ``pre_classifier`` then ``classifier``), float32 logits ``[N, num_labels]``. Plain
    parameters, not ``nn.Linear``s, so packing and quantization pass it by."""

    def __init__(self, hidden_size: int, num_labels: int, act: str = "tanh") -> None:
        super().__init__()
        self.dense_weight = nn.Parameter(torch.empty(hidden_size, hidden_size))
        self.dense_bias = nn.Parameter(torch.empty(hidden_size))
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_labels))
        self.act = torch.tanh if act == "tanh" else activation(act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        pooled = self.act(F.linear(hidden, self.dense_weight, self.dense_bias))
        return F.linear(pooled, self.weight, self.bias).float()


class TokenClassifierHead(nn.Module):
    """A token classifier's head (``*ForTokenClassification``'s ``classifier``): one linear
    layer over every token's final state, float32 logits ``[T, num_labels]``. Plain
    parameters, as :class:`EncoderClassifierHead`'s."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_labels))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight, self.bias).float()


def plain(name: str) -> WeightSource:
    """The one checkpoint tensor ``name``."""
    return WeightSource((name,))


def embedding_sources(norm: str = "embeddings.LayerNorm", positions: bool = True
                      ) -> dict[str, WeightSource]:  # fmt: skip
    """An encoder's word table, position table (``positions``) and embedding norm (``norm``)
    as BERT names them."""
    src = {"word_embeddings.weight": plain("embeddings.word_embeddings.weight"),
           "embed_norm.weight": plain(f"{norm}.weight"),
           "embed_norm.bias": plain(f"{norm}.bias")}  # fmt: skip
    if positions:
        src["position_embeddings.weight"] = plain("embeddings.position_embeddings.weight")
    return src


def post_norm_layer_sources(
    num_layers: int, layer: str, qkv: tuple[str, str, str], parts: dict[str, str]
) -> dict[str, WeightSource]:
    """Each :class:`BertLayer`'s weights and biases: its fused ``qkv_proj`` from the three
    tensors ``qkv`` and each of ``parts`` (ours -> theirs), under ``layer.format(i)``."""
    src = {}
    for i in range(num_layers):
        theirs, ours = layer.format(i), f"layers.{i}."
        for suffix in ("weight", "bias"):
            src[f"{ours}qkv_proj.{suffix}"] = WeightSource(
                tuple(f"{theirs}{p}.{suffix}" for p in qkv)
            )
            for mine, name in parts.items():
                src[f"{ours}{mine}.{suffix}"] = plain(f"{theirs}{name}.{suffix}")
    return src


class BertModel(CausalLM):
    """A BERT encoder: final hidden states ``[T, hidden]`` for pooling; no vocabulary
    projection (it never generates)."""

    architecture = "BertModel"
    is_encoder = True
    checkpoint_aliases = (("", "bert."),)

    # The classifier head's checkpoint tensors: (dense, out) weights; biases beside them.
    classifier_tensors = ("pooler.dense.weight", "classifier.weight")
    # What a sequence classifier's head reads: the first token's state (CLS) or the mean (MEAN)
    classifier_pooling = "CLS"
    # The head's activation between its dense and out projections
    classifier_activation = "tanh"

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # The tokenizer's [SEP] id (the engine sets it): a pair's second text is type 1.
        self.sep_token_id: int | None = None
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(
            cfg.max_position_embeddings + cfg.position_offset, h
        )
        # (none where the checkpoint has no types: type_vocab_size 0)
        self.token_type_embeddings = (
            nn.Embedding(cfg.type_vocab_size, h) if cfg.type_vocab_size else None
        )
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg, i) for i in range(cfg.num_layers))

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> BertConfig:
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        check_heads(hidden, heads)
        kind = config.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"position_embedding_type {kind!r}: only absolute positions are "
                             "supported")  # fmt: skip
        offset = cls.position_offset(config)
        table = config["max_position_embeddings"]
        return BertConfig(
            hidden_size=hidden,
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            vocab_size=config["vocab_size"],
            # (the positions a text may take: RoBERTa's table starts at its offset)
            max_position_embeddings=table - offset,
            intermediate_size=config["intermediate_size"],
            type_vocab_size=config.get("type_vocab_size", 2) or 0,
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            activation=config.get("hidden_act", "gelu"),
            position_offset=offset,
        )

    @staticmethod
    def position_offset(config: dict[str, Any]) -> int:
        """Where positions start in the position table (0 for BERT)."""
        return 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.cfg.position_offset
        )
        x = self.embed_norm(self._add_token_types(x, input_ids, positions))
        for layer in self.layers:
            x = layer(x, attn)
        return x

    def _add_token_types(
        self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``x`` plus each token's type embedding (none without a type table)."""
        if self.token_type_embeddings is None:
            return x
        types = self._token_types(input_ids, positions)
        # (type 0 throughout: its one row, broadcast, not a gather of T rows)
        table = self.token_type_embeddings
        return x + (table.weight[0] if types is None else table(types))

    def _token_types(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Each token's type: for a cross-encoder, 1 after the first ``[SEP]`` of its input (the
        second text of a pair), else 0; None (type 0 throughout) for an embedding model, whose
        inputs are single texts whatever they hold. Inputs run whole, so an input starts where
        its position is 0::

            ids    [CLS] a  b  [SEP] c  d  [SEP] | [CLS] e [SEP]
            types    0   0  0   0    1  1   1    |   0   0   0
        """
        if self.sep_token_id is None or self.cfg.type_vocab_size < 2 or self.classifier is None:
            return None
        is_sep = (input_ids == self.sep_token_id).long()
        before = torch.cumsum(is_sep, 0) - is_sep  # [SEP]s before each token, in the batch
        starts = torch.cumsum((positions == 0).long(), 0) - 1  # each token's input
        first = torch.nonzero(positions == 0).flatten()
        return (before - before[first][starts] > 0).long()

    def _type_source(self) -> dict[str, WeightSource]:
        """The token type table's source ({} without one)."""
        if self.token_type_embeddings is None:
            return {}
        return {"token_type_embeddings.weight": WeightSource(
            ("embeddings.token_type_embeddings.weight",))}  # fmt: skip

    def make_classifier(self, num_labels: int) -> EncoderClassifierHead:
        """The head of a ``*ForSequenceClassification`` checkpoint (the loader adds it)."""
        return EncoderClassifierHead(self.cfg.hidden_size, num_labels, self.classifier_activation)

    def classifier_sources(self) -> dict[str, WeightSource]:
        """Where the head's parameters come from (:attr:`classifier_tensors`)."""
        dense, out = self.classifier_tensors
        return {
            "classifier.dense_weight": WeightSource((dense,)),
            "classifier.dense_bias": WeightSource((dense.removesuffix("weight") + "bias",)),
            "classifier.weight": WeightSource((out,)),
            "classifier.bias": WeightSource((out.removesuffix("weight") + "bias",)),
        }

    def make_token_classifier(self, num_labels: int) -> nn.Module:
        """The head of a ``*ForTokenClassification`` checkpoint (the loader adds it)."""
        return TokenClassifierHead(self.cfg.hidden_size, num_labels)

    def token_classifier_sources(self) -> dict[str, WeightSource]:
        """Where the token head's parameters come from (transformers' ``classifier``)."""
        return {"token_classifier.weight": plain("classifier.weight"),
                "token_classifier.bias": plain("classifier.bias")}  # fmt: skip

    def vocab_projection_weight(self) -> None:  # type: ignore[override]
        """None: an encoder projects nothing onto its vocabulary."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.architecture} is an encoder: it has no logits to compute")

    def weight_sources(self) -> dict[str, WeightSource]:
        attention = "attention.self."
        return embedding_sources() | self._type_source() | post_norm_layer_sources(
            self.cfg.num_layers, "encoder.layer.{}.",
            (f"{attention}query", f"{attention}key", f"{attention}value"),
            {"attn_out": "attention.output.dense", "attn_norm": "attention.output.LayerNorm",
             "intermediate": "intermediate.dense", "output": "output.dense",
             "out_norm": "output.LayerNorm"},
        )  # fmt: skip


class HFColBERT(BertModel):
    """A ColBERT model as Stanford's ColBERT library saves it (colbertv2.0,
    answerai-colbert-small-v1: ``architectures: HF_ColBERT``): a BERT encoder whose
    ``linear.weight`` beside it projects every token (read as a Dense module,
    :func:`infer.model.pooling.load_pooler_config`; its query and document settings from
    ``artifact.metadata``)."""

    architecture = "HF_ColBERT"
    side_tensors = ("linear.weight",)


class RobertaModel(BertModel):
    """RoBERTa: BERT's layers, positions counted from ``pad_token_id + 1``."""

    architecture = "RobertaModel"
    checkpoint_aliases = (("", "roberta."),)
    classifier_tensors = ("classifier.dense.weight", "classifier.out_proj.weight")

    @staticmethod
    def position_offset(config: dict[str, Any]) -> int:
        return int(config.get("pad_token_id", 1)) + 1


class XLMRobertaModel(RobertaModel):
    """XLM-RoBERTa (multilingual-E5, BGE-M3): RoBERTa's layout."""

    architecture = "XLMRobertaModel"

"""MPNet (``MPNetModel``: all-mpnet-base-v2, multi-qa-mpnet, the sentence-transformers models
most retrieval tutorials start from): BERT's post-norm layers (:mod:`infer.model.bert`) with
RoBERTa's positions (learned, counted from 2: its padding id 1, plus one) and no token types,
plus a relative position bias shared by every layer: each head adds to its score of key j for
query i a learned value picked by the bucket of ``j - i``::

    distance |j - i|:  0 1 .. 7 | 8-11 | 12-15 | 16-22 | 23-31 | 32-45 | 46-63 | 64-90 | 91+
    bucket:            0 1 .. 7 |  8   |   9   |  10   |  11   |  12   |  13   |  14   | 15
    (a key after its query: 16 + that bucket; 32 buckets in all)

(exact up to 7 apart, then logarithmic up to 128, as T5's bidirectional buckets). The bias of
every distance an input can hold is gathered once a step (``[heads, 2 * positions - 1]``) and
added inside the attention (:meth:`AttentionContext.attend_bidirectional`'s ``distance_bias``).

Checkpoint names as ``MPNetModel.save_pretrained`` writes them::

    embeddings.word_embeddings, .position_embeddings, .LayerNorm
    encoder.relative_attention_bias                    [32, heads]
    encoder.layer.N.attention.attn.q / .k / .v / .o, attention.LayerNorm
    encoder.layer.N.intermediate.dense, output.dense, output.LayerNorm

A ``MPNetForSequenceClassification`` (``mpnet.`` prefixed) takes RoBERTa's head
(``classifier.dense``, then ``classifier.out_proj``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.model.bert import (
    BertConfig,
    BertModel,
    embedding_sources,
    plain,
    post_norm_layer_sources,
)
from infer.model.layers import WeightSource

if TYPE_CHECKING:
    from infer.model.attention import Attention

# transformers' MPNet always buckets by these (whatever relative_attention_num_buckets says).
NUM_BUCKETS, MAX_DISTANCE = 32, 128


def relative_position_buckets(reach: int) -> torch.Tensor:
    """The bucket of every ``j - i`` from ``-reach`` to ``reach`` (the module doc's table),
    int64 ``[2 * reach + 1]``."""
    apart = torch.arange(-reach, reach + 1)
    half = NUM_BUCKETS // 2
    exact = half // 2
    after = (apart > 0).long() * half  # keys after the query: the upper half
    n = apart.abs()
    # (float32 logs, as transformers takes them: the same bucket at every boundary)
    far = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(MAX_DISTANCE / exact)
                   * (half - exact)).long()  # fmt: skip
    return after + torch.where(n < exact, n, far.clamp(max=half - 1))


class MPNetModel(BertModel):
    """An MPNet encoder: final hidden states ``[T, hidden]`` for pooling."""

    architecture = "MPNetModel"
    checkpoint_aliases = (("", "mpnet."),)
    classifier_tensors = ("classifier.dense.weight", "classifier.out_proj.weight")

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__(cfg)
        self.relative_attention_bias = nn.Embedding(NUM_BUCKETS, cfg.num_heads)

    def init_buffers(self, device: torch.device | str, dtype: torch.dtype) -> None:
        reach = self.cfg.max_position_embeddings - 1  # (every distance an input can hold)
        buckets = relative_position_buckets(reach).to(device)
        self.register_buffer("buckets", buckets, persistent=False)

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> BertConfig:
        buckets = config.get("relative_attention_num_buckets", NUM_BUCKETS)
        if buckets != NUM_BUCKETS:
            raise ValueError(f"MPNet with relative_attention_num_buckets={buckets} is not "
                             f"supported (transformers buckets by {NUM_BUCKETS})")  # fmt: skip
        return dataclasses.replace(super().parse_config(config), type_vocab_size=0)

    @staticmethod
    def position_offset(config: dict[str, Any]) -> int:
        return 2  # (transformers' MPNet pads with id 1 whatever the config says)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.cfg.position_offset
        )
        x = self.embed_norm(x)
        bias = self.relative_attention_bias(self.buckets).t()  # [heads, 2 * reach + 1]
        for layer in self.layers:
            x = layer(x, attn, bias)
        return x

    def weight_sources(self) -> dict[str, WeightSource]:
        bias = {"relative_attention_bias.weight": plain("encoder.relative_attention_bias.weight")}
        return embedding_sources() | bias | post_norm_layer_sources(
            self.cfg.num_layers, "encoder.layer.{}.",
            ("attention.attn.q", "attention.attn.k", "attention.attn.v"),
            {"attn_out": "attention.attn.o", "attn_norm": "attention.LayerNorm",
             "intermediate": "intermediate.dense", "output": "output.dense",
             "out_norm": "output.LayerNorm"},
        )  # fmt: skip

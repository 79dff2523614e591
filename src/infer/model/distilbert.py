"""DistilBERT (``DistilBertModel``: multi-qa-distilbert, msmarco-distilbert, the distilled
sentence-transformers models): BERT's post-norm layers (:mod:`infer.model.bert`) with learned
positions from 0 and no token types, in its own names::

    embeddings.word_embeddings, .position_embeddings, .LayerNorm       (eps 1e-12, always)
    transformer.layer.N.attention.q_lin / .k_lin / .v_lin / .out_lin, sa_layer_norm
    transformer.layer.N.ffn.lin1, ffn.lin2, output_layer_norm

and its config's (``dim``, ``n_layers``, ``n_heads``, ``hidden_dim``, ``activation``). A
``DistilBertForSequenceClassification`` (``distilbert.`` prefixed) takes its head over the
first token's state: ``classifier(relu(pre_classifier(h)))``.
"""

from __future__ import annotations

from typing import Any

from infer.model.bert import (
    BertConfig,
    BertModel,
    check_heads,
    embedding_sources,
    post_norm_layer_sources,
)
from infer.model.layers import WeightSource


class DistilBertModel(BertModel):
    """A DistilBERT encoder: final hidden states ``[T, hidden]`` for pooling."""

    architecture = "DistilBertModel"
    checkpoint_aliases = (("", "distilbert."),)
    classifier_tensors = ("pre_classifier.weight", "classifier.weight")
    classifier_activation = "relu"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> BertConfig:
        hidden, heads = config.get("dim", 768), config.get("n_heads", 12)
        check_heads(hidden, heads, "dim/n_heads")
        return BertConfig(
            hidden_size=hidden,
            num_layers=config.get("n_layers", 6),
            num_heads=heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 512),
            intermediate_size=config.get("hidden_dim", 4 * hidden),
            type_vocab_size=0,
            layer_norm_eps=1e-12,  # (transformers' DistilBERT: fixed, whatever the config)
            activation=config.get("activation", "gelu"),
        )

    def weight_sources(self) -> dict[str, WeightSource]:
        return embedding_sources() | post_norm_layer_sources(
            self.cfg.num_layers, "transformer.layer.{}.",
            ("attention.q_lin", "attention.k_lin", "attention.v_lin"),
            {"attn_out": "attention.out_lin", "attn_norm": "sa_layer_norm",
             "intermediate": "ffn.lin1", "output": "ffn.lin2", "out_norm": "output_layer_norm"},
        )  # fmt: skip

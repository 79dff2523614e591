"""GTE (``GteModel``; Alibaba's ``NewModel``: gte-multilingual-base), Nomic BERT's layers
(:mod:`infer.model.nomic_bert`: post-norm, rotary positions, a gated MLP) with biases on q, k,
v, the attention output and the down projection, GELU as the gate's activation, and BERT's
tensor names::

    embeddings.word_embeddings, .token_type_embeddings, .LayerNorm
    encoder.layer.N.attention.qkv_proj (fused, with bias), attention.o_proj, attn_ln
    encoder.layer.N.mlp.up_gate_proj (up rows first, then gate), mlp.down_proj, mlp_ln

``config.json`` as transformers writes it (``GteModel``, ``rope_parameters``) or as Alibaba
published it (``NewModel``, ``rope_theta``, ``rope_scaling``). Alibaba's fixed NTK scaling
(gte-base-en-v1.5, gte-large-en-v1.5: ``{"type": "ntk", "factor": f}``) rotates every position,
short inputs too, by::

    inv_freq[i] = (theta * f) ** (-2i / d) / f ** (2 / d)        (d: the head's width)

that is a rope of base ``theta * f`` whose positions are divided by ``f ** (2 / d)``: a
"linear" rope (:mod:`infer.model.rope`) of that base and factor. Its mixed form (``mixed_b``)
and the other options of Alibaba's code are refused naming them.
"""

from __future__ import annotations

from typing import Any

from infer.model.bert import check_heads, embedding_sources, plain
from infer.model.layers import WeightSource
from infer.model.nomic_bert import NomicBertConfig, NomicBertModel
from infer.model.rope import RopeConfig

# Alibaba's config options infer runs only at these values.
_FIXED = {"position_embedding_type": "rope", "layer_norm_type": "layer_norm",
          "logn_attention_scale": False, "logn_attention_clip1": False}  # fmt: skip


def ntk_rope(config: dict[str, Any], theta: float, head_dim: int) -> RopeConfig:
    """The rope of Alibaba's ``rope_scaling`` (the module doc): a plain one without it, a
    linear one for its fixed NTK scaling; ValueError names what is not run."""
    scaling = config.get("rope_scaling")
    if not scaling:
        return RopeConfig(theta=theta, head_dim=head_dim)
    kind = scaling.get("type") or scaling.get("rope_type")
    factor = scaling.get("factor")
    if (kind != "ntk" or scaling.get("mixed_b") is not None
            or not isinstance(factor, (int, float)) or factor < 1):  # fmt: skip
        raise ValueError(f"GTE with rope_scaling={scaling!r} is not supported (infer runs "
                         "Alibaba's fixed NTK scaling: type ntk, a factor of 1 or more, no "
                         "mixed_b)")  # fmt: skip
    factor = float(factor)
    return RopeConfig(theta=theta * factor, head_dim=head_dim, rope_type="linear",
                      factor=factor ** (2 / head_dim))  # fmt: skip


class GteModel(NomicBertModel):
    """A GTE encoder: final hidden states ``[T, hidden]`` for pooling."""

    architecture = "GteModel"
    checkpoint_aliases = (("", "new."), ("", "gte."))

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> NomicBertConfig:  # type: ignore[override]
        for key, value in _FIXED.items():
            if config.get(key, value) != value:
                raise ValueError(f"GTE with {key}={config[key]!r} is not supported (infer runs "
                                 f"{key}={value!r})")  # fmt: skip
        params = config.get("rope_parameters") or {}
        if params.get("rope_type", "default") not in ("default", "linear"):
            raise ValueError(f"GTE with rope_type {params['rope_type']!r} is not supported")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        check_heads(hidden, heads)
        if config.get("head_dim") not in (None, hidden // heads):
            raise ValueError(f"head_dim {config['head_dim']} is not hidden size / heads: "
                             "not supported")  # fmt: skip
        theta = float(params.get("rope_theta", config.get("rope_theta", 160_000.0)))
        head_dim = hidden // heads
        if params.get("rope_type") == "linear":  # (transformers' config of a scaled GTE)
            factor = params.get("factor")
            if not isinstance(factor, (int, float)) or factor <= 0:
                raise ValueError(f"GTE with a linear rope needs a positive factor, got {factor!r}")
            rope = RopeConfig(theta=theta, head_dim=head_dim, rope_type="linear",
                              factor=float(factor))  # fmt: skip
        else:
            rope = ntk_rope(config, theta, head_dim)
        return NomicBertConfig(
            hidden_size=hidden,
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            intermediate_size=config["intermediate_size"],
            rope=rope,
            type_vocab_size=config.get("type_vocab_size", 1) or 0,
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            activation=config.get("hidden_act", "gelu"),
            bias=True,
        )

    def weight_sources(self) -> dict[str, WeightSource]:
        src = embedding_sources(positions=False) | self._type_source()
        inter = self.cfg.intermediate_size  # type: ignore[attr-defined]
        # (the checkpoint's up_gate_proj holds up's rows first; ours takes gate's first)
        gate_first = tuple(range(inter, 2 * inter)) + tuple(range(inter))
        for i in range(self.cfg.num_layers):
            ours, theirs = f"layers.{i}.", f"encoder.layer.{i}."
            for mine, name in (("qkv_proj", "attention.qkv_proj"), ("attn_out", "attention.o_proj"),
                               ("down", "mlp.down_proj"), ("attn_norm", "attn_ln"),
                               ("out_norm", "mlp_ln")):  # fmt: skip
                for suffix in ("weight", "bias"):
                    src[f"{ours}{mine}.{suffix}"] = plain(f"{theirs}{name}.{suffix}")
            src[f"{ours}gate_up.weight"] = WeightSource(
                (f"{theirs}mlp.up_gate_proj.weight",), rows=gate_first
            )
        return src


class NewModel(GteModel):
    """GTE as Alibaba published it (``NewModel``, model_type ``new``)."""

    architecture = "NewModel"

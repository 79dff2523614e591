"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``).

Differences from Llama, all expressed as :class:`DecoderConfig` settings:

* embeddings scaled by ``sqrt(hidden_size)``; RMSNorm scales by ``1 + weight``;
* four norms per layer (before and after attention, before and after the MLP), q/k norms;
* attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
* ``gelu_pytorch_tanh`` gated MLP; tied embeddings; optional final logit softcapping;
* ``layer_types``: "sliding_attention" layers see the last ``sliding_window`` tokens and use the
  local rope base (``rope_local_base_freq``, default 10k, never scaled), "full_attention" layers
  see everything and use the global rope (``rope_theta``, default 1M, with ``rope_scaling``).

EmbeddingGemma (``Gemma3TextModel``, ``use_bidirectional_attention``) is the same layers as an
encoder: :class:`Gemma3TextEncoder`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from infer.model.llama import DecoderConfig, DecoderLM, common_fields, require
from infer.model.rope import rope_config_from_dict, rope_params

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_layer_types(config: dict[str, Any], num_layers: int) -> list[str]:
    """``layer_types``, or the legacy ``sliding_window_pattern`` (every n-th layer is global)."""
    types = config.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        return list(types)
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def gemma3_rope_params(config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    new = config.get("rope_parameters")
    if isinstance(new, dict) and isinstance(new.get(layer_type), dict):
        params = dict(new[layer_type])
        params.setdefault("rope_theta", 10_000.0 if layer_type == SLIDING else 1_000_000.0)
        return params
    if layer_type == SLIDING:  # old spelling: local layers have their own base and no scaling
        return {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    return rope_params(config, FULL, default_theta=1_000_000.0)


class Gemma3ForCausalLM(DecoderLM):
    architecture = "Gemma3ForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        if config.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping is not supported (Gemma 3 does not use it)")
        if config.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true is not a causal LM")
        fields = common_fields(config)
        fields["head_dim"] = config.get("head_dim") or 256
        n = fields["num_layers"]
        types = gemma3_layer_types(config, n)
        window = require(config, "sliding_window") if SLIDING in types else None
        ropes = {
            t: rope_config_from_dict(
                gemma3_rope_params(config, t), fields["head_dim"], fields["max_position_embeddings"]
            )
            for t in set(types)
        }
        return DecoderConfig(
            **fields,
            ropes=tuple(ropes[t] for t in types),
            sliding_windows=tuple(window if t == SLIDING else None for t in types),
            qkv_bias=bool(config.get("attention_bias", False)),
            o_bias=bool(config.get("attention_bias", False)),
            qk_norm=True,
            sandwich_norms=True,
            norm_plus_one=True,
            activation=config.get("hidden_activation")
            or config.get("hidden_act")
            or "gelu_pytorch_tanh",
            attn_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
            embed_scale=float(fields["hidden_size"]) ** 0.5,
            final_logit_softcap=config.get("final_logit_softcapping"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        )


class Gemma3TextEncoder(Gemma3ForCausalLM):
    """EmbeddingGemma (``Gemma3TextModel`` with ``use_bidirectional_attention``): Gemma 3's
    layers with every token attending to its whole input, a sliding layer to the keys at most
    ``sliding_window // 2`` positions away on either side (transformers halves the configured
    window and counts it exclusive: ``|i - j| < sliding_window // 2 + 1``); an encoder
    (:mod:`infer.model.bert`'s serving: each input whole, pooled as its files say), with no
    vocabulary projection. Its checkpoint is the bare model's (no ``model.`` prefix)."""

    architecture = "Gemma3TextModel"
    is_encoder = True
    checkpoint_aliases = (("model.", ""),)

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        if not config.get("use_bidirectional_attention"):
            raise ValueError("Gemma3TextModel without use_bidirectional_attention: a decoder's "
                             "base model (serve its Gemma3ForCausalLM checkpoint)")  # fmt: skip
        causal = super().parse_config(config | {"use_bidirectional_attention": False})
        windows = tuple(None if w is None else w // 2 for w in causal.sliding_windows)
        return replace(causal, sliding_windows=windows, bidirectional=True,
                       tie_word_embeddings=True)  # fmt: skip

    def plain_decoder(self) -> None:  # type: ignore[override]
        return None  # (the fused decode loop is causal)

    def vocab_projection_weight(self) -> None:  # type: ignore[override]
        """None: an encoder projects nothing onto its vocabulary."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.architecture} is an encoder: it has no logits to compute")

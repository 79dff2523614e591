"""Qwen 2 (biases on q/k/v) and Qwen 3 (per-head q/k RMSNorm, explicit head_dim)."""

from __future__ import annotations

from typing import Any

from infer.model.llama import DecoderConfig, DecoderLM, common_fields, layer_windows, uniform_rope


class Qwen2ForCausalLM(DecoderLM):
    architecture = "Qwen2ForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        fields = common_fields(config)
        return DecoderConfig(
            **fields,
            ropes=uniform_rope(config, fields),
            sliding_windows=layer_windows(config, fields["num_layers"]),
            qkv_bias=True,  # Qwen 2 always has q/k/v biases and never an o_proj bias
            activation=config.get("hidden_act", "silu"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )


class Qwen3ForCausalLM(DecoderLM):
    architecture = "Qwen3ForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        fields = common_fields(config)
        bias = bool(config.get("attention_bias", False))
        return DecoderConfig(
            **fields,
            ropes=uniform_rope(config, fields),
            sliding_windows=layer_windows(config, fields["num_layers"]),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            activation=config.get("hidden_act", "silu"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

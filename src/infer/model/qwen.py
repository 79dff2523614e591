"""Qwen 2 (biases on q/k/v) and Qwen 3 (per-head q/k RMSNorm, explicit head_dim)."""

from __future__ import annotations

from typing import Any

from infer.model.llama import DecoderConfig, DecoderLM, uniform_decoder_config


class Qwen2ForCausalLM(DecoderLM):
    architecture = "Qwen2ForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        # Qwen 2 always has q/k/v biases and never an o_proj bias.
        return uniform_decoder_config(config, qkv_bias=True)


class Qwen3ForCausalLM(DecoderLM):
    architecture = "Qwen3ForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        bias = bool(config.get("attention_bias", False))
        return uniform_decoder_config(config, qkv_bias=bias, o_bias=bias, qk_norm=True)

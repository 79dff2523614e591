"""Qwen 2 (biases on q/k/v) and Qwen 3 (per-head q/k RMSNorm, explicit head_dim), and their
mixtures of experts: Qwen2-MoE (plus a sigmoid-gated shared expert) and Qwen3-MoE."""

from __future__ import annotations

from typing import Any

from infer.model.llama import (
    DecoderConfig,
    DecoderLM,
    every_layer,
    from_max_window_layers,
    require,
    uniform_decoder_config,
)
from infer.model.moe import parse_moe

# Qwen's sliding windows are off unless use_sliding_window says otherwise; which layers slide
# (without layer_types) is each family's own rule in transformers.
QWEN_WINDOWS = dict(windows=from_max_window_layers, window_switch=False)


def _qwen2_moe_window_layers(config: dict[str, Any], layer: int) -> bool:
    """Qwen2-MoE: every other layer (the first, third, ...) below ``max_window_layers``."""
    return layer % 2 == 0 and layer < config.get("max_window_layers", 28)


class Qwen2ForCausalLM(DecoderLM):
    architecture = "Qwen2ForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        # Qwen 2 always has q/k/v biases and never an o_proj bias.
        return uniform_decoder_config(config, qkv_bias=True, **QWEN_WINDOWS)


class Qwen3ForCausalLM(DecoderLM):
    architecture = "Qwen3ForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        bias = bool(config.get("attention_bias", False))
        return uniform_decoder_config(
            config, qkv_bias=bias, o_bias=bias, qk_norm=True, **QWEN_WINDOWS
        )


class Qwen2MoeForCausalLM(DecoderLM):
    """Qwen 2 whose sparse layers route to ``num_experts_per_tok`` of ``num_experts`` experts
    (renormalised only with ``norm_topk_prob``) and add a shared expert gated by
    ``sigmoid(shared_expert_gate(x))``; ``mlp_only_layers`` and ``decoder_sparse_step`` keep
    layers dense (with ``intermediate_size``)."""

    architecture = "Qwen2MoeForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        moe = parse_moe(
            config,
            require(config, "num_hidden_layers"),
            experts_fields=("num_experts", "num_local_experts"),
            width_field="moe_intermediate_size",
            float32_weights=False,
            shared_expert=True,
        )
        return uniform_decoder_config(
            config, qkv_bias=bool(config.get("qkv_bias", True)), moe=moe,
            windows=_qwen2_moe_window_layers, window_switch=False,
        )  # fmt: skip


class Qwen3MoeForCausalLM(DecoderLM):
    """Qwen 3 (q/k norms) with Qwen2-MoE's routing and no shared expert."""

    architecture = "Qwen3MoeForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        moe = parse_moe(
            config,
            require(config, "num_hidden_layers"),
            experts_fields=("num_experts", "num_local_experts"),
            width_field="moe_intermediate_size",
            float32_weights=False,
        )
        bias = bool(config.get("attention_bias", False))
        # (Qwen3-MoE slides every layer when use_sliding_window is on)
        return uniform_decoder_config(
            config, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe, windows=every_layer,
            window_switch=False,
        )  # fmt: skip

"""Rotary position embeddings: parse the config's rope settings, precompute cos/sin tables.

Two spellings exist in ``config.json``:

* checkpoints in the wild: ``rope_theta`` + ``rope_scaling`` (``{"rope_type"|"type": ..., ...}``);
* transformers 5: ``rope_parameters`` (``{"rope_type", "rope_theta", ...}``), or for models with
  several layer kinds (Gemma 3) one such dict per layer type.

The tables hold ``cos``/``sin`` for every position up to ``max_position_embeddings`` in the
"rotate half" layout (frequencies repeated twice along the head dim), so a forward pass only
gathers rows by position: no per-step trigonometry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """One rope variant; hashable so layers with equal settings share one table."""

    theta: float
    head_dim: int
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # Each frequency's divisor, as a GGUF file stores them (``rope_freqs.weight``: llama.cpp's
    # converter writes a Llama 3 rope's scaling so); applied on top of ``rope_type``.
    freq_factors: tuple[float, ...] | None = None


def rope_config_from_dict(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int
) -> RopeConfig:
    """Build a :class:`RopeConfig` from one (flat) rope parameter dict."""
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1.0, 1):
        raise ValueError(f"partial_rotary_factor={partial} is not supported")
    original = params.get("original_max_position_embeddings")
    if rope_type in ("yarn", "llama3") and original is None:  # (as transformers reads it)
        original = max_position_embeddings
    factor = params.get("factor")
    if rope_type == "yarn" and factor is None:
        factor = max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if rope_type == "yarn" and attention_factor is None:
        attention_factor = _yarn_attention_factor(params, max_position_embeddings, original)
    return RopeConfig(
        theta=float(params["rope_theta"]),
        head_dim=head_dim,
        rope_type=rope_type,
        factor=float(factor or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        attention_factor=attention_factor,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        freq_factors=_freq_factors(params.get("freq_factors"), head_dim),
    )


def _freq_factors(values: Any, head_dim: int) -> tuple[float, ...] | None:
    if values is None:
        return None
    factors = tuple(float(v) for v in values)
    if len(factors) != head_dim // 2 or not all(f > 0 for f in factors):
        raise ValueError(f"freq_factors must be {head_dim // 2} positive numbers")
    return factors


def rope_params(
    config: dict[str, Any],
    layer_type: str | None = None,
    default_theta: float = 10_000.0,
    legacy_theta_key: str = "rope_theta",
) -> dict[str, Any]:
    """The flat rope parameter dict of ``layer_type`` from either config spelling.

    ``legacy_theta_key`` names the old-style key holding this layer type's base (Gemma 3 keeps
    its local base in ``rope_local_base_freq``).
    """
    new = config.get("rope_parameters")
    if isinstance(new, dict) and new:
        nested = layer_type is not None and isinstance(new.get(layer_type), dict)
        params = dict(new[layer_type]) if nested else dict(new)
        if not nested and any(isinstance(v, dict) for v in new.values()):
            params = {}  # nested by layer type but not for this one
        params.setdefault("rope_theta", config.get(legacy_theta_key, default_theta))
        return params if nested else _with_top_level_original(config, params)
    params = dict(config.get("rope_scaling") or {})
    params["rope_theta"] = config.get(legacy_theta_key, default_theta)
    return _with_top_level_original(config, params)


def _with_top_level_original(config: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 style configs keep ``original_max_position_embeddings`` beside ``rope_scaling``, not
    in it; transformers then takes that one, for the rope types that scale from it."""
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in ("llama3", "yarn") and config.get("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return params


def _yarn_attention_factor(params: dict[str, Any], max_pos: int, original: int) -> float:
    factor = params.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def inverse_frequencies(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """``inv_freq`` ([head_dim / 2], float32) and the cos/sin multiplier of the rope variant."""
    dim = rope.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    scaling = 1.0
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn(inv_freq, rope)
        scaling = float(rope.attention_factor or 1.0)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    # NOTE: "dynamic" NTK only rescales past max_position_embeddings, which the engine never
    # reaches (max_model_len <= max_position_embeddings), so inside the table it is "default".
    return inv_freq, scaling


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings or 8192
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    dim = rope.head_dim
    base = rope.theta
    original = rope.original_max_position_embeddings or 4096

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / rope.factor) * (1 - extrapolation) + inv_freq * extrapolation


def rope_tables(
    rope: RopeConfig, max_positions: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[max_positions, head_dim]`` in ``dtype`` (computed in float32).

    ``sin`` carries the sign of the "rotate half" trick (first half negated), so applying the
    rotation is one swap and one fused multiply-add (see :func:`apply_rope`).
    """
    inv_freq, scaling = inverse_frequencies(rope)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1) * scaling
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * scaling
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by per-token ``cos, sin`` ``[T, 1, head_dim]``.

    ``x * cos + rotate_half(x) * sin`` where ``rotate_half(x) = (-x2, x1)``; the minus lives in
    the ``sin`` table, leaving the half swap ``(x2, x1)``.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)

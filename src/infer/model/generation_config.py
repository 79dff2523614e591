"""The sampling defaults a model's authors recommend, from its ``generation_config.json``.

Many checkpoints say how they should be sampled (Qwen3: temperature 0.6, top-p 0.95, top-k 20;
Llama 3 Instruct: temperature 0.6, top-p 0.9). As vLLM does (its ``--generation-config auto``),
a request that leaves such a field unset takes the model's value; one that sets it keeps its
own. The fields read are vLLM's: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``). ``do_sample`` is not read
(vLLM does not either): a request's temperature decides whether it samples.

``--generation-config none`` (or ``vllm``, vLLM's spelling) keeps infer's own defaults
(temperature 1, no top-p/top-k/min-p, no penalty); a folder reads that folder's file instead of
the model's; ``--override-generation-config '{"temperature": 0.2}'`` sets or replaces fields.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from infer.core.sampling_params import InvalidRequestError, SamplingParams
from infer.model.folders import read_json

FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# transformers' GenerationConfig defaults (a file's value equal to one is not a recommendation)
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
# --generation-config values that read no file
NONE = ("none", "vllm")


def parse_override(text: str | dict[str, Any] | tuple | None) -> dict[str, Any]:
    """``--override-generation-config``: a JSON object of generation_config.json keys (or the
    ``(key, value)`` pairs a ModelConfig keeps)."""
    from infer.config import json_object

    if text is None or text == "":
        return {}
    data = (
        dict(text) if isinstance(text, tuple) else json_object(text, "--override-generation-config")
    )
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"--override-generation-config: unknown field(s) {', '.join(unknown)} "
            f"(known: {', '.join(FIELDS)})"
        )
    return dict(data)


def sampling_defaults(
    model_dir: Path, source: str = "auto", override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The SamplingParams fields (by SamplingParams name) a request takes where it sets none.

    ``source``: ``auto`` (the model folder's generation_config.json), ``none``/``vllm`` (no
    file), or a folder holding one. Raises ``ValueError`` naming the file and field when a
    value is not one a request could take."""
    found: dict[str, Any] = {}
    where = "--override-generation-config"
    if source not in NONE:
        folder = Path(model_dir) if source == "auto" else Path(source)
        if source != "auto" and not (folder / FILE).is_file():
            raise ValueError(f"--generation-config {source}: {folder / FILE} does not exist")
        path = folder / FILE
        if path.is_file():
            # (a value equal to transformers' own default is no recommendation: top_k 50 is
            # what every GenerationConfig holds; vLLM reads the file's difference from those)
            found = {k: v for k, v in read_json(path, what="generation config").items()
                     if k in FIELDS and v is not None and v != HF_DEFAULTS.get(k)}  # fmt: skip
            where = str(path)
    found.update(override or {})
    defaults = {FIELDS[k]: _number(k, v, where) for k, v in found.items()}
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as exc:
        raise ValueError(
            f"{where}: {exc} (--generation-config none keeps infer's own defaults)"
        ) from None
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return defaults


def _number(key: str, value: Any, where: str) -> Any:
    """A finite number (an integral float where an integer belongs is that integer: 20.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be a finite number, got {value!r}")
    if key in ("top_k", "max_new_tokens") and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def describe(defaults: dict[str, Any]) -> str:
    """``temperature=0.6, top_p=0.95`` for the start-up log (in FIELDS' order)."""
    return ", ".join(f"{k}={defaults[k]}" for k in FIELDS.values() if k in defaults)

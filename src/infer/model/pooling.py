"""How a model turns hidden states into an embedding: its sentence-transformers configuration.

Embedding checkpoints published for sentence-transformers say how they pool in two files::

    modules.json              [{"type": "sentence_transformers.models.Transformer", ...},
                               {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
                               {"type": "sentence_transformers.models.Normalize", ...}]
    1_Pooling/config.json     {"pooling_mode_lasttoken": true, "pooling_mode_mean_tokens": false, ...}

infer pools the last token (decoder-only embedding models are trained for it); a model whose
files ask for another pooling is served, but its embedding requests are refused, naming the
mode and ``--pooler-config``, which sets or replaces what the files say (vLLM's flag).
A model without these files pools the last token and normalizes, as vLLM's embed runner does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer.model.folders import ModelLoadError, read_json

SUPPORTED = ("LAST",)
# sentence-transformers' pooling config key -> the pooling type's name (vLLM's names)
MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_max_tokens": "MAX",
    "pooling_mode_weightedmean_tokens": "WEIGHTED_MEAN",
    "pooling_mode_mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
}
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolerConfig:
    """``pooling_type``: how the prompt's hidden states become one vector (only ``LAST`` is
    served); ``normalize``: whether an embedding is scaled to unit length unless the request
    says; ``source``: where these came from (for errors and the start-up log)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    source: str = "infer's default"

    @property
    def supported(self) -> bool:
        return self.pooling_type in SUPPORTED


def parse_pooler_config(text: str | dict[str, Any] | None) -> dict[str, Any]:
    """``--pooler-config``: a JSON object with ``pooling_type`` and/or ``normalize``."""
    from infer.config import json_object

    if text is None or text == "":
        return {}
    data = json_object(text, "--pooler-config")
    unknown = sorted(set(data) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"--pooler-config: unknown field(s) {', '.join(unknown)} "
                         "(known: pooling_type, normalize)")  # fmt: skip
    if "pooling_type" in data:
        kind = data["pooling_type"]
        if not isinstance(kind, str) or kind.upper() not in SUPPORTED:
            raise ValueError(f"--pooler-config: pooling_type {kind!r} is not supported "
                             f"(infer pools: {', '.join(SUPPORTED)})")  # fmt: skip
        data["pooling_type"] = kind.upper()
    if "normalize" in data and not isinstance(data["normalize"], bool):
        raise ValueError(f"--pooler-config: normalize must be true or false, "
                         f"got {data['normalize']!r}")  # fmt: skip
    return data


def load_pooler_config(model_dir: Path, override: dict[str, Any] | None = None) -> PoolerConfig:
    """The model folder's pooling (its ``modules.json``), with ``override`` over it. Raises
    ``ModelLoadError`` naming a file that is there but unreadable."""
    config = PoolerConfig()
    modules_path = Path(model_dir) / "modules.json"
    if modules_path.is_file():
        config = _from_sentence_transformers(modules_path)
    if override:
        config = PoolerConfig(
            pooling_type=override.get("pooling_type", config.pooling_type),
            normalize=override.get("normalize", config.normalize),
            source=f"--pooler-config over {config.source}",
        )
    return config


def _from_sentence_transformers(modules_path: Path) -> PoolerConfig:
    import json

    try:
        modules = json.loads(modules_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{modules_path} is not valid JSON: {e}") from e
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{modules_path} must hold a list of module objects")
    types = [m.get("type") for m in modules]
    pooling_type = "LAST"
    if _POOLING_MODULE in types:
        module = modules[types.index(_POOLING_MODULE)]
        pooling = read_json(modules_path.parent / str(module.get("path", "")) / "config.json",
                            "the sentence-transformers pooling config")  # fmt: skip
        chosen = [name for key, name in MODES.items() if pooling.get(key)]
        if len(chosen) != 1:
            raise ModelLoadError(
                f"{modules_path.parent / str(module.get('path', ''))}/config.json: expected one "
                f"pooling mode, found {', '.join(chosen) or 'none'}"
            )
        pooling_type = chosen[0]
    return PoolerConfig(pooling_type, _NORMALIZE_MODULE in types, source=str(modules_path))

"""The tokenizer (and its chat template) from a model folder, offline."""

from __future__ import annotations

from pathlib import Path

from infer.model.folders import ModelLoadError


def load_tokenizer(path: Path):
    """``AutoTokenizer`` of the folder ``path``; never downloads. Raises :class:`ModelLoadError`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc

"""What ``--model`` names: a built-in model (trained on first use), a local folder, or a model id
in the local Hugging Face cache.

This sits above both the model loader and the built-in models' training code, so neither has to
know about the other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from infer.model.folders import find_model_folder

DEFAULT_MODEL = "small"


def resolve_model_path(
    model: str | os.PathLike[str] | None, hf_overrides: str | dict[str, Any] | None = None
) -> Path:
    """The folder to load for ``model`` (``None`` is the default built-in, ``small``).

    A built-in name builds the model the first time (see :mod:`infer.builtin`); anything else
    is looked up without touching the network. ``hf_overrides`` (``--hf-overrides``): the
    folder with those ``config.json`` fields replaced (:mod:`infer.model.overrides`).
    """
    from infer.builtin import BUILTIN_NAMES, ensure_builtin_model

    name = DEFAULT_MODEL if model is None else str(model)
    folder = Path(ensure_builtin_model(name)) if name in BUILTIN_NAMES else find_model_folder(name)
    if hf_overrides:
        from infer.model.overrides import overridden_folder

        return overridden_folder(folder, hf_overrides)
    return folder

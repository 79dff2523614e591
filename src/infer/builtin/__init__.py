"""Built-in models that train themselves offline, so infer works with no model hub.

``toy`` is the tiny NanoGPT used as a CPU benchmark (GPT-2, 0.057M parameters, context 64);
``small`` is a ~11M-parameter Llama that writes recognisable English. Both are trained on
Python's own documentation the first time they are asked for and cached as ordinary Hugging
Face folders::

    from infer.builtin import ensure_builtin_model
    path = ensure_builtin_model("small")   # trains once (2-4 min on 2 cores), then cached
"""

from __future__ import annotations

from infer.builtin.cache import builtin_dir, cache_root, ensure_builtin_model
from infer.builtin.presets import BUILTIN_NAMES, PRESETS, RECIPE_VERSION, Preset, get_preset

__all__ = [
    "BUILTIN_NAMES",
    "PRESETS",
    "RECIPE_VERSION",
    "Preset",
    "builtin_dir",
    "cache_root",
    "ensure_builtin_model",
    "get_preset",
]

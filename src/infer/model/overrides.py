"""``--hf-overrides``: serve a model folder with some of its ``config.json`` fields replaced
(vLLM's flag), e.g. to load a causal reranker as the sequence classifier it is used as::

    --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
                     "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'

The overrides are written out once as a folder beside the model, in the cache::

    <cache>/overrides/<folder name>-<key>/config.json     the folder's, each override's field
                                                           set to its value (top level)
                                         /<every other>    a link to the folder's own file

``key`` hashes the folder's path, each entry's name, size and modification time, and the
overrides, so an edited config, other weight files or other overrides make another folder.
Everything that reads a model folder (spec, loader, tokenizer, tensor-parallel workers, the
engine process) reads this one unchanged. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from infer.model.folders import ModelLoadError, make_folder_once, read_config

FOLDER_VERSION = 1


def parse_hf_overrides(value: str | dict[str, Any] | None) -> str:
    """``--hf-overrides`` (a JSON object, or a dict) as canonical JSON (sorted keys; ``""`` for
    none), so a frozen config holding it stays hashable. ValueError names the flag."""
    from infer.config import json_object

    if value is None or value == "" or value == {}:
        return ""
    data = json_object(value, "--hf-overrides")
    try:
        return json.dumps(data, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--hf-overrides: {e}") from None


def overridden_folder(
    folder: Path, overrides: str | dict[str, Any], cache: Path | None = None
) -> Path:
    """The folder ``folder`` with ``overrides`` (``parse_hf_overrides``' JSON, or a dict) over
    its ``config.json``; made once (atomically: a temporary folder renamed into place)."""
    text = parse_hf_overrides(overrides)
    folder = Path(folder).resolve()
    if not text:
        return folder
    config = read_config(folder)  # (a ModelLoadError naming the file when it cannot be read)
    config.update(json.loads(text))
    try:
        entries = [(e.name, e.stat().st_size, e.stat().st_mtime_ns)
                   for e in sorted(folder.iterdir())]  # fmt: skip
    except OSError as e:  # (a dangling link in the folder, say)
        raise ModelLoadError(f"cannot read the model folder {folder}: {e}") from e
    key = hashlib.sha256(
        json.dumps([str(folder), entries, text, FOLDER_VERSION]).encode()
    ).hexdigest()[:16]
    if cache is None:
        from infer.builtin.cache import cache_root

        cache = cache_root()
    out = Path(cache) / "overrides" / f"{folder.name}-{key}"
    if out.is_dir():
        return out

    def write(tmp: Path) -> None:
        for entry in folder.iterdir():
            if entry.name != "config.json":
                os.symlink(entry.resolve(), tmp / entry.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tmp.chmod(0o755)  # (mkdtemp's folder is private; the cache is shared)

    try:
        return make_folder_once(out, write)
    except OSError as e:
        raise ModelLoadError(f"cannot write the --hf-overrides folder {out}: {e}") from e

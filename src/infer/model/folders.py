"""Finding a model's folder and reading its JSON files, without importing torch (a path check
or ``infer.engine.model_source`` need not load the model layer)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ModelLoadError(Exception):
    """A model cannot be found or loaded; the message names the file, tensor or field."""


# --------------------------------------------------------------------------- finding a model


def find_model_folder(model: str | os.PathLike[str]) -> Path:
    """The folder of ``model``: a local path, a GGUF file (the folder made from its metadata,
    :mod:`infer.model.gguf_folder`) or a folder holding one, or a hub id
    (``org/name[@revision][:TAG]``) already in the local Hugging Face cache, ``TAG`` picking
    a GGUF file of a repository holding several as llama.cpp's ``-hf org/name:Q4_K_M`` does.
    Never touches the network."""
    text = str(model)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            found = _gguf_in(path, None, text)
            if found is not None:
                return found
        return path.resolve()
    if path.exists():
        from infer.model.gguf_folder import gguf_model_folder, is_gguf_file

        if is_gguf_file(path):
            return gguf_model_folder(path)
        raise ModelLoadError(
            f"{text} is a file but not a GGUF file; expected a model folder with config.json "
            "or a .gguf file"
        )
    if _looks_like_repo_id(text):
        return _find_in_hf_cache(text)
    raise ModelLoadError(f"model folder {text} does not exist")


def _gguf_in(folder: Path, tag: str | None, name: str) -> Path | None:
    """The folder made of the GGUF file in ``folder`` (one whose name holds ``tag``, e.g.
    ``Q4_K_M``, when given: llama.cpp's ``repo:TAG``), None when it holds none; several that
    match are an error listing them. Vision projectors (``mmproj-*``) are not models."""
    from infer.model.gguf_folder import gguf_model_folder

    files = [f for f in sorted(folder.glob("*.gguf")) if not f.name.startswith("mmproj")]
    matches = [f for f in files if tag is None or tag.lower() in f.name.lower()]
    if len(matches) == 1:
        return gguf_model_folder(matches[0])
    if tag is not None and not matches:
        raise ModelLoadError(
            f"{name}: no GGUF file named like {tag!r} in {folder} (there: "
            f"{', '.join(f.name for f in files) or 'none'})"
        )
    if matches:
        raise ModelLoadError(
            f"{name} holds several GGUF files ({', '.join(f.name for f in matches)}): name one "
            f"by its path or as {name.split(':')[0]}:TAG (e.g. :Q4_K_M)"
        )
    return None


def _looks_like_repo_id(text: str) -> bool:
    repo = text.split("@", 1)[0].split(":", 1)[0]
    parts = repo.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def _find_in_hf_cache(model_id: str) -> Path:
    """The cached snapshot of ``org/name[@revision]``, resolved by huggingface_hub itself."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    model_id, _, tag = model_id.partition(":")  # llama.cpp's repo:TAG names a GGUF file
    repo, _, revision = model_id.partition("@")
    # NOTE: huggingface_hub reads its cache location once, at import; read the environment now
    # so a cache set after import (tests, notebooks) is honoured.
    cache = _hub_cache_dir() or constants.HF_HUB_CACHE
    try:
        folder = Path(
            snapshot_download(
                repo, revision=revision or None, cache_dir=cache, local_files_only=True
            )  # fmt: skip
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as e:
        raise ModelLoadError(
            f"model {repo!r} is not a local folder and is not in the local Hugging Face cache "
            f"({cache}); downloads are disabled, so fetch it beforehand "
            f"(`hf download {repo}`) or pass a folder"
        ) from e
    if tag or not (folder / "config.json").is_file():
        found = _gguf_in(folder, tag or None, f"{repo}:{tag}" if tag else repo)
        if found is not None:
            return found
        raise ModelLoadError(f"cached snapshot {folder} of {repo!r} has no config.json")
    return folder


def _hub_cache_dir() -> Path | None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return None


# --------------------------------------------------------------------------- JSON files


def read_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` of ``model_dir`` as a dict."""
    return read_json(Path(model_dir) / "config.json", what="model config")


def read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"missing {what}: {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def make_folder_once(out: Path, write: Callable[[Path], None]) -> Path:
    """``out``, made by ``write`` filling a temporary folder beside it that is then renamed
    into place: the folder appears whole or not at all, and one another process renamed first
    is kept. The temporary folder is removed whatever happens."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process made it first
            if not out.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

"""Build each built-in model once per machine, into the user cache directory, safely.

Layout (``$INFER_CACHE_DIR``, else ``$XDG_CACHE_HOME/infer``, else ``~/.cache/infer``)::

    <cache>/builtin/small-r2-seed0-steps240-py3.11/      a finished Hugging Face folder
    <cache>/builtin/small-r2-seed0-steps240-py3.11.lock  flock'd while building
    <cache>/builtin/small-r2-seed0-steps240-py3.11.tmp-* a build in progress (or a dead one)

The folder name carries everything the weights depend on: the preset, the recipe version,
the seed, the step count and the Python version (its bundled docs are the corpus). A build
trains into a ``.tmp-*`` sibling and is renamed into place only when complete, so a killed
build can never be mistaken for a model; the next builder, holding the lock, deletes it.
A second process (or thread) asking for the same model blocks on the lock and then finds the
finished folder instead of training again.
"""

from __future__ import annotations

import codecs
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infer.builtin.presets import DEFAULT_SEED, MANIFEST, RECIPE_VERSION, bf16_matmuls, get_preset

# Overrides the presets' step count (tests, CI, a quick look); it is part of the cache path.
STEPS_ENV = "INFER_BUILTIN_STEPS"

# flock locks belong to an open file description, so two threads that each open the lock file
# already exclude each other; this lock makes in-process waiting explicit and cheap.
_thread_lock = threading.Lock()


def cache_root() -> Path:
    """``$INFER_CACHE_DIR``, else ``$XDG_CACHE_HOME/infer``, else ``~/.cache/infer``."""
    if os.environ.get("INFER_CACHE_DIR"):
        return Path(os.environ["INFER_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "infer"
    return Path.home() / ".cache" / "infer"


def resolve_steps(name: str, steps: int | None = None) -> int:
    """Explicit ``steps``, else ``$INFER_BUILTIN_STEPS``, else the preset's own."""
    if steps is not None:
        return steps
    env = os.environ.get(STEPS_ENV)
    if env:
        return int(env)
    return get_preset(name).steps


def builtin_dir(name: str, *, seed: int = DEFAULT_SEED, steps: int | None = None) -> Path:
    """Where the built-in ``name`` lives (whether or not it is built yet)."""
    preset = get_preset(name)  # ValueError for unknown names
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    tag = f"{name}-r{RECIPE_VERSION}-seed{seed}-steps{resolve_steps(name, steps)}-py{py}"
    if preset.bf16_autocast and not bf16_matmuls(preset):
        tag += "-fp32"  # a bf16 recipe trained in float32 here: other weights
    return cache_root() / "builtin" / tag


def is_complete(path: Path) -> bool:
    """A finished build: the folder has its weights and a readable manifest."""
    try:
        json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (path / "model.safetensors").is_file() and (path / "config.json").is_file()


@contextmanager
def _build_lock(lock_path: Path, name: str) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path``; say so on stderr if we have to wait."""
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"infer: waiting for another process to finish building the '{name}' model",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale(final: Path) -> None:
    """Delete leftovers of killed builds (only call while holding the lock)."""
    for tmp in final.parent.glob(final.name + ".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    if final.exists() and not is_complete(final):
        shutil.rmtree(final, ignore_errors=True)


# The training process's first lines: it must run this very infer, however the caller found
# it (an install, a checkout put on sys.path at run time), whatever its own path would find
# first. So the package is loaded from its folder by hand; sys.path is left alone (an
# installed infer's parent is site-packages, which must not go before the standard library).
_BOOTSTRAP = """\
import importlib.util, os, sys
folder = sys.argv.pop(1)
spec = importlib.util.spec_from_file_location(
    "infer", os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])
module = importlib.util.module_from_spec(spec)
sys.modules["infer"] = module
spec.loader.exec_module(module)
from infer.builtin.build_child import main
sys.exit(main(sys.argv[1:]))
"""

# Lines of the training process's output quoted in the error when it fails.
_ERROR_TAIL_LINES = 15


def child_command(name: str, out: Path, *, seed: int, steps: int, progress: bool) -> list[str]:
    """The command line of the process that trains ``name`` into ``out``
    (:mod:`infer.builtin.build_child`, run from this very package)."""
    folder = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # .../infer
    cmd = [sys.executable, "-c", _BOOTSTRAP, folder, name, str(out), "--seed", str(seed),
           "--steps", str(steps), "--parent", str(os.getpid())]  # fmt: skip
    return cmd + ([] if progress else ["--no-progress"])


def train_in_child(name: str, out: Path, *, seed: int, steps: int, progress: bool) -> None:
    """Train ``name`` into ``out`` in a process of its own (:mod:`infer.builtin.build_child`),
    so the caller keeps nothing of the training. Its output (the progress bar, any error) is
    copied to this process's ``sys.stderr`` (a notebook's cell, not only file descriptor 2);
    a failure raises ``RuntimeError`` quoting the end of it."""
    cmd = child_command(name, out, seed=seed, steps=steps, progress=progress)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip
    tail = b""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # (chunks cut characters)
    try:
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(8192):
            sys.stderr.write(decoder.decode(chunk))
            sys.stderr.flush()
            tail = (tail + chunk)[-8192:]
        returncode = proc.wait()
    except BaseException:  # Ctrl-C, or the caller's thread torn down: the training goes too
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stdout.close()
    if returncode != 0:
        last = tail.decode(errors="replace").replace("\r", "\n").strip().splitlines()
        quoted = "\n".join(last[-_ERROR_TAIL_LINES:])
        raise RuntimeError(
            f"building the built-in '{name}' model failed: its training process exited with "
            f"status {returncode}" + (f"; its last output:\n{quoted}" if quoted else "")
        )


def ensure_builtin_model(
    name: str,
    *,
    progress: bool = True,
    seed: int = DEFAULT_SEED,
    steps: int | None = None,
) -> Path:
    """The folder of built-in model ``name`` ("toy" or "small"), building it on first use.

    The first call trains the model (a one-line notice and a progress bar on stderr) in a
    child process, into a temporary folder, and renames it into the cache; later calls return
    it immediately.
    Concurrent callers wait for the first build. ``steps`` (or ``$INFER_BUILTIN_STEPS``)
    and ``seed`` select a different, separately cached build. Unknown names raise ValueError.
    """
    preset = get_preset(name)
    steps = resolve_steps(name, steps)
    final = builtin_dir(name, seed=seed, steps=steps)
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _thread_lock, _build_lock(final.parent / (final.name + ".lock"), name):
        if is_complete(final):  # built by whoever held the lock before us
            return final
        _remove_stale(final)
        print(
            f"infer: building the built-in '{name}' model ({preset.description}; "
            f"{steps} steps, once) into {final}",
            file=sys.stderr,
            flush=True,
        )
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
        try:
            train_in_child(name, tmp, seed=seed, steps=steps, progress=progress)
            os.rename(tmp, final)  # atomic: the folder appears complete or not at all
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final

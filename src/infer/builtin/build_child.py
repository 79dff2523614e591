"""The process that trains a built-in model for the cache: ``python -m infer.builtin.build_child``.

:func:`infer.builtin.cache.ensure_builtin_model` runs the training here rather than in the
process that asked for the model (``infer serve``'s engine process, a user's script), which
so keeps nothing of it: no deterministic-mode or thread settings, no torch.compile/Triton
modules imported (in a server those printed nanobind leak reports at exit). Its output (the
progress bar) is copied to the asker's ``sys.stderr``. If the parent dies, this process ends
too (a watch thread), so a killed ``infer serve`` leaves no orphan training for minutes; its
temporary folder is removed by the next builder.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path


def _exit_with_parent(parent: int) -> None:
    """End this process (status 1) once ``parent`` is gone: we were reparented."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="infer-build-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.builtin.build_child")
    p.add_argument("name", help="the preset")
    p.add_argument("out", type=Path, help="an empty folder to train into")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--parent", type=int, required=True, help="the asking process's pid")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    _exit_with_parent(args.parent)

    from infer.builtin.presets import get_preset
    from infer.builtin.train import train

    try:
        train(get_preset(args.name), args.out, seed=args.seed, steps=args.steps,
              progress=not args.no_progress)  # fmt: skip
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the asker reports it
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

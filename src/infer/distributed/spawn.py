"""What every child process infer starts (the engine process, tensor-parallel ranks) needs.

No torch here: the engine process is spawned before torch is imported in it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def spawnable_main() -> Iterator[None]:
    """Start spawned processes from a main module that cannot be re-imported.

    ``multiprocessing``'s spawn re-runs the parent's main module in the child from its file;
    a program read from standard input (``python -``, ``echo ... | python``) has the file name
    ``<stdin>``, and the child died at once (``FileNotFoundError: '<stdin>'``) while the parent
    waited for it. The children infer starts run functions of infer's own modules and need
    nothing from the main module, so its file is hidden while they start.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or os.path.exists(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def leave_shutdown_to_parent() -> None:
    """In a child: ignore SIGINT and SIGTERM, and die with the parent (Linux).

    A supervisor that stops a service signals its whole process group (systemd's default,
    ``kill -TERM -- -PGID``, Ctrl-C in a terminal); the server drains its requests and then
    stops its children itself, so a child that died of the same signal would cut every stream
    short. ``PR_SET_PDEATHSIG``: a parent killed outright (SIGKILL) takes its children with it,
    so no orphan is left holding a GPU or a port.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()


def die_with_parent() -> None:
    """In a child: be killed (SIGKILL) when the parent dies (``PR_SET_PDEATHSIG``; Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

"""Benchmarks for infer and any OpenAI-compatible server: ``infer bench ...``.

Not part of the serving product: the HTTP client (httpx), the ``openai`` SDK and the plots
(matplotlib) come with the ``bench`` extra, ``pip install -e ".[bench]"``, and are imported only
inside the functions that use them, so ``infer serve`` and ``infer --help`` never load them.
Every ``infer bench`` command checks for them first (:func:`require_bench_extra`).

Reports go to :data:`DEFAULT_OUT` (``./bench-results``, relative to the working directory)
unless a command is given ``--out``.
"""

from __future__ import annotations

import importlib.util
import sys

DEFAULT_OUT = "bench-results"
"""Default report folder of every benchmark, relative to the current directory."""

BENCH_EXTRA = ("httpx", "openai", "matplotlib")
"""Modules of the ``bench`` extra (see ``pyproject.toml``)."""

INSTALL_HINT = 'pip install -e ".[bench]"'


def missing_bench_modules(modules: tuple[str, ...] = BENCH_EXTRA) -> list[str]:
    """The modules of ``modules`` that cannot be imported here (none when the extra is in)."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def require_ray_and_bench_extras(command: str) -> None:
    """Exit with status 2 naming the missing extra: ``bench``, or ``ray`` (the replicas)."""
    require_bench_extra(command)
    try:
        import ray  # noqa: F401
    except ImportError:
        from infer.cluster import RAY_INSTALL_HINT

        print(RAY_INSTALL_HINT, file=sys.stderr)
        raise SystemExit(2) from None


def require_bench_extra(command: str = "infer bench") -> None:
    """Exit with status 2 and a message naming the ``bench`` extra when it is not installed."""
    missing = missing_bench_modules()
    if missing:
        print(
            f"{command} needs the optional 'bench' dependencies (missing: {', '.join(missing)}).\n"
            f'Install them with: {INSTALL_HINT}   (from a checkout; or pip install "infer[bench]")',
            file=sys.stderr,
        )
        raise SystemExit(2)

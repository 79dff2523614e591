"""Build (or find cached) the tiny test checkpoints: ``python scripts/make_test_checkpoints.py``."""

from __future__ import annotations

import argparse
from pathlib import Path

from infer.testing.checkpoints import KINDS, build_all, build_tiny_checkpoint, default_root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help=f"folder (default {default_root()})")
    parser.add_argument("--kind", choices=KINDS, action="append", help="only these kinds")
    args = parser.parse_args()
    root = args.out or default_root()
    if args.kind:
        paths = {kind: build_tiny_checkpoint(kind, root) for kind in args.kind}
    else:
        paths = build_all(root)
    for kind, path in paths.items():
        print(f"{kind:14s} {path}")


if __name__ == "__main__":
    main()

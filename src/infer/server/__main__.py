"""``python -m infer.server``: the same as ``infer serve``."""

from __future__ import annotations

import sys

from infer.server.cli import main

if __name__ == "__main__":
    sys.exit(main())

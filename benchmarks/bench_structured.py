"""What constrained decoding costs: ``infer bench structured``.

    python benchmarks/bench_structured.py [--runs 3]

Needs ``pip install -e ".[bench]"``; the code is :mod:`infer.bench.structured`, ``--help`` lists
the flags. Reports go to ``./bench-results/structured`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "structured", *sys.argv[1:]]))

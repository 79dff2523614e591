"""A mixture of experts' batch-1 decode against a dense model of its active bytes:
``infer bench moe``.

    python benchmarks/bench_moe.py [--runs 5] [--paths fast,modules,dense] [--out DIR]

Needs ``pip install -e ".[bench]"``; the code is :mod:`infer.bench.moe`, ``--help`` lists the
flags. Reports go to ``./bench-results/moe`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "moe", *sys.argv[1:]]))

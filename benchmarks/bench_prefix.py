"""Prefix caching in wall-clock time on a ~100M Llama: ``infer bench prefix``.

    python benchmarks/bench_prefix.py [--runs 5] ...

Needs ``pip install -e ".[bench]"``; the code is :mod:`infer.bench.prefix`, ``--help`` lists
the flags. Reports go to ``./bench-results/prefix`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "prefix", *sys.argv[1:]]))

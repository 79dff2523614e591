"""Prefill/decode disaggregation vs two ordinary replicas on Ray Serve: ``infer bench disagg``.

    python benchmarks/bench_disagg.py [--modes pd,dp,single] [--runs 3] [--window 20] ...

Needs ``pip install -e ".[bench,ray]"``; the code is :mod:`infer.bench.disagg`, ``--help`` lists
the flags. Reports go to ``./bench-results/disagg`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "disagg", *sys.argv[1:]]))

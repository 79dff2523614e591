"""What speculative decoding buys and costs: ``infer bench spec``.

    python benchmarks/bench_spec.py [--runs 3] [--k 4] [--concurrency 1,8,16,64]

Needs ``pip install -e ".[bench]"``; the code is :mod:`infer.bench.spec`, ``--help`` lists
the flags. Reports go to ``./bench-results/spec`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "spec", *sys.argv[1:]]))

"""What 4-bit weights buy and cost: ``infer bench int4``.

    python benchmarks/bench_quant.py [--runs 3] [--methods bf16,int8,int4,w4a8] [--model DIR] ...

Needs ``pip install -e ".[bench]"``; the code is :mod:`infer.bench.int4`, ``--help`` lists
the flags. Reports go to ``./bench-results/int4`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "int4", *sys.argv[1:]]))

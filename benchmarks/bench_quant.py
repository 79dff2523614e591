"""What quantization buys and costs: ``infer bench quant``.

    python benchmarks/bench_quant.py [--runs 3] [--kv-memory 256MiB] [--model DIR] ...

Needs ``pip install -e ".[bench]"``; the code is :mod:`infer.bench.quant`, ``--help`` lists
the flags. Reports go to ``./bench-results/quant`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "quant", *sys.argv[1:]]))

"""Engine throughput on a ~100M Llama with the machine's roofline: ``infer bench engine``.

    python benchmarks/bench_engine.py [--dtypes bfloat16,float32] [--concurrency 1,16,64] ...

Needs ``pip install -e ".[bench]"``; the code is :mod:`infer.bench.engine`, ``--help`` lists
the flags. Reports go to ``./bench-results/engine`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "engine", *sys.argv[1:]]))

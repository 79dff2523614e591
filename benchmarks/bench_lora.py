"""LoRA adapters against the base model:
``infer bench lora``.

    python benchmarks/bench_lora.py [--adapters 8] [--rank 16] [--runs 3] [--out DIR]

Needs ``pip install -e ".[bench]"``; the code is :mod:`infer.bench.lora`, ``--help`` lists the
flags. Reports go to ``./bench-results/lora`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "lora", *sys.argv[1:]]))

"""The five serving workloads against any OpenAI-compatible server: ``infer bench serve``.

    python benchmarks/bench_serving.py --server http://127.0.0.1:8000 --model M --workload all --seed 42

Needs ``pip install -e ".[bench]"``; same flags as ``infer bench serve`` (``--help``). Reports go
to ``./bench-results`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))

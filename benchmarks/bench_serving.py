"""Serving benchmark: the five workloads of the reference log against any OpenAI-compatible server.

Same flags as ``infer bench serve``::

    python benchmarks/bench_serving.py --server http://127.0.0.1:8000 --model M --workload all --seed 42
"""

from __future__ import annotations

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))

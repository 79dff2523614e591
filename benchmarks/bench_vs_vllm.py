"""infer vs vLLM over HTTP, both driven by ``vllm bench serve``: ``infer bench vs-vllm``.

    python benchmarks/bench_vs_vllm.py [--peers infer,vllm] [--workloads 64x64,1024x128]
                                       [--runs 3] [--infer-args="..."] [--offline] ...

The serving-speed yardstick. Needs ``pip install -e ".[bench]"`` and vLLM's CPU build in its own
virtual environment (``$VLLM_VENV``, default ``~/peers/vllm``); the code is
:mod:`infer.bench.vs_vllm`, ``--help`` lists the flags. Reports go to
``./bench-results/vs_vllm`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "vs-vllm", *sys.argv[1:]]))

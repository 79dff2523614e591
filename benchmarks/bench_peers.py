"""infer vs vLLM's CPU build over HTTP, same model and prompts: ``infer bench peers``.

    python benchmarks/bench_peers.py [--peers infer,vllm] [--concurrency 1,16,64] ...

Needs ``pip install -e ".[bench]"``; the code is :func:`infer.bench.vs_vllm.run_peers`,
``--help`` lists the flags. Reports go to ``./bench-results/peers`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "peers", *sys.argv[1:]]))

"""One CUDA GPU, every number of the CUDA path: ``infer bench gpu``.

    python benchmarks/bench_gpu.py [--quick] [--modes graphs,eager,torch-eager] [--skip-hf] ...

Needs a CUDA GPU (not the ``bench`` extra); the code is :mod:`infer.bench.gpu`, ``--help`` lists
the flags, ``scripts/gpu_check.sh`` runs it on a lent machine. Reports go to
``./bench-results/gpu`` unless ``--out`` says otherwise.
"""

import sys

from infer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "gpu", *sys.argv[1:]]))

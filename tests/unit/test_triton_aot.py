"""Every Triton kernel of the GPU step compiles for an sm_90 GPU (H100 / H200) on every CI run,
with no GPU: the interpreter, which the kernel tests run on a CPU, accepts code that Triton's
compiler refuses (types, layouts, loops), and a GPU is lent only now and then. The compile runs
in a subprocess without ``TRITON_INTERPRET`` (``tests/unit/_aot_triton.py`` lists the kernels
and the constants they are compiled with: the engine's configurations)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton ships no ptxas")
def test_every_kernel_compiles_for_sm_90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.unit._aot_triton"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr[-3000:]
    assert run.returncode == 0, out
    assert "FAILED" not in run.stdout and "all 15 compiled" in run.stdout, out

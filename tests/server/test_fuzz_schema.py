"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis).

Every check schemathesis has: no 5xx, every response as the schema says, no schema-valid request
refused (but for the rules between two fields that no JSON schema can state; see
``schemathesis_hooks.py``), no schema-invalid request accepted, every referenced schema present.
The default run replays a fixed seed (the same ~2,000 cases every time, ~1 minute); ``-m slow``
draws a new seed and tries ten times as many examples per operation.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tests.server.conftest import start_server

pytest.importorskip("schemathesis", reason="the test extra has schemathesis")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fuzz_server(llama_checkpoint, server_logs):
    # A 64-token context keeps every fuzzed generation short; the priority policy takes any
    # priority (fcfs refuses all but 0).
    yield from start_server(llama_checkpoint, server_logs, "--max-model-len", "64",
                            "--max-num-seqs", "8", "--no-access-log",
                            "--scheduling-policy", "priority")  # fmt: skip


def _fuzz(server, max_examples: int, seed: int, tmp_path: Path) -> None:
    st = shutil.which("st") or str(Path(sys.executable).parent / "st")
    env = dict(os.environ, SCHEMATHESIS_HOOKS="tests.server.schemathesis_hooks",
               PYTHONPATH=str(REPO))  # fmt: skip
    cmd = [st, "run", f"{server.url}/openapi.json", "--checks", "all",
           "--max-examples", str(max_examples), "--seed", str(seed), "--workers", "1",
           "--request-timeout", "30", "--max-response-time", "30", "--no-color",
           "--report", "junit",
           "--report-dir", str(tmp_path)]  # fmt: skip
    # Run in tmp_path: schemathesis keeps its example database in the working directory.
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    # Afterwards the server is healthy, idle, and has every KV block back.
    assert httpx.get(server.url + "/health").status_code == 200
    server.wait_idle()


def test_fuzzing_finds_nothing(fuzz_server, tmp_path):
    _fuzz(fuzz_server, max_examples=50, seed=1, tmp_path=tmp_path)


def test_fuzzing_an_encoders_schema_finds_nothing(server_logs, tmp_path):
    """A BGE-M3 folder (an XLM-RoBERTa with its multi-vector and sparse layers beside it):
    its schema leaves out the generation routes, lists /pooling's tasks it serves (token
    classification taking neither dimensions nor normalize) and no ``messages`` (it has no
    chat template); no schema-valid request is refused."""
    import torch

    from infer.testing.encoders import build_encoder, default_encoder_root

    folder = tmp_path / "bge-m3"
    shutil.copytree(build_encoder("xlm_roberta", default_encoder_root(), "cls"), folder)
    gen = torch.Generator().manual_seed(1)
    for name, rows in (("colbert_linear.pt", 32), ("sparse_linear.pt", 1)):
        torch.save({"weight": 0.2 * torch.randn(rows, 64, generator=gen),
                    "bias": torch.zeros(rows)}, folder / name)  # fmt: skip
    for server in start_server(folder, server_logs, "--no-access-log",
                               "--scheduling-policy", "priority"):  # fmt: skip
        schema = httpx.get(server.url + "/openapi.json").json()
        assert "/v1/chat/completions" not in schema["paths"]
        _fuzz(server, max_examples=20, seed=1, tmp_path=tmp_path)


@pytest.mark.slow
def test_fuzzing_a_fresh_seed_finds_nothing(fuzz_server, tmp_path):
    seed = random.randrange(2**32)
    print(f"schemathesis seed {seed}")
    _fuzz(fuzz_server, max_examples=500, seed=seed, tmp_path=tmp_path)

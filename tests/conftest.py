"""Shared fixtures: tiny checkpoints of every supported architecture (built once, cached)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer.testing.checkpoints import KINDS, build_all


# `pytest tests/integration --device cuda` runs the engine and model tests on a GPU, with
# transformers (the oracle) on the same device; CPU-only tests (kernels, CPU binding) ignore it.
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device", default="cpu", help="device of the engine and model tests: cpu | cuda | cuda:N"
    )


@pytest.fixture(scope="session")
def engine_device(request: pytest.FixtureRequest) -> str:
    """The device ``--device`` names; a CUDA device without CUDA fails the run at once."""
    device = str(request.config.getoption("--device"))
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.exit(f"--device {device} was given but CUDA is not available", returncode=4)
    return device


# One kind per model implementation; "llama_sharded" is the llama weights split into shards.
ARCH_KINDS = tuple(k for k in KINDS if k != "llama_sharded")


@pytest.fixture(scope="session")
def tiny_checkpoints() -> dict[str, Path]:
    """kind -> folder of a tiny random checkpoint (see ``infer.testing.checkpoints``)."""
    return build_all()


@pytest.fixture(params=ARCH_KINDS)
def checkpoint_kind(request: pytest.FixtureRequest) -> str:
    """Parametrises a test over every architecture kind."""
    return request.param


@pytest.fixture
def tiny_checkpoint(tiny_checkpoints: dict[str, Path], checkpoint_kind: str) -> Path:
    """The checkpoint folder of ``checkpoint_kind`` (runs the test once per architecture)."""
    return tiny_checkpoints[checkpoint_kind]

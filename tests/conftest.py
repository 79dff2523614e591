"""Shared fixtures: tiny checkpoints of every supported architecture (built once, cached)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer.testing.checkpoints import KINDS, build_all

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

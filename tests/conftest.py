"""Shared fixtures: tiny checkpoints of every supported architecture (built once, cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The README's test command runs two xdist workers (`-n 2 --dist loadgroup`) on a 2-core machine:
# each takes one intra-op thread (torch reads this at import). Two spinning OpenMP pools per core
# make the tiny models' forward passes crawl.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. The variable is
# read when the kernels are defined, so before anything imports infer.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


from infer.runner.cpu.kernels import kernels_dir  # noqa: E402
from infer.testing.checkpoints import KINDS, build_all  # noqa: E402

# Tests that keep their built models and conversions apart set INFER_CACHE_DIR to a folder of
# their own; the C++ CPU kernels would be compiled again under each (~20-40 s on 2 cores for
# every server such a test starts): one kernel build serves them all.
os.environ.setdefault("INFER_KERNELS_DIR", str(kernels_dir()))


def _patient_httpx(seconds: float = 60.0) -> None:
    """httpx waits 5 s by default, for its module helpers (``httpx.get``) and its clients alike.
    Tests talk to real servers on a 2-core box another worker keeps busy: one answer can take
    longer than that without anything being wrong (a dashboard test failed so in CI once). A
    test that means to time out says so with its own ``timeout=``."""
    import httpx

    patient = httpx.Timeout(seconds)
    for name in ("get", "post", "put", "patch", "delete", "head", "options", "request", "stream"):
        function = getattr(httpx, name)
        getattr(function, "__wrapped__", function).__kwdefaults__["timeout"] = patient
    for client in (httpx.Client, httpx.AsyncClient):
        client.__init__.__kwdefaults__["timeout"] = patient


_patient_httpx()


# `pytest tests/integration --device cuda` runs the engine and model tests on a GPU, with
# transformers (the oracle) on the same device; CPU-only tests (kernels, CPU binding) ignore it.
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device", default="cpu", help="device of the engine and model tests: cpu | cuda | cuda:N"
    )
    # The engine tests' attention on CUDA (the default: triton, with CUDA graphs for decode).
    parser.addoption("--attention-backend", default=None, help="auto | torch | triton")
    parser.addoption("--enforce-eager", action="store_true", help="CUDA: no graphs")


# Modules of a minute or more on 2 cores (the Ray ones together: ~4 minutes), handed out first
# under `--dist loadgroup` so that no worker is left running one alone at the end.
LONG_MODULES = (
    "tests/cluster/",
    "tests/integration/test_triton_step.py",
    "tests/integration/test_async_scheduling.py",
    "tests/server/test_fuzz_schema.py",
    "tests/unit/test_bench_gpu.py",
    "tests/distributed/test_no_hangs.py",
    "tests/server/test_lifecycle.py",
)


def _long_first(nodeid: str) -> int:
    return next((i for i, m in enumerate(LONG_MODULES) if nodeid.startswith(m)), len(LONG_MODULES))


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") == "loadgroup":
        config.option.loadscopereorder = False  # keep the order below, not "most tests first"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` a worker takes a whole module (its module-scoped servers start
    once) and every ``ray`` test (two local Ray clusters at once on 2 cores each start twice as
    slowly); the long modules go first."""
    if not getattr(config.option, "loadgroup", False):  # (xdist's workers run with dist "no")
        return
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        item.add_marker(
            pytest.mark.xdist_group("ray" if item.get_closest_marker("ray") else module)
        )
    items.sort(key=lambda item: _long_first(item.nodeid))  # stable: modules keep their order


@pytest.fixture(scope="session")
def engine_options(request: pytest.FixtureRequest) -> dict:
    """Engine options every engine test takes from the command line (unless it sets its own)."""
    options: dict = {}
    backend = request.config.getoption("--attention-backend")
    if backend:
        options["attention_backend"] = backend
    if request.config.getoption("--enforce-eager"):
        options["enforce_eager"] = True
    return options


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

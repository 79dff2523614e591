"""Large CPU buffers ask Linux for transparent huge pages (and can be told not to)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from infer.runner.attention import KVCache
from infer.runner.cpu import hugepages

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="transparent huge pages are Linux's, and this kernel is built without them",
)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture(autouse=True)
def _fresh_switch(monkeypatch):
    monkeypatch.delenv("INFER_HUGE_PAGES", raising=False)
    hugepages._madvise.cache_clear()
    yield
    hugepages._madvise.cache_clear()


def test_kv_cache_asks_for_huge_pages_and_starts_zeroed():
    cache = KVCache(2, 64, 16, 4, 64, torch.bfloat16, "cpu")  # 2 x 2 x 1024 x 4 x 64 x 2 B = 2 MiB
    assert cache.tensor.untyped_storage().nbytes() >= hugepages.HUGE_PAGE
    assert "hg" in _vm_flags(cache.tensor.data_ptr() + hugepages.HUGE_PAGE // 2)
    assert not cache.tensor.any()


def test_small_buffers_and_the_switch_leave_pages_alone(monkeypatch):
    small = hugepages.empty(1024, dtype=torch.bfloat16)
    assert not hugepages.advise_huge_pages(small)
    monkeypatch.setenv("INFER_HUGE_PAGES", "0")
    hugepages._madvise.cache_clear()
    assert hugepages._madvise() is None  # switched off: no madvise to call at all
    big = hugepages.zeros(64 << 20, dtype=torch.uint8)
    assert not hugepages.advise_huge_pages(big)
    # NOTE: the mapping's VmFlags are not checked: glibc carves even a 64 MiB buffer out of
    # the heap's free top when it is large enough (the engine's malloc tuning keeps up to 1 GiB
    # there), and that heap range may still carry an earlier advised buffer's flag (a full CI
    # run showed it).
    assert not big.any()

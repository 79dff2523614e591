"""Large CPU buffers on transparent huge pages, where Linux offers them.

The decode step streams the KV cache and every weight once per token. With 4 KiB pages that
stream needs a page-table walk every 4 KiB and the CPU's hardware prefetchers stop at every
page edge, which costs the most in the KV cache, read in scattered 24 KiB blocks. On 2 MiB
pages the same reads run faster (Zen 5, 16 sequences x 1,100 tokens, 12 layers of paged decode
attention: 17.4 -> 15.2 ms). ``madvise(MADV_HUGEPAGE)`` asks for them on a buffer before its
pages are first touched; where the kernel's policy is ``never`` (or on other systems) nothing
changes. ``INFER_HUGE_PAGES=0`` switches it off.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import cache

import torch

MADV_HUGEPAGE = 14
PAGE = 4096
HUGE_PAGE = 2 << 20


@cache
def _madvise():
    if sys.platform != "linux" or os.environ.get("INFER_HUGE_PAGES", "1") == "0":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under the whole pages of CPU tensor ``t``'s storage (at least one
    huge page's worth). Call it before the pages are first written. Returns whether asked."""
    madvise = _madvise()
    nbytes = t.untyped_storage().nbytes()
    if madvise is None or t.device.type != "cpu" or nbytes < HUGE_PAGE:
        return False
    start = t.untyped_storage().data_ptr()
    first, last = (start + PAGE - 1) // PAGE * PAGE, (start + nbytes) // PAGE * PAGE
    return madvise(first, last - first, MADV_HUGEPAGE) == 0


def empty(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty`` whose CPU storage sits on huge pages where the system allows."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros`` whose CPU storage sits on huge pages where the system allows."""
    return empty(*shape, dtype=dtype, device=device).zero_()

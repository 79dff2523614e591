"""Keep Python's cyclic garbage collector off the serving path.

A serving process holds a large start-up heap (torch, transformers, the model's modules, the
tokenizer): hundreds of thousands of objects that live as long as the process. Python's oldest
generation is collected whenever enough objects have survived younger collections, and each such
full collection walks that whole heap: ~150 ms on the ~110M benchmark model's engine process, a
stall that every stream sees as one long inter-token gap (and ~3% of a 5-second run's time in the
offline measurement that found it). Freezing the heap once start-up is done moves those objects
out of the collector's sight; the per-step garbage of serving is still collected as before.

Only long-lived serving processes freeze (the engine process and the HTTP server): a library
caller that builds and drops many engines in one process (``LLM`` in tests, notebooks) would keep
every frozen engine's reference cycles alive.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze every surviving object so later full
    collections skip it. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    """A serving process's start-up imports (torch, transformers, the app: ~350,000 objects)
    with the cyclic collector off; the heap they leave is then collected and frozen.

    With the collector on, every full collection the imports set off walked the growing heap
    of module objects, and those of the rest of start-up walked it again: ~0.5 s of the server
    process's start-up and ~0.3 s of the engine process's (2-core box, the test checkpoints).
    Only for stretches that import and read small files: cyclic garbage holding a large buffer
    (model weights, a KV cache) would live until the block ends.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        freeze_startup_heap()
    finally:
        if enabled:
            gc.enable()

"""The serving processes' start-up heap freeze (engine/heap.py)."""

from __future__ import annotations

import gc
import weakref

from infer.engine.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_garbage_is_collected_first_and_the_survivors_are_frozen():
    garbage, kept = _Node(), _Node()
    dead = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_heap()
        # A cycle that was already garbage is freed, not made immortal by the freeze...
        assert dead() is None
        # ...and what is still alive (this module's objects among them) is frozen. (The count is
        # not compared with a later gc.get_freeze_count(): other threads of the test process may
        # allocate between the two reads.)
        assert frozen > 1000
        assert not any(o is kept for o in gc.get_objects())  # out of the collector's sight
    finally:
        gc.unfreeze()  # the test process goes on collecting as usual
    assert any(o is kept for o in gc.get_objects())

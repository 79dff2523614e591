"""The serving processes' start-up heap freeze (engine/heap.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from infer.engine.heap import freeze_startup_heap, frozen_imports


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


def test_frozen_imports_pauses_the_collector_then_collects_and_freezes():
    assert gc.isenabled()
    try:
        with frozen_imports():
            assert not gc.isenabled()
            garbage, kept = _Node(), _Node()
            dead = weakref.ref(garbage)
            del garbage
        assert gc.isenabled()  # as it was before the block
        assert dead() is None  # collected at the end of the block...
        assert not any(o is kept for o in gc.get_objects())  # ...the survivors frozen
    finally:
        gc.unfreeze()
        gc.enable()


def test_frozen_imports_turns_the_collector_back_on_after_an_error():
    before = gc.get_freeze_count()
    with pytest.raises(ImportError), frozen_imports():
        raise ImportError("no such module")
    assert gc.isenabled()
    assert gc.get_freeze_count() == before  # a failed start-up freezes nothing

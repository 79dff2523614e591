"""``--cpu-bind``: which cores the engine's threads and the server get (engine/affinity.py)."""

from __future__ import annotations

import pytest

from infer.engine.affinity import CpuBinding, parse_cpu_list, plan_cpu_binding


def test_core_lists_parse_like_taskset():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("2, 0-1, 2") == [2, 0, 1]  # the first named core is the main thread's
    for bad in ("a", "3-1", "-1", "0-", ""):
        with pytest.raises(ValueError, match="--cpu-bind"):
            parse_cpu_list(bad)


def test_auto_gives_the_main_thread_the_first_core_and_shares_the_rest():
    assert plan_cpu_binding("auto", {0, 1}) == CpuBinding(0, frozenset({1}), frozenset({1}))
    four = plan_cpu_binding("auto", {4, 5, 6, 7})
    assert four == CpuBinding(4, frozenset({5, 6, 7}), frozenset({5, 6, 7}))
    assert four.num_threads == 4


def test_a_list_leaves_the_other_cores_to_the_server():
    plan = plan_cpu_binding("0-1", {0, 1, 2, 3})
    assert plan == CpuBinding(0, frozenset({1}), frozenset({2, 3}))
    assert plan.num_threads == 2


def test_nothing_to_bind_with_off_or_one_core():
    assert plan_cpu_binding("off", {0, 1}) is None
    assert plan_cpu_binding("auto", {3}) is None
    assert plan_cpu_binding("1", {0, 1}) is None


def test_cores_this_process_may_not_use_are_named():
    with pytest.raises(ValueError, match=r"core\(s\) 2, 3 are not available .* may use 0, 1"):
        plan_cpu_binding("0-3", {0, 1})

"""`infer serve --data-parallel-size N` never waits forever for its replicas: Serve's deploy
runs under a deadline, and a replica that can neither start nor fail ends start-up with an error
naming the setting to raise (the deploy itself is faked: no Ray cluster is started here)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("ray")

from infer.cluster.app import REPLICA_STARTUP_TIMEOUT_ENV, start_within  # noqa: E402


def test_a_deploy_that_never_returns_ends_at_the_deadline():
    t0 = time.monotonic()
    error = start_within(lambda: time.sleep(3600), 0.5, threading.Event())
    assert time.monotonic() - t0 < 5
    assert error is not None and "did not start within 0.5s" in error
    assert REPLICA_STARTUP_TIMEOUT_ENV in error


def test_a_deploy_that_fails_says_why_and_one_that_works_says_nothing():
    def broken():
        raise RuntimeError("replica-0: CUDA out of memory")

    assert start_within(broken, 10, threading.Event()) == (
        "the replicas could not start: replica-0: CUDA out of memory"
    )
    assert start_within(lambda: None, 10, threading.Event()) is None


def test_a_signal_during_start_up_stops_the_wait():
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    assert "stopped by a signal" in start_within(lambda: time.sleep(3600), 60, stop)
    assert time.monotonic() - t0 < 5

"""The server's inter-token-latency histogram takes a request's latencies in one call and is
exposed exactly as prometheus_client's own ``Histogram`` exposes the same values."""

from __future__ import annotations

import random
import threading

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from infer.core.outputs import RequestOutput
from infer.core.request import RequestTimings
from infer.server.metrics import _LATENCY_BUCKETS, ServerMetrics

NAME = "vllm:inter_token_latency_seconds"


def _samples(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == NAME:
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _finished(times: list[float]) -> RequestOutput:
    return RequestOutput("r", [1] * len(times), "", None, True, "length", None, 3, len(times), 0,
                         RequestTimings(arrival=0.0, first_scheduled=0.0, first_token=times[0],
                                        token_times=times, finished=times[-1]))  # fmt: skip


def test_the_latencies_of_finished_requests_are_exposed_as_a_histogram_exposes_them():
    rng = random.Random(0)
    # Values on bucket bounds (le is inclusive), between them, past the last, and 0.
    gaps = [rng.choice([0.0, 0.001, 0.005, 0.0123, 0.5, 640.0, 900.0, rng.random()])
            for _ in range(400)]  # fmt: skip
    metrics = ServerMetrics("tiny", 2048, stats=lambda: None)
    registry = CollectorRegistry()
    reference = Histogram(NAME, "Time between consecutive output tokens.", ["model_name"],
                          buckets=_LATENCY_BUCKETS, registry=registry)  # fmt: skip
    start = 0
    for n in (1, 7, 150, 243):  # requests of n latencies (n + 1 tokens)
        chunk = gaps[start : start + n]
        start += n
        times = [10.0]
        for g in chunk:
            times.append(times[-1] + g)
        metrics.observe_finished(_finished(times))
        for a, b in zip(times, times[1:], strict=False):
            reference.labels("tiny").observe(max(0.0, b - a))
    got = _samples(generate_latest(metrics.registry).decode())
    want = _samples(generate_latest(registry).decode())
    assert got.keys() == want.keys() and len(got) == len(_LATENCY_BUCKETS) + 3
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert got[(NAME + "_count", (("model_name", "tiny"),))] == 400


def test_a_scrape_during_observations_sees_whole_requests():
    """The counts a scrape reads are a request's all or none (the lock)."""
    metrics = ServerMetrics("tiny", 2048, stats=lambda: None)
    times = [float(i) * 0.002 for i in range(101)]  # 100 latencies a request
    stop = threading.Event()

    def observe() -> None:
        while not stop.is_set():
            metrics.observe_finished(_finished(times))

    thread = threading.Thread(target=observe)
    thread.start()
    try:
        for _ in range(50):
            got = _samples(generate_latest(metrics.registry).decode())
            assert got[(NAME + "_count", (("model_name", "tiny"),))] % 100 == 0
    finally:
        stop.set()
        thread.join()

"""Percentiles, latency summaries, TPOT/ITL definitions and goodput under an SLO."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from infer.bench.client import RequestRecord
from infer.bench.metrics import SLO, Dist, percentile, summarize


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 257])
@pytest.mark.parametrize("p", [0, 1, 25, 50, 90, 95, 99, 100])
def test_percentile_matches_numpy_linear(n, p):
    rng = random.Random(n * 1000 + p)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_percentile_small_cases():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_dist_converts_seconds_to_ms():
    d = Dist.of([0.1, 0.2, 0.3, 0.4])
    assert d.count == 4
    assert d.mean == pytest.approx(250.0)
    assert d.p50 == pytest.approx(250.0)
    assert d.max == pytest.approx(400.0)
    assert Dist.of([]).count == 0 and math.isnan(Dist.of([]).p99)


def rec(i, ttft, e2e, chunks, out_tokens=None, success=True, prompt_tokens=10):
    r = RequestRecord(i, 10, len(chunks), 0.0)
    r.ttft_s, r.e2e_s, r.chunk_times_s = ttft, e2e, list(chunks)
    r.output_tokens = out_tokens if out_tokens is not None else len(chunks)
    r.prompt_tokens = prompt_tokens
    r.success, r.usage_reported = success, True
    if not success:
        r.error = "x"
    return r


def test_itl_and_tpot_definitions():
    r = rec(0, 0.1, 0.5, [0.1, 0.2, 0.35, 0.5])
    assert r.itls_s == pytest.approx([0.1, 0.15, 0.15])
    assert r.tpot_s == pytest.approx((0.5 - 0.1) / 3)
    one = rec(1, 0.1, 0.1, [0.1])
    assert one.itls_s == [] and one.tpot_s is None


def test_summarize_counts_throughput_and_pools_itl():
    records = [
        rec(0, 0.1, 1.0, [0.1, 0.4, 0.7, 1.0]),
        rec(1, 0.2, 0.6, [0.2, 0.6], prompt_tokens=20),
        rec(2, None, None, [], out_tokens=0, success=False),
    ]
    m = summarize(records, duration_s=2.0)
    assert (m.configured, m.completed, m.errors, m.lost) == (3, 2, 1, 1)
    assert m.output_tokens == 6 and m.input_tokens == 30
    assert m.output_throughput == pytest.approx(3.0)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.ttft.count == 2 and m.ttft.p50 == pytest.approx(150.0)
    # pooled ITL: 0.3, 0.3, 0.3 from the first request, 0.4 from the second
    assert m.itl.count == 4
    assert m.itl.mean == pytest.approx(325.0)
    assert m.itl.p50 == pytest.approx(300.0)
    assert m.tpot.count == 2
    assert m.e2e.p50 == pytest.approx(800.0)
    assert m.slo is None and m.goodput_rps is None
    with pytest.raises(ValueError):
        summarize(records, 0.0)


def test_slo_parse():
    s = SLO.parse("ttft_ms=500, tpot_ms=50")
    assert s == SLO(ttft_ms=500.0, tpot_ms=50.0)
    assert s.describe() == "ttft_ms=500,tpot_ms=50"
    assert SLO.parse("") is None and SLO.parse(None) is None
    for bad in ("ttft=5", "ttft_ms", "ttft_ms=-1", "ttft_ms=nan", "e2e_ms=inf", "tpot_ms=x"):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_goodput_counts_only_requests_within_every_bound():
    fast = rec(0, 0.1, 0.4, [0.1, 0.2, 0.3, 0.4])  # ttft 100 ms, tpot 100 ms
    slow_first = rec(1, 0.9, 1.2, [0.9, 1.0, 1.1, 1.2])  # ttft 900 ms, tpot 100 ms
    slow_decode = rec(2, 0.1, 1.6, [0.1, 0.6, 1.1, 1.6])  # ttft 100 ms, tpot 500 ms
    one_token = rec(3, 0.2, 0.2, [0.2])  # no TPOT: cannot break a per-token bound
    failed = rec(4, None, None, [], out_tokens=0, success=False)
    records = [fast, slow_first, slow_decode, one_token, failed]
    slo = SLO(ttft_ms=500, tpot_ms=200)
    assert [slo.met_by(r) for r in records] == [True, False, False, True, False]
    m = summarize(records, duration_s=4.0, slo=slo)
    assert m.slo_met == 2
    assert m.goodput_rps == pytest.approx(0.5)
    assert m.goodput_tok_s == pytest.approx((4 + 1) / 4.0)
    assert m.slo == "ttft_ms=500,tpot_ms=200"
    e2e_only = summarize(records, 4.0, SLO(e2e_ms=1000))
    assert e2e_only.slo_met == 2  # fast (0.4 s) and one_token (0.2 s)

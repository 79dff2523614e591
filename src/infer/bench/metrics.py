"""Serving metrics from request records: throughput, latency percentiles, goodput under an SLO.

Definitions (those of vLLM's ``benchmark_serving``):

- TTFT: send -> first non-empty text chunk.
- ITL: gap between consecutive chunks, pooled over every request of the run.
- TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``.
- e2e latency: send -> end of stream.
- output throughput: output tokens of completed requests / run wall time (first send to last
  completion); request throughput: completed requests / wall time.
- goodput: completed requests meeting every SLO bound, per second (and their output tok/s).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infer.bench.client import RequestRecord

PERCENTILES = (50, 95, 99)


def percentile(values: Iterable[float], p: float) -> float:
    """The ``p``-th percentile of ``values``, ``p`` on the 0..100 scale (``percentile(xs, 99)``
    is P99), with linear interpolation between order statistics.

    The one percentile of every benchmark in :mod:`infer.bench`. Same definition and scale as
    ``numpy.percentile(values, p)`` (method "linear"): pass 95 for P95, not 0.95. NaN for no
    values; ``p`` outside 0..100 raises ``ValueError``.
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Dist:
    """Summary of one latency distribution, in milliseconds."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float

    @staticmethod
    def of(values_s: Iterable[float]) -> Dist:
        ms = [v * 1000.0 for v in values_s]
        if not ms:
            nan = math.nan
            return Dist(0, nan, nan, nan, nan, nan)
        return Dist(
            len(ms),
            sum(ms) / len(ms),
            percentile(ms, 50),
            percentile(ms, 95),
            percentile(ms, 99),
            max(ms),
        )


@dataclass(frozen=True)
class SLO:
    """Service-level bounds in milliseconds; ``None`` means unbounded."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @staticmethod
    def parse(text: str | None) -> SLO | None:
        """``"ttft_ms=500,tpot_ms=50"`` -> ``SLO(500, 50)``; empty -> ``None``."""
        if not text:
            return None
        bounds: dict[str, float] = {}
        for part in text.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in SLO.__dataclass_fields__:
                raise ValueError(f"bad SLO term {part!r}; use ttft_ms=..,tpot_ms=..,e2e_ms=..")
            try:
                bounds[key] = float(value)
            except ValueError:
                raise ValueError(f"SLO bound {key} must be a number, got {value!r}") from None
            if not 0 < bounds[key] < math.inf:  # (NaN fails too)
                raise ValueError(f"SLO bound {key} must be a positive number, got {value}")
        return SLO(**bounds)

    def met_by(self, rec: RequestRecord) -> bool:
        """Did a completed request stay within every bound?"""
        if not rec.success:
            return False
        checks = (
            ("ttft", self.ttft_ms, rec.ttft_s),
            ("tpot", self.tpot_ms, rec.tpot_s),
            ("e2e", self.e2e_ms, rec.e2e_s),
        )
        for name, bound, value_s in checks:
            if bound is None:
                continue
            if value_s is None:
                if name == "tpot":
                    continue  # a one-token answer has no TPOT: it cannot break a per-token bound
                return False
            if value_s * 1000.0 > bound:
                return False
        return True

    def describe(self) -> str:
        parts = [f"{k}={v:g}" for k, v in asdict(self).items() if v is not None]
        return ",".join(parts)


@dataclass(frozen=True)
class WorkloadMetrics:
    """Everything a report table shows for one workload run."""

    configured: int
    completed: int
    errors: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    output_throughput: float  # tok/s
    request_throughput: float  # req/s
    ttft: Dist
    itl: Dist
    tpot: Dist
    e2e: Dist
    usage_reported: bool  # every completed request had server-side token counts
    slo: str | None = None
    slo_met: int | None = None
    goodput_rps: float | None = None
    goodput_tok_s: float | None = None

    @property
    def lost(self) -> int:
        return self.configured - self.completed

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> WorkloadMetrics:
        def floats(cls: type, values: dict) -> dict:  # (NaN is saved as null)
            fields = cls.__dataclass_fields__
            return {k: math.nan if v is None and fields[k].type == "float" else v
                    for k, v in values.items() if k in fields}  # fmt: skip

        d = dict(d)
        for key in ("ttft", "itl", "tpot", "e2e"):
            d[key] = Dist(**floats(Dist, d[key]))
        d = floats(WorkloadMetrics, d)
        names = WorkloadMetrics.__dataclass_fields__
        return WorkloadMetrics(**{k: v for k, v in d.items() if k in names})


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None
) -> WorkloadMetrics:
    """Metrics of one run from its records and wall time."""
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    itls = [gap for r in ok for gap in r.itls_s]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    met = goodput_rps = goodput_tok = None
    if slo is not None:
        good = [r for r in ok if slo.met_by(r)]
        met = len(good)
        goodput_rps = met / duration_s
        goodput_tok = sum(r.output_tokens or 0 for r in good) / duration_s
    return WorkloadMetrics(
        configured=len(records),
        completed=len(ok),
        errors=sum(1 for r in records if not r.success),
        duration_s=duration_s,
        input_tokens=in_tokens,
        output_tokens=out_tokens,
        output_throughput=out_tokens / duration_s,
        request_throughput=len(ok) / duration_s,
        ttft=Dist.of(r.ttft_s for r in ok if r.ttft_s is not None),
        itl=Dist.of(itls),
        tpot=Dist.of(tpots),
        e2e=Dist.of(r.e2e_s for r in ok if r.e2e_s is not None),
        usage_reported=bool(ok) and all(r.usage_reported for r in ok),
        slo=slo.describe() if slo else None,
        slo_met=met,
        goodput_rps=goodput_rps,
        goodput_tok_s=goodput_tok,
    )

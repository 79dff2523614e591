"""Prometheus metrics under vLLM's names, so existing dashboards and benchmark clients read them.

Two sources:

- engine state (running/waiting requests, KV usage, token and cache counters) comes from the
  ``EngineStats`` snapshot the engine thread publishes after every step; a custom collector
  reads it at scrape time, so the values are never older than one step;
- per-request latencies and sizes are observed once, when a request finishes, from the
  timestamps the engine recorded for it (``RequestTimings``).

Every series carries a ``model_name`` label. Each app gets its own registry (no globals), so
several servers can live in one process (tests).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from infer.core.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
_REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip


def _token_buckets(max_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length."""
    out: list[float] = []
    base = 1
    while base <= max_len:
        for m in (1, 2, 5):
            if base * m <= max_len:
                out.append(float(base * m))
        base *= 10
    return out or [1.0]


class _EngineStatsCollector(Collector):
    """Gauges and monotone counters read from the latest engine stats snapshot."""

    def __init__(self, model_name: str, stats: Callable[[], Any]) -> None:
        self.model_name = model_name
        self.stats = stats

    def describe(self):
        return list(self._families(None))

    def collect(self):
        return self._families(self.stats())

    def _families(self, s):
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        get = lambda key: float(getattr(s, key, 0) or 0)  # noqa: E731
        yield gauge(
            "vllm:num_requests_running", "Requests in the running batch.", get("num_running")
        )
        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", get("num_waiting")
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", get("kv_usage")
        )
        yield gauge("infer:kv_cache_free_blocks", "Free KV cache blocks.", get("num_free_blocks"))
        yield gauge(
            "infer:kv_cache_total_blocks", "KV cache blocks in the pool.", get("num_total_blocks")
        )
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", get("prompt_tokens_total"))
        yield counter(
            "vllm:generation_tokens", "Generation tokens produced.", get("generation_tokens_total")
        )
        yield counter("vllm:num_preemptions", "Requests preempted.", get("num_preemptions_total"))
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            get("prefix_cache_queries_total"),
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            get("prefix_cache_hits_total"),
        )
        yield counter(
            "vllm:spec_decode_num_drafts",
            "Proposal runs verified (speculative decoding).",
            get("spec_decode_num_drafts_total"),
        )
        yield counter(
            "vllm:spec_decode_num_draft_tokens",
            "Proposed tokens verified (speculative decoding).",
            get("spec_decode_num_draft_tokens_total"),
        )
        yield counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Proposed tokens accepted (speculative decoding).",
            get("spec_decode_num_accepted_tokens_total"),
        )
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposed tokens by position in the proposal (0 = first).",
            labels=["model_name", "position"],
        )
        for position, n in enumerate(getattr(s, "spec_decode_accepted_per_position", ()) or ()):
            per_position.add_metric([self.model_name, str(position)], float(n))
        yield per_position
        load = getattr(s, "moe_expert_rows", ()) or ()
        if s is None or load:
            # A mixture of experts: which experts ran, on how many rows (layers x experts).
            rows = CounterMetricFamily(
                "infer:moe_expert_rows",
                "Rows (tokens) each expert of each sparse layer has run on since start-up.",
                labels=["model_name", "layer", "expert"],
            )
            for layer, counts in load:
                for expert, n in enumerate(counts):
                    rows.add_metric([self.model_name, str(layer), str(expert)], float(n))
            yield rows
        if s is None or getattr(s, "max_lora", 0):
            # vLLM's shape: the adapters in the labels, the sample's time as the value.
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "LoRA adapters of the running and waiting requests (comma-separated).",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            if s is not None:
                info.add_metric(
                    [str(s.max_lora), ",".join(s.running_lora_adapters),
                     ",".join(s.waiting_lora_adapters)],
                    time.time(),
                )  # fmt: skip
            yield info


class _ManyHistogram(Collector):
    """A histogram of one label set that takes many values in one call (``observe_many``).

    The inter-token latencies: a finished request brings one per output token, tens of
    thousands a second over a GPU's HTTP load; ``Histogram.observe`` takes ~2 us each (a lock
    and a bucket search per value) on the server's event loop. Here a value is one bisect and
    one list increment, and the exposition is ``Histogram``'s (cumulative ``_bucket`` series
    with ``le`` as it writes them, ``_count``, ``_sum``).
    """

    def __init__(self, name: str, doc: str, label: tuple[str, str], buckets: Iterable[float]):
        self.name, self.doc, self.label = name, doc, label
        self.bounds = [float(b) for b in buckets if b != float("inf")]  # (+Inf: added below)
        if self.bounds != sorted(set(self.bounds)):
            raise ValueError("histogram buckets must be in increasing order")
        self._counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()  # (a scrape may run on another thread)

    def observe_many(self, values: Iterable[float]) -> None:
        values = list(values)
        find, bounds = bisect.bisect_left, self.bounds
        slots = [find(bounds, v) for v in values]  # the first bound >= v: Prometheus' "le"
        with self._lock:
            counts = self._counts
            for i in slots:
                counts[i] += 1
            self._sum += sum(values)

    def describe(self):
        return [HistogramMetricFamily(self.name, self.doc, labels=[self.label[0]])]

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self.name, self.doc, labels=[self.label[0]])
        cumulative, running = [], 0
        for bound, n in zip([*self.bounds, float("inf")], counts, strict=True):
            running += n
            cumulative.append((floatToGoString(bound), running))
        family.add_metric([self.label[1]], cumulative, total)
        return [family]


class ServerMetrics:
    """The server's metrics registry; ``observe_finished`` is the engine's per-request hook."""

    def __init__(self, model_name: str, max_model_len: int, stats: Callable[[], Any],
                 counts_requests: bool = True) -> None:  # fmt: skip
        self.model_name = model_name
        # False on a disaggregated prefill replica: the request is counted (its tokens, its
        # latencies) where its reply comes from, the decode replica; summed over the replicas,
        # every split request counted twice, the prefill's one-token latencies mixed in.
        self.counts_requests = counts_requests
        disable_created_metrics()  # no *_created series (vLLM exports none either)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(model_name, stats))
        r, ln = self.registry, ["model_name"]
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", ln,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = _ManyHistogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive output tokens.",
            ("model_name", model_name), _LATENCY_BUCKETS,
        )  # fmt: skip
        r.register(self.itl)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", ln,
            buckets=_REQUEST_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled.", ln,
            buckets=_REQUEST_BUCKETS, registry=r,
        )  # fmt: skip
        buckets = _token_buckets(max_model_len)
        self.prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt length of finished requests.", ln,
            buckets=buckets, registry=r,
        )  # fmt: skip
        self.generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Output length of finished requests.", ln,
            buckets=buckets, registry=r,
        )  # fmt: skip
        for reason in ("stop", "length", "abort", "error"):  # export zeros from the start
            self.request_success.labels(model_name, reason)
        # What each API request finished as, as its client saw it: the one count of finished
        # requests (/metrics and /debug/engine both report it).
        self.finished: dict[str, int] = {}

    def observe_finished(self, out: RequestOutput) -> None:
        name = self.model_name
        reason = out.finish_reason or "error"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if not self.counts_requests:
            return
        self.request_success.labels(name, reason).inc()
        self.prompt_tokens.labels(name).observe(out.num_prompt_tokens)
        self.generation_tokens.labels(name).observe(out.num_output_tokens)
        t = out.timings
        if t is None:
            return
        if t.first_token is not None:
            self.ttft.labels(name).observe(max(0.0, t.first_token - t.arrival))
        times = t.token_times
        self.itl.observe_many(max(0.0, b - a) for a, b in zip(times, times[1:], strict=False))
        if t.finished is not None:
            self.e2e.labels(name).observe(max(0.0, t.finished - t.arrival))
        if t.first_scheduled is not None:
            self.queue_time.labels(name).observe(max(0.0, t.first_scheduled - t.arrival))

    def render(self) -> bytes:
        return generate_latest(self.registry)

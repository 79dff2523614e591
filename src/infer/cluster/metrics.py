"""The endpoint's ``/metrics``: the replicas' Prometheus texts merged into one.

Samples with the same name and labels are summed (counters, histogram buckets / sums / counts,
and gauges such as running requests or free KV blocks); gauges that are fractions of one
replica's capacity (``*_perc``, e.g. ``vllm:kv_cache_usage_perc``) are averaged instead, and
gauges whose value is the time they were taken (``vllm:lora_requests_info``) keep the latest.
No ray here, so the merge is unit-tested on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

_AVERAGED_SUFFIXES = ("_perc",)
_TIMESTAMP_GAUGES = frozenset({"vllm:lora_requests_info"})


def merge_metrics(texts: Sequence[str]) -> str:
    """One Prometheus text exposition summing (or averaging, see above) ``texts``' samples."""
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help), first seen order
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, (family.type, family.documentation))
            samples = values.setdefault(family.name, {})
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                samples.setdefault(key, []).append(s.value)
    lines: list[str] = []
    for name, (kind, doc) in families.items():
        lines.append(f"# HELP {name} {_escape_help(doc)}")
        lines.append(f"# TYPE {name} {kind}")
        average = kind == "gauge" and name.endswith(_AVERAGED_SUFFIXES)
        latest = name in _TIMESTAMP_GAUGES
        for (sample, labels), vs in values[name].items():
            value = max(vs) if latest else sum(vs) / len(vs) if average else sum(vs)
            label_text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
            braces = f"{{{label_text}}}" if label_text else ""
            lines.append(f"{sample}{braces} {floatToGoString(value)}")
    return "\n".join(lines) + ("\n" if lines else "")


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(doc: str) -> str:
    return doc.replace("\\", r"\\").replace("\n", r"\n")

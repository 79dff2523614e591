"""Engine micro-benchmarks (offline, no HTTP): KV cache, batching, chunked prefill, scheduling
and prefix caching, each as a table of named cases on a toy NanoGPT.

``infer bench micro kv-cache|batching|chunked-prefill|scheduling|prefix-cache|all`` runs them on
the toy NanoGPT (0.057M parameters, context 64): the built-in ``toy`` model when available, else a
random-init GPT-2 of the same shape. Each suite module has ``run(model, repeats, seed) -> dict``
(with a ``markdown`` entry).
"""

from __future__ import annotations

import importlib

SUITES = {
    "kv-cache": "benchmarks.micro.kv_cache",
    "batching": "benchmarks.micro.batching",
    "chunked-prefill": "benchmarks.micro.chunked_prefill",
    "scheduling": "benchmarks.micro.scheduling",
    "prefix-cache": "benchmarks.micro.prefix_cache",
}


def run_suite(name: str, model: str, repeats: int = 3, seed: int = 0) -> dict:
    """Run one suite by name; returns its result dict."""
    if name not in SUITES:
        raise ValueError(f"unknown micro suite {name!r}; choose {'|'.join(SUITES)}")
    return importlib.import_module(SUITES[name]).run(model, repeats=repeats, seed=seed)

"""The vocabulary every layer shares, with no torch: requests, sampling parameters, the step's
messages between scheduler and runner, and the outputs the engine emits.

Dependency arrows point down only::

    server/  llm.py
       │        │
    engine/ (scheduler, engine core, output processor)
       │             │
    kv_cache/     runner/ ── model/
       │             │
       └──── core/ ──┘        (this package: imports nothing of infer's but itself)
"""

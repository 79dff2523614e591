"""The studies and kernel micro-benchmarks of this checkout, beside their reports.

Each ``bench_<name>.py`` here reproduces one report (``reports/``) and owns its flags;
``infer bench <name> ...`` runs it (:func:`infer.bench.cli.checkout_benchmark` imports this
folder as the package ``benchmarks``), and so does ``python benchmarks/bench_<name>.py ...``.
They measure through the package's drivers (:mod:`infer.bench.offline`,
:mod:`infer.bench.online`, :mod:`infer.bench.report`); the package keeps the tools a user runs
against their own server or model (``infer bench serve``, ``vs-vllm``, ``engine``, ``gpu``...).
"""

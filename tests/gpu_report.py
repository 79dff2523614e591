"""``pytest -p tests.gpu_report``: each test's outcome and duration, and each failure's
traceback, appended to ``$INFER_TEST_REPORT`` as it happens, so a run cut short (a GPU machine's
time limit) still says what failed and why; ``scripts/gpu_check.sh`` loads it. With xdist the
controller writes (it receives every worker's reports)."""

from __future__ import annotations

import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("INFER_TEST_REPORT")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when != "call" and not (report.failed or report.skipped):
        return
    with open(path, "a") as f:
        f.write(f"{report.outcome:7} {report.duration:7.2f}s {report.when:8} {report.nodeid}\n")
        if report.failed:
            f.write(report.longreprtext[-4000:] + "\n\n")

"""launch_server: ready once /health answers 200; a server that exits first is reported with its
log and leaves nothing behind (the process group start_server/stop_server manage, tested in
test_bench_vs_vllm.py)."""

from __future__ import annotations

import sys

import pytest

from infer.bench.online import free_port, launch_server, port_is_free, stop_server

HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_healthy_server_is_returned_ready_and_stops(tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    proc, url = launch_server([sys.executable, "-c", HEALTHY, str(port)], port, log)
    try:
        assert url == f"http://127.0.0.1:{port}" and proc.poll() is None
    finally:
        stop_server(proc, port, grace_s=5)
    assert port_is_free(port)
    assert log.read_text().startswith("$ ")  # the command line first, then the output
    assert "serving" in log.read_text()


def test_a_server_that_exits_first_is_reported_with_its_log(tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"exited with 3 .*server\.log"):
        launch_server(cmd, port, log, timeout_s=30)
    assert "no model here" in log.read_text()


def test_cores_over_a_window_are_read_between_the_samples():
    """A process's CPU seconds at each end of a window fall between two samples: read linearly
    there, then divided by the window's length; a window the samples do not cover, or a
    process that could not be read, has no figure."""
    from infer.bench.online import cores_between

    # CPU seconds of "a" at t = 0, 1, 2: busy a quarter of a core, then a whole one.
    samples = [(0.0, {"a": 10.0, "b": None}), (1.0, {"a": 10.25, "b": None}),
               (2.0, {"a": 11.25, "b": None})]  # fmt: skip
    assert cores_between(samples, "a", 0.0, 1.0) == 0.25
    assert cores_between(samples, "a", 1.0, 2.0) == 1.0
    # 0.5 -> 1.5: 10.125 -> 10.75 over one second
    assert cores_between(samples, "a", 0.5, 1.5) == 0.625
    assert cores_between(samples, "a", 0.5, 2.5) is None  # past the last sample
    assert cores_between(samples, "a", 1.0, 1.0) is None
    assert cores_between(samples, "b", 0.0, 2.0) is None


def test_a_process_cpu_time_is_what_it_says_of_itself():
    import os
    import time

    from infer.bench.online import CpuPoller, process_cpu_s

    t = time.process_time()
    deadline = t + 0.2
    while time.process_time() < deadline:  # some CPU time to count
        pass
    got, t = process_cpu_s(os.getpid()), time.process_time()
    assert got is not None and abs(got - t) < 0.05  # /proc counts in ticks of 10 ms
    assert process_cpu_s(2**22 + 1) is None  # above Linux's highest pid: no such process
    with CpuPoller({"me": os.getpid()}, interval_s=0.01) as poller:
        time.sleep(0.05)
    assert len(poller.samples) >= 2
    start, end = poller.samples[0][0], poller.samples[-1][0]
    assert poller.cores(start, end)["me"] is not None


def test_the_metrics_poller_reads_gauges_over_a_window_and_histograms_over_the_load():
    """MetricsPoller against a /metrics page prometheus_client renders (the server's own
    exposition, labels per model): the running gauge's mean over a window of its reads, the
    latency histograms' means over what they counted between the first and last reads (not
    before: a warm-up), and a server gone: no reads, counted."""
    import http.server
    import threading
    import time

    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

    from infer.bench.online import MetricsPoller

    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "", ["model_name"], registry=registry)
    ttft = Histogram("vllm:time_to_first_token_seconds", "", ["model_name"], registry=registry)
    running.labels("a").set(3)
    running.labels("b").set(1)  # (summed over the labels: 4)
    ttft.labels("a").observe(5.0)  # before the load: not counted

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = generate_latest(registry)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        deadline = time.monotonic() + 30

        def wait_for(k: int) -> None:
            while len(poller.samples) < k:
                assert time.monotonic() < deadline, poller.errors
                time.sleep(0.01)

        with MetricsPoller(url, interval_s=0.01) as poller:
            wait_for(3)
            running.labels("a").set(7)  # 8 from now on
            ttft.labels("a").observe(0.010)
            ttft.labels("b").observe(0.030)
            wait_for(len(poller.samples) + 2)  # (the second read began after the change)
            start = time.perf_counter()
            wait_for(len(poller.samples) + 3)
            end = time.perf_counter()
    finally:
        server.shutdown()
        server.server_close()
    assert poller.first["vllm:num_requests_running"] == 4
    means = poller.gauge_means(start, end)
    assert means["running"] == 8 and means["waiting"] is None  # (the page has no such gauge)
    assert poller.gauge_means(0.0, poller.samples[0][0] - 1) == {"running": None, "waiting": None}
    got = poller.histogram_means_ms()
    assert got["ttft"] == pytest.approx(20.0) and got["e2e"] is None
    gone = MetricsPoller(url)
    assert gone.scrape() == {} and gone.errors == 1
    gone.last = poller.last  # (a first read that failed: no delta to take, no mean)
    assert gone.histogram_means_ms() == {"ttft": None, "queue": None, "e2e": None}


def test_the_gpu_utilization_poller_reads_nvidia_smi_over_a_window(tmp_path, monkeypatch):
    """GpuUtilPoller runs ``nvidia-smi --query-gpu=utilization.gpu ... -lms=N`` (here a script
    of that name printing what nvidia-smi prints, a line it cannot read among them) and means
    the samples read inside a window; without nvidia-smi on the PATH: no samples, None."""
    import time

    from infer.bench.online import GpuUtilPoller

    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in *utilization.gpu*--loop-ms=20*) ;; *) echo "bad args: $*"; exit 2;; esac\n'
        "echo 40; sleep 0.05; echo '[N/A]'; echo 60; sleep 0.05\n"
        "while true; do echo 90; sleep 0.02; done\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with GpuUtilPoller(interval_ms=20) as poller:
        deadline = time.monotonic() + 10
        settled = poller.SETTLE_S + 0.1  # (reads past the window's first, which are dropped)
        while time.monotonic() < deadline and (
            len(poller.samples) < 3 or poller.samples[-1][0] < poller.samples[0][0] + settled
        ):
            time.sleep(0.01)
    values = [v for _, v in poller.samples]
    assert values[:2] == [40.0, 60.0] and set(values[2:]) == {90.0}
    assert poller.unread == ["[N/A]"]
    first, last = poller.samples[0][0], poller.samples[-1][0]
    settled = [v for t, v in poller.samples if t >= first + poller.SETTLE_S]
    assert poller.mean(first, last) == sum(settled) / len(settled)  # (the first reads dropped)
    assert poller.mean(first - poller.SETTLE_S, last) == sum(values) / len(values)
    assert poller.mean(last + 1, last + 2) is None
    assert poller._proc.poll() is not None  # (stopped with the block)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with GpuUtilPoller() as none:
        pass
    assert none.samples == [] and none.mean(0.0, 1e9) is None
    fake.write_text(
        "#!/bin/sh\necho 'Failed to initialize NVML: Driver/library version mismatch'\n"
    )
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with GpuUtilPoller() as failing:
        deadline = time.monotonic() + 10
        while not failing.unread and time.monotonic() < deadline:
            time.sleep(0.01)
    assert failing.samples == [] and "Failed to initialize NVML" in failing.unread[-1]

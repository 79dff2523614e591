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

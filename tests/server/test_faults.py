"""Faults the server must survive without losing anything: a client that stops reading, and a
SIGTERM while a live view is connected.

The rest of the fault suite lives beside the code it exercises: a forward pass that raises
(test_failures.py), a step that raises (test_async_engine.py), SIGTERM under load within and
past the drain timeout (test_lifecycle.py), the engine process killed under load
(test_engine_process.py), overload (test_load.py), and the soak (test_soak.py).
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from tests.server.conftest import start_server

from infer.engine.core_loop import STEP_DELAY_ENV

LONG = 600  # tokens of the stalled stream: ~150 KB of SSE, more than the client ever reads early


def test_a_client_that_stops_reading_holds_up_nobody(llama_checkpoint, server_logs):
    """The engine never waits on a consumer: a stream whose client stops reading is generated
    to its end (what is buffered for it is bounded by its own max_tokens) while other requests
    are served; when the client reads again it gets every token, the usage and [DONE]."""
    for server in start_server(llama_checkpoint, server_logs, env={STEP_DELAY_ENV: "0.002"}):
        body = {"model": "tiny", "prompt": "Once", "max_tokens": LONG, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            # Read nothing more. Other clients are served meanwhile...
            with server.client() as c:
                for _ in range(3):
                    got = c.post("/v1/completions", json={"model": "tiny", "prompt": "Hi",
                                                          "max_tokens": 4}).json()  # fmt: skip
                    assert got["usage"]["completion_tokens"] == 4
            # ...and the engine finishes the stalled stream without its reader.
            deadline = time.monotonic() + 120
            while (stats := server.debug())["num_running"] or stats["num_waiting"]:
                assert time.monotonic() < deadline, stats
                time.sleep(0.05)
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
            events = [json.loads(x[6:]) for x in r.iter_lines()
                      if x.startswith("data: ") and x != "data: [DONE]"]  # fmt: skip
        text_chunks = [e for e in events if e["choices"]]
        assert sum(len(e["choices"][0]["text"]) > 0 for e in text_chunks) <= LONG
        assert events[-1]["usage"]["completion_tokens"] == LONG
        assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
        server.wait_idle()


def test_sigterm_with_a_live_view_open_exits_zero_at_once(llama_checkpoint, server_logs):
    gen = start_server(llama_checkpoint, server_logs)
    server = next(gen)
    try:
        events: list[str] = []

        def watch() -> None:
            with httpx.stream("GET", server.url + "/dashboard/events", timeout=30) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        viewer = threading.Thread(target=watch)
        viewer.start()
        deadline = time.monotonic() + 30
        while not events:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 < 10  # not held open by the event stream
        viewer.join(30)
        assert not viewer.is_alive()
        assert "Traceback" not in server.log()
    finally:
        gen.close()

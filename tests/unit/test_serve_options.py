"""`infer serve`'s own options refused before anything loads: one line naming the flag, exit 2
(argparse's or the server's), never a wrong setting taken (a port past 65535 wrapped round,
a zero queue that refused every request) nor an engine-process traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer.cli import main

SERVE = ["serve", "--model", "/no/such/model"]  # (every case stops before the model is read)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--port", "99999"], "argument --port: must be in 0..65535, got 99999"),
        (["--port", "http"], "argument --port: expected an integer, got 'http'"),
        (["--torch-threads", "0"], "argument --torch-threads: must be >= 1, got 0"),
        (["--request-timeout", "-1"], "argument --request-timeout: must be > 0, got -1"),
        (["--drain-timeout", "-5"], "argument --drain-timeout: must be >= 0, got -5"),
        (["--kv-cache-memory", "lots"], "cannot parse a byte size from 'lots'"),
        (["--max-request-bytes", "0"], "--max-request-bytes must be at least 1 byte"),
        (["--max-queued-requests", "0"], "max_queued_requests must be positive, got 0"),
        (["--max-wait-steps", "-1"], "max_wait_steps must be >= 0, got -1"),
        (["--swap-space=-1GiB"], "cannot parse a byte size from '-1GiB'"),
        (
            ["--override-generation-config", "{temp: 1}"],
            "--override-generation-config is not valid JSON",
        ),
        (
            ["--override-generation-config", '{"tempurature": 0.5}'],
            "--override-generation-config: unknown field(s) tempurature",
        ),
        (
            ["--preemption-mode", "swap", "--kv-cache-backend", "contiguous"],
            "--preemption-mode swap needs the paged KV cache (the contiguous KV backend",
        ),
        (
            ["--preemption-mode", "swap", "--no-kv-cache"],
            "--preemption-mode swap needs the paged KV cache (--no-kv-cache",
        ),
    ],
)
def test_bad_server_options_are_one_line_naming_them(extra, message, capsys, caplog):
    try:
        rc = main(SERVE + extra)
    except SystemExit as e:  # argparse
        rc = e.code
    said = capsys.readouterr().err + caplog.text
    assert rc == 2 and message in said, said
    assert "Traceback" not in said


def test_a_chat_template_that_does_not_compile_stops_the_start(tmp_path: Path, caplog):
    """Found at start-up, naming the flag and the line, rather than as a 400 blaming the
    messages of every chat request."""
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    assert main([*SERVE, "--chat-template", str(bad)]) == 2
    assert f"--chat-template {bad} is not a valid Jinja template: line 2:" in caplog.text


def test_a_port_in_use_or_a_host_that_does_not_resolve_stops_the_start_at_once(caplog):
    """Before the model loads (minutes for a big one), not after, as uvicorn would find it."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([*SERVE, "--port", str(port)]) == 2
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use (--port {port})" in (
        caplog.text
    )
    assert main([*SERVE, "--host", "0.0.0.0.0"]) == 2
    assert "--host '0.0.0.0.0' does not resolve" in caplog.text

"""Server-sent events: every event is one line to any line reader, whatever the text holds."""

from __future__ import annotations

import json

import httpx

from infer.server.serving import sse


def test_an_event_with_unicode_line_separators_stays_one_line():
    """U+0085, U+2028 and U+2029 are legal raw in JSON, but Python's splitlines (so httpx's
    iter_lines, and clients built on it) breaks lines there: a sampled token holding one cut
    its event in two (seen in a streaming test). They go out as JSON escapes."""
    text = "a\x85b\u2028c\u2029d\x1ce"
    payload = json.dumps({"choices": [{"text": text}]}, ensure_ascii=False)
    event = sse(payload)
    response = httpx.Response(200, content=event + b"data: [DONE]\n\n")
    lines = [line for line in response.iter_lines() if line]
    assert len(lines) == 2 and lines[1] == "data: [DONE]"
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == text

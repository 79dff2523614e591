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


def test_a_failure_while_rendering_an_event_ends_the_stream_with_an_error_event():
    """A bug while making an event (say, in a reply parser) gives the client an error event and
    ``[DONE]``, not a body cut short, and the engine requests are aborted."""
    import asyncio
    from types import SimpleNamespace

    from infer.core.outputs import RequestOutput
    from infer.server.serving import SSE_DONE, stream_events

    class Stream:
        request_ids = ["r0"]
        aborted = False

        async def __aiter__(self):
            yield 0, RequestOutput(request_id="r0", new_text="hi", new_token_ids=[5])

        def abort(self) -> None:
            self.aborted = True

    def render(index, out, usage):
        raise TypeError("unhashable type: 'list'")

    async def collect(stream) -> list[bytes]:
        req = SimpleNamespace(stream_options=None, n=1)
        return [e async for e in stream_events(None, req, None, stream, render, lambda u: b"")]

    stream = Stream()
    events = asyncio.run(collect(stream))
    assert events[-1] == SSE_DONE and stream.aborted
    error = json.loads(events[0].removeprefix(b"data: "))["error"]
    assert error["code"] == 500 and "TypeError: unhashable type" in error["message"]

"""Streamed events' JSON without pydantic in the per-token path.

A streamed completion sends one event per generated token, and building two pydantic models and
dumping them took ~13 us an event on this project's 2-core VM: at the tens of thousands of
tokens a second a GPU engine makes, the API server's one event loop spends most of its time
there. The envelope of a stream's events (id, object, created, model, ... ) never changes, so it
is dumped once by the response model itself, and each plain event's choice is written into it::

    envelope : {"id":"cmpl-1","object":"text_completion",...,"choices":[],"usage":null,...}
    event    : {"id":"cmpl-1","object":"text_completion",...,"choices":[ CHOICE ],"usage":null,...}

Only events with nothing but text (no logprobs, no usage, no tool calls) take this way; the rest
are dumped by their models as before. tests/unit/test_stream_json.py checks the bytes are the
models' own.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from infer.server.serving import sse

_EMPTY = '"choices":[]'


# ensure_ascii=False: non-ASCII text raw, as pydantic writes it. One encoder for every call:
# json.dumps with a non-default argument builds a new one each time.
_ENCODE = json.JSONEncoder(ensure_ascii=False).encode


def _json(value: object) -> str:
    return "null" if value is None else _ENCODE(value)


class EventTemplate:
    """One stream's events: ``response`` (its models' envelope, ``choices=[]``) dumped once."""

    def __init__(self, response: BaseModel) -> None:
        text = response.model_dump_json()
        head, sep, tail = text.partition(_EMPTY)
        if not sep or _EMPTY in tail:
            raise ValueError(f"not an envelope with one empty choices list: {text}")
        self._head = head + '"choices":['
        self._tail = "]" + tail

    def event(self, choice: str) -> bytes:
        """The SSE event of one choice's JSON."""
        return sse(self._head + choice + self._tail)


def completion_choice(
    index: int, text: str, finish_reason: str | None, stop_reason: int | str | None
) -> str:
    """A ``CompletionChoice`` of text only, as its model dumps it."""
    return (
        f'{{"index":{index},"text":{_json(text)},"logprobs":null,"prompt_logprobs":null,'
        f'"finish_reason":{_json(finish_reason)},"stop_reason":{_json(stop_reason)}}}'
    )


def chat_choice(
    index: int, content: str | None, finish_reason: str | None, stop_reason: int | str | None
) -> str:
    """A ``ChatStreamChoice`` whose delta is content only (or nothing), as its model dumps it."""
    delta = f'{{"content":{_json(content)}}}' if content is not None else "{}"
    return (
        f'{{"index":{index},"delta":{delta},"logprobs":null,'
        f'"finish_reason":{_json(finish_reason)},"stop_reason":{_json(stop_reason)}}}'
    )

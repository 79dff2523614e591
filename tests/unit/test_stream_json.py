"""The per-token events built from a template are byte for byte what the response models dump."""

from __future__ import annotations

import pytest

from infer.server.protocol import (
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from infer.server.serving import sse
from infer.server.stream_json import EventTemplate, chat_choice, completion_choice

TEXTS = [
    "",
    " hello",
    'quote " backslash \\ slash / tab \t newline \n return \r',
    "controls \x00 \x01 \x08 \x0c \x1f \x7f",
    "unicode héllo wörld 日本語 🙂",
    "line breaks \x85 \u2028 \u2029",
    "\ufffd",
]
ENDS = [(None, None), ("stop", None), ("stop", 7), ("stop", "</s>"), ("length", None)]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("finish", "stop"), ENDS)
def test_a_completion_event_is_the_models_own(text, finish, stop):
    template = EventTemplate(CompletionStreamResponse(id="cmpl-9", created=17, model="m/x",
                                                      choices=[]))  # fmt: skip
    want = CompletionStreamResponse(
        id="cmpl-9", created=17, model="m/x",
        choices=[CompletionChoice(index=3, text=text, finish_reason=finish, stop_reason=stop)],
    )  # fmt: skip
    assert template.event(completion_choice(3, text, finish, stop)) == sse(want.model_dump_json())


@pytest.mark.parametrize("content", [None, *TEXTS[1:]])
@pytest.mark.parametrize(("finish", "stop"), ENDS)
def test_a_chat_event_is_the_models_own(content, finish, stop):
    template = EventTemplate(ChatCompletionStreamResponse(id="chatcmpl-2", created=5, model="m",
                                                          choices=[]))  # fmt: skip
    want = ChatCompletionStreamResponse(
        id="chatcmpl-2", created=5, model="m",
        choices=[ChatStreamChoice(index=0, delta=DeltaMessage(content=content),
                                  finish_reason=finish, stop_reason=stop)],
    )  # fmt: skip
    assert template.event(chat_choice(0, content, finish, stop)) == sse(want.model_dump_json())


def test_an_envelope_needs_exactly_one_empty_choices_list():
    with pytest.raises(ValueError, match="not an envelope"):
        EventTemplate(CompletionStreamResponse(id="x", created=1, model="m",
                                               choices=[CompletionChoice(index=0, text="")]))  # fmt: skip

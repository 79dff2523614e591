"""The Responses and Messages APIs' requests as the chat requests that serve them: the
conversation each front builds, the switches it passes to the chat template, and the fields a
refusal names (no server: the requests' conversion only)."""

from __future__ import annotations

import pytest

from infer.server.chat import as_chat_request, renamed_params, template_kwargs
from infer.server.errors import APIError
from infer.server.messages import chat_request as messages_chat
from infer.server.messages_protocol import MessagesRequest
from infer.server.responses import chat_request as responses_chat
from infer.server.responses import input_messages
from infer.server.responses_protocol import ResponsesRequest


def _messages(**body):
    return messages_chat(MessagesRequest.model_validate({"max_tokens": 4, **body}))


def _roles(chat) -> list[tuple[str, str | None, int]]:
    return [(m.role, m.content, len(m.tool_calls or ())) for m in chat.messages]


def test_anthropic_turns_become_chat_messages():
    """System blocks and text blocks are paragraphs; an assistant's tool_use blocks are its
    calls (input as JSON arguments); a user's tool results come first, as tool messages (an
    error marked), then its text; two turns of one role are one."""
    chat = _messages(system=[{"type": "text", "text": "A."}, {"type": "text", "text": "B."}],
                     messages=[
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "21C"},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
             "content": [{"type": "text", "text": "down"}]},
            {"type": "text", "text": "Thanks"}]},
    ])  # fmt: skip
    assert _roles(chat) == [("system", "A.\n\nB.", 0), ("user", "Hi\n\nWeather?", 0),
                            ("assistant", "Looking.", 1), ("tool", "21C", 0),
                            ("tool", "Error: down", 0), ("user", "Thanks", 0)]  # fmt: skip
    call = chat.messages[2].tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("t1", "w",
                                                                      '{"city": "Paris"}')  # fmt: skip
    assert not chat.continue_final_message and chat.add_generation_prompt


def test_a_final_assistant_turn_is_continued_and_thinking_is_switched():
    chat = _messages(messages=[{"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Well,"}])  # fmt: skip
    assert chat.continue_final_message and not chat.add_generation_prompt
    for kind, enabled in (("disabled", False), ("enabled", True)):
        chat = _messages(messages=[{"role": "user", "content": "Hi"}],
                         thinking={"type": kind, "budget_tokens": 1024})  # fmt: skip
        assert chat.chat_template_kwargs == {"enable_thinking": enabled}
    chat = _messages(messages=[{"role": "user", "content": "Hi"}], tool_choice={"type": "any"},
                     tools=[{"name": "w", "input_schema": {"type": "object"}}])  # fmt: skip
    assert chat.tool_choice == "required"


def test_responses_input_items_become_chat_messages():
    """A function call joins the assistant message before it; its output is a tool message;
    reasoning items are left out; ``reasoning.effort`` reaches the template (``none``:
    thinking off), the request's own template arguments winning."""
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "21C"},
    ], "instructions": "Be brief.", "reasoning": {"effort": "none"}})  # fmt: skip
    messages = input_messages(req)
    assert [(m.role, m.content, len(m.tool_calls or ())) for m in messages] == [
        ("user", "Weather?", 0),
        ("assistant", "Looking.", 2),
        ("tool", "21C", 0),
    ]
    chat = responses_chat(req, messages)
    assert chat.reasoning_effort == "none"
    assert template_kwargs(chat) == {"enable_thinking": False}
    req = ResponsesRequest.model_validate({"input": "x", "reasoning": {"effort": "low"},
                                           "chat_template_kwargs": {"reasoning_effort": "high"}})  # fmt: skip
    chat = responses_chat(req, input_messages(req))
    assert template_kwargs(chat) == {"reasoning_effort": "high"}  # (the request's own wins)
    chat = as_chat_request({"messages": [{"role": "user", "content": "x"}],
                            "reasoning_effort": "low"})  # (the chat route's own field)  # fmt: skip
    assert template_kwargs(chat) == {"reasoning_effort": "low"}
    bad = ResponsesRequest.model_validate({"input": "x", "reasoning": {"effort": "low"},
                                           "chat_template_kwargs": ["x"]})  # fmt: skip
    with pytest.raises(APIError) as e:
        responses_chat(bad, input_messages(bad))
    assert e.value.status == 400 and e.value.param == "chat_template_kwargs"


@pytest.mark.parametrize("field", ["n", "use_beam_search", "echo", "prompt_logprobs"])
def test_a_one_reply_front_refuses_what_it_cannot_answer(field):
    value = {"n": 2, "use_beam_search": True, "echo": True, "prompt_logprobs": 1}[field]
    with pytest.raises(APIError, match="one reply") as e:
        as_chat_request({"messages": [{"role": "user", "content": "x"}], field: value})
    assert e.value.param == field


def test_a_refusal_names_the_field_as_the_front_does():
    with pytest.raises(APIError) as e, renamed_params({"max_completion_tokens": "max_tokens",
                                                       "stop": "stop_sequences"}):  # fmt: skip
        raise APIError(400, "reduce the prompt or max_completion_tokens; stop here",
                       param="max_completion_tokens")  # fmt: skip
    assert e.value.param == "max_tokens"
    assert e.value.message == "reduce the prompt or max_tokens; stop here"

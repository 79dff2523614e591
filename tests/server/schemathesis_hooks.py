"""Schemathesis hooks for the fuzzing test (loaded through ``SCHEMATHESIS_HOOKS``).

The published schema states every rule about one field's value. The few rules that relate two
fields' values are stated in it too (``if``/``then``), but schemathesis' coverage phase does not
honour those, and a JSON schema cannot compare two numbers at all; ``filter_failure`` lets a
400 for a body that breaks one of them pass, so that "a schema-valid request is never refused"
is checked on everything else.
"""

from __future__ import annotations

from typing import Any

import schemathesis


def _tool_name(tool: Any) -> str | None:
    """A chat tool's ``function.name``, or a Responses tool's own ``name``."""
    if not isinstance(tool, dict):
        return None
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    return name if isinstance(name, str) else None


def _tool_names(tools: Any) -> set[str]:
    if not isinstance(tools, list):
        return set()
    return {name for t in tools if (name := _tool_name(t)) is not None}


def _ints(*values: Any) -> bool:
    """All numbers (JSON Schema counts 5.0 as an integer)."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def breaks_a_cross_field_rule(body: dict) -> bool:
    text_1, text_2 = body.get("text_1"), body.get("text_2")
    num_2 = len(text_2) if isinstance(text_2, list) else 1
    if isinstance(text_1, list) and 1 < len(text_1) != num_2:
        return True  # /score: one text_1, or one per text_2
    if body.get("use_beam_search") is True:
        # refused with what needs sampled tokens (stream, logprobs, stop, best_of, tools, ...),
        # above 10 beams, or with a length the KV cache cannot give a beam
        return True
    n, best_of = body.get("n", 1), body.get("best_of")
    if _ints(n, best_of) and (best_of < n or (body.get("stream") is True and best_of > n)):
        return True  # best_of must be >= n, and == n when streaming
    prompt = body.get("prompt")
    prompts = 1
    if isinstance(prompt, list) and prompt and not all(_ints(t) for t in prompt):
        prompts = len(prompt)  # (a list of token ids is one prompt)
    choices = max(n, best_of) if _ints(n, best_of) else n
    if _ints(choices) and prompts * choices > 1024:
        return True  # at most 1024 sequences a request (prompts x n, or x best_of)
    min_tokens = body.get("min_tokens", 0)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if _ints(min_tokens, max_tokens) and min_tokens > max_tokens:
        return True
    if body.get("stream_options") is not None and body.get("stream") is not True:
        return True  # stream_options needs stream: true
    if body.get("continue_final_message") is True:
        # the two are exclusive; add_generation_prompt defaults to true (false on embeddings,
        # whose bodies this cannot tell apart: those cases are left out too)
        if body.get("add_generation_prompt", True):
            return True
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if not (isinstance(last, dict) and last.get("role") == "assistant"):
            return True  # it continues a final assistant message
    if body.get("task") == "token_classify" and (
        body.get("dimensions") is not None or body.get("normalize") is True
    ):
        return True  # a token classification is neither cut nor normalized (BGE-M3's /pooling)
    if body.get("bad_words") and body.get("allowed_token_ids"):
        return True  # bad words that ban every allowed id are refused (the tokenizer decides)
    top = body.get("top_logprobs")
    if _ints(top) and top >= 1 and body.get("logprobs") is not True and "messages" in body:
        return True
    tools = body.get("tools")
    if isinstance(tools, list) and len(_tool_names(tools)) < sum(
        isinstance(t, dict) for t in tools
    ):
        return True  # two tools with one name (or a nameless one)
    choice = body.get("tool_choice")
    if choice == "required" and not _tool_names(body.get("tools")):
        return True
    if isinstance(choice, dict):
        return _tool_name(choice) not in _tool_names(body.get("tools"))
    return _breaks_a_responses_rule(body)


def _breaks_a_responses_rule(body: dict) -> bool:
    """/v1/responses: a previous response must be stored here (no fuzzed id is), the input
    must hold something to answer (not only reasoning items), a json_schema format needs its
    schema."""
    if body.get("previous_response_id") is not None:
        return True
    items = body.get("input")
    if isinstance(items, list) and all(
        isinstance(i, dict) and i.get("type") == "reasoning" for i in items
    ):
        return True
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    return isinstance(fmt, dict) and fmt.get("type") == "json_schema" and fmt.get("schema") is None


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    """Keep every failure but a 400 for a body that breaks a rule between two fields (see
    above), and a prompt refused for not fitting the context or for making no token at all:
    how many tokens a text makes is the tokenizer's business, not something a schema can
    bound."""
    if response.status_code != 400:
        return True
    body = case.body
    if isinstance(body, dict) and breaks_a_cross_field_rule(body):
        return False
    return "context length" not in response.text and "the prompt is empty" not in response.text

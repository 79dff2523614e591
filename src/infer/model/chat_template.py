"""A conversation as the model's chat template writes it: one renderer for the server and the
offline API.

The messages are made what templates expect (as vLLM makes them): a tool call's ``arguments``
string becomes the object templates index into, and content given as a list of parts is passed
in the form the template reads. A template that loops over a message's content (Gemma 3's,
Llama 4's) gets the parts as a list of ``{"type": "text", "text": ...}`` (a plain string
content too, as one part); any other gets the parts' texts joined by new lines. The text the
template writes is then tokenized without adding special tokens (the template writes its own;
``add_special_tokens`` asks for them anyway, as vLLM's field does).
"""

from __future__ import annotations

import contextlib
import json
from functools import lru_cache
from typing import Any

from infer.core.sampling_params import InvalidRequestError

# Template arguments that the renderer sets itself: not settable through template kwargs.
RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "chat_template", "add_generation_prompt",
    "continue_final_message", "return_dict", "return_tensors", "padding", "truncation",
    "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask", "tools", "documents",
})  # fmt: skip


def render_chat_ids(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    image_token: str | None = None,
) -> list[int]:
    """Token ids of ``messages`` (``{"role", "content", ...}`` dicts) rendered by
    ``chat_template`` (default: the tokenizer's). Raises ``InvalidRequestError`` naming the
    field at fault: ``messages`` where the template cannot render them, ``continue_final_message``
    or ``chat_template_kwargs`` for inconsistent options.

    ``image_token``: a vision-language model's placeholder (None: the model reads no images,
    and an image part is refused). An image part (``image_url``, ``image``, ``image_pil``)
    reaches a template that loops over content as ``{"type": "image"}``; any other template
    gets the placeholder in its place among the texts."""
    kwargs = dict(template_kwargs or {})
    reserved = sorted(RESERVED_KWARGS & kwargs.keys())
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
        )
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt are exclusive; set "
            "add_generation_prompt to false",
            param="continue_final_message",
        )
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise InvalidRequestError(
            "continue_final_message needs a final assistant message", param="continue_final_message"
        )
    template = chat_template or getattr(tokenizer, "chat_template", None)
    parts_as_list = isinstance(template, str) and loops_over_content(template)
    converted = [_message(m, parts_as_list, image_token, i) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(
            converted,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            tools=tools,
            documents=documents,
            **kwargs,
        )
    except Exception as e:  # noqa: BLE001 - the template rejected these messages (jinja raise)
        raise InvalidRequestError(
            f"the chat template could not render these messages: {e}", param="messages"
        ) from e
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


IMAGE_PARTS = ("image_url", "image", "image_pil")


def _message(
    message: dict[str, Any], parts_as_list: bool, image_token: str | None, index: int
) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if v is not None}
    content = message.get("content")
    if isinstance(content, list):  # parts: [{"type": "text", "text": ...}, ...]
        parts: list[dict[str, str]] = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") in IMAGE_PARTS:
                if image_token is None:
                    raise InvalidRequestError(f"an {p['type']} part: this model reads no images",
                                              param=f"messages[{index}].content[{j}]")  # fmt: skip
                parts.append({"type": "image"})
                continue
            text = p.get("text") if isinstance(p, dict) else p
            if not isinstance(text, str):
                raise InvalidRequestError(
                    "message content parts must be text parts ({'type': 'text', 'text': ...})"
                    + (" or images" if image_token else ""),
                    param=f"messages[{index}].content[{j}]",
                )
            parts.append({"type": "text", "text": text})
        out["content"] = parts if parts_as_list else "\n".join(
            p["text"] if p["type"] == "text" else str(image_token) for p in parts)  # fmt: skip
    elif isinstance(content, str) and parts_as_list:
        out["content"] = [{"type": "text", "text": content}]
    elif content is None and "content" in message:  # (a tool-calling assistant turn's)
        out["content"] = ""
    if message.get("tool_calls"):
        out["tool_calls"] = [_tool_call(c) for c in message["tool_calls"]]
    return out


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """Templates index into the arguments (``arguments.items()``): give them the object."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # (not JSON: the template gets it)
            function["arguments"] = json.loads(arguments)
    return {**call, "type": call.get("type", "function"), "function": function}


@lru_cache(maxsize=16)
def loops_over_content(template: str) -> bool:
    """Whether the template iterates over a message's ``content`` (``{% for part in
    message['content'] %}``), so it reads content as a list of parts."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False

    def is_content(node: nodes.Node) -> bool:
        return any(
            (isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const)
             and n.arg.value == "content")
            or (isinstance(n, nodes.Getattr) and n.attr == "content")
            for n in [node, *node.find_all((nodes.Getitem, nodes.Getattr))]
        )  # fmt: skip

    return any(is_content(loop.iter) for loop in tree.find_all(nodes.For))


def message_images(messages: list[dict[str, Any]]) -> list[tuple[Any, str]]:
    """The images of ``messages``' image parts, in order (what each part holds: a URL, a PIL
    image, ...), as the template writes their placeholders, each with its place
    (``messages[i].content[j]``) for errors."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                image = url.get("url") if isinstance(url, dict) else url
            elif kind in IMAGE_PARTS:
                image = part.get(kind)
            else:
                continue
            out.append((image, f"messages[{i}].content[{j}].{kind}"))
    return out

"""How models write tool calls in free text (``tool_choice: "auto"``), by ``--tool-call-parser``.

- ``hermes`` (the default; Hermes, Qwen 2.5 / 3 templates): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks anywhere in the reply (parsed in ``tools.py``).
- ``llama3_json`` (Llama 3.1 / 3.2 templates): the whole reply is the calls, JSON objects
  ``{"name": ..., "parameters": {...}}`` separated by ``;``, after an optional
  ``<|python_tag|>``; a reply that does not start with one (``{``) is content.
- ``mistral`` (Mistral templates): content, then ``[TOOL_CALLS]`` and a JSON array of
  ``{"name": ..., "arguments": {...}}`` (Mistral 7B v0.3, Nemo, Small 3.0), or, in the newer
  tokenizers (Small 3.1 / 3.2, Magistral, Devstral), ``[TOOL_CALLS]name[ARGS]{...}`` for each
  call. ``[TOOL_CALLS]`` is a special token in Mistral's tokenizers, so with this parser a reply
  that may call tools keeps special tokens in its text; its calls get the 9-character
  alphanumeric ids Mistral's templates insist on.

- ``qwen3_coder`` (Qwen3-Coder's template): ``<tool_call>`` blocks as hermes', each holding
  ``<function=NAME>`` and a ``<parameter=KEY>`` element per argument, its value as raw text
  (a line break after the opening tag and before the closing one is the template's, not the
  value's), read as the tool's JSON schema types that argument (integer, number, boolean,
  null, object, array; a string, or a value that does not read as its type, as it is)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

A call names one of the request's tools and has an object for arguments (or a string holding
one); text that does not parse as calls is content, whole, as vLLM returns it.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import string
import uuid
from typing import Any

from infer.server.protocol import FunctionCall, ToolCall

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder")
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=text))


def call_from_json(data: Any, names: set[str]) -> ToolCall | None:
    """The call a decoded JSON object makes, or None when it makes none: not an object, a name
    that is not one of the tools', or arguments (``arguments`` or ``parameters``) that are not
    an object (nor a string holding one)."""
    if not isinstance(data, dict):
        return None
    name = data.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return make_call(name, arguments)


def may_start_llama3_calls(text: str) -> bool | None:
    """Whether a reply beginning with ``text`` is llama3_json calls: True, False, or None (too
    little text to tell: blank, or a piece of ``<|python_tag|>``)."""
    head = text.lstrip()
    if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
        return None
    return head.startswith("{") or head.startswith(PYTHON_TAG)


def parse_llama3_json(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply (see the module docstring)."""
    if not may_start_llama3_calls(text):
        return text, []
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :]
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(body) and body[i].isspace():
            i += 1
        try:
            data, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return text, []
        call = call_from_json(data, names)
        if call is None:
            return text, []
        calls.append(call)
        rest = body[i:].lstrip()
        if not rest:
            return None, calls
        if not rest.startswith(";"):
            return text, []
        i = len(body) - len(rest) + 1


def mistral_ids(calls: list[ToolCall]) -> list[ToolCall]:
    """The calls with ids as Mistral's chat templates take them back: 9 letters or digits
    (they refuse any other, so the next turn would not render)."""
    alphabet = string.ascii_letters + string.digits
    return [c.model_copy(update={"id": "".join(secrets.choice(alphabet) for _ in range(9))})
            for c in calls]  # fmt: skip


def parse_mistral(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply (see the module docstring)."""
    start = text.find(TOOL_CALLS)
    if start < 0:
        return text, []
    items: list[Any] = []
    for part in text[start:].split(TOOL_CALLS)[1:]:
        name, args, arguments = part.partition(ARGS)
        try:
            if args:  # name[ARGS]{...}
                items.append({"name": name.strip(), "arguments": json.loads(arguments)})
            else:  # [{...}, ...] (or one {...})
                data = json.loads(part)
                items.extend(data if isinstance(data, list) else [data])
        except json.JSONDecodeError:
            return text, []
    calls = [call_from_json(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return (text[:start].rstrip() or None), mistral_ids(calls)  # type: ignore[arg-type]


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def qwen3_coder_calls(body: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall]:
    """The calls a ``qwen3_coder`` block's body makes, one per ``<function=...>`` element
    (``schemas``: each tool's parameters schema by name); none where one names no tool (the
    block is then text)."""
    calls = []
    for name, inner in _FUNCTION.findall(body):
        name = name.strip()
        if name not in schemas:
            return []
        properties = schemas[name].get("properties")
        properties = properties if isinstance(properties, dict) else {}
        arguments = {}
        for key, raw in _PARAMETER.findall(inner):
            key = key.strip()
            value = raw[1:] if raw.startswith("\n") else raw
            value = value[:-1] if value.endswith("\n") else value
            arguments[key] = _typed(value, _types(properties.get(key)))
        calls.append(make_call(name, arguments))
    return calls


def _types(spec: Any) -> list[Any]:
    """The JSON types a parameter's schema allows (its ``type``, or its ``anyOf`` /
    ``oneOf`` branches' types: ``Optional[int]`` as pydantic writes it)."""
    if not isinstance(spec, dict):
        return []
    kind = spec.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for branch in (spec.get("anyOf") or []) + (spec.get("oneOf") or []):
        kinds += _types(branch)
    return kinds


def _typed(value: str, kinds: list[Any]) -> Any:
    """A parameter's text as the JSON schema types ``kinds`` read it: a string, a value of no
    known type, or one that does not read as its type, as it is; ``null`` as None for any
    type but a string."""
    text = value.strip()
    if text.lower() in ("null", "none") and kinds and kinds != ["string"]:
        return None
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "integer" in kinds or "number" in kinds:
        try:
            return int(text)  # (exact, however long)
        except ValueError:
            pass
        if "number" in kinds:
            try:
                number = float(text)
            except ValueError:
                number = math.nan
            if math.isfinite(number):  # (no NaN or infinity: they are not JSON)
                return number
    if "object" in kinds or "array" in kinds:
        try:
            decoded = json.loads(text)
        except json.JSONDecodeError:
            return value
        wanted = tuple(t for k, t in (("object", dict), ("array", list)) if k in kinds)
        if isinstance(decoded, wanted):
            return decoded
    return value

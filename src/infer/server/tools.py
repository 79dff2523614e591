"""Tool calls on /v1/chat/completions: ``tools``, ``tool_choice`` and the replies' ``tool_calls``.

- ``tool_choice: "none"`` (or no tools): a plain reply; the template still sees the tools.
- ``"auto"`` (the default with tools): the model decides. Its text is parsed for calls as
  ``--tool-call-parser`` says (``tool_formats.py``); by default as Hermes / Qwen chat templates
  ask for them::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  Text outside the blocks is the message content; a block that does not parse stays content.
- ``"required"``: the output is constrained (structured outputs) to a JSON array of calls, each
  ``{"name": <one of the tools>, "parameters": <arguments valid for that tool's schema>}``
  (one call when ``parallel_tool_calls`` is false).
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to the arguments
  of ``N``.

The last two cannot produce an invalid call: the grammar guarantees the names and arguments.
A reply with calls finishes with ``finish_reason: "tool_calls"``; one cut by ``max_tokens``
finishes with ``length`` and its text is returned as content, as it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infer.core.sampling_params import InvalidRequestError
from infer.core.structured import StructuredOutputs
from infer.server.protocol import (
    ChatCompletionRequest,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    NamedToolChoice,
    ToolCall,
)
from infer.server.tool_formats import (
    TOOL_CALLS,
    call_from_json,
    make_call,
    may_start_llama3_calls,
    mistral_ids,
    parse_llama3_json,
    parse_mistral,
    qwen3_coder_calls,
)
from infer.structured import compile_grammar

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolMode:
    """How this request's reply is turned into tool calls (see the module docstring)."""

    kind: str  # none | auto | required | named
    tools: tuple[ChatTool, ...] = ()
    name: str | None = None  # the function of a named tool_choice
    parser: str = "hermes"  # how an auto reply writes calls (tool_formats.TOOL_CALL_PARSERS)

    @property
    def constrained(self) -> bool:
        return self.kind in ("required", "named")


def tool_mode(req: ChatCompletionRequest, parser: str = "hermes") -> ToolMode:
    """The request's tool mode (``parser``: ``--tool-call-parser``); a 400
    (``InvalidRequestError``) for inconsistent fields."""
    tools = tuple(req.tools or ())
    choice = req.tool_choice
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InvalidRequestError(f"two tools are named {dup!r}", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {choice.function.name!r}, which is not among "
                f"the tools ({', '.join(names) or 'none given'})",
                param="tool_choice",
            )
        return ToolMode("named", tools, choice.function.name, parser=parser)
    if choice == "required" and not tools:
        raise InvalidRequestError('tool_choice "required" needs tools', param="tool_choice")
    if not tools or choice == "none":
        return ToolMode("none", tools, parser=parser)
    return ToolMode(choice or "auto", tools, parser=parser)


def tool_constraint(mode: ToolMode, parallel: bool) -> StructuredOutputs | None:
    """The structured-output constraint of a ``required`` or named tool choice."""
    if not mode.constrained:
        return None
    if mode.kind == "named":
        tool = next(t for t in mode.tools if t.function.name == mode.name)
        schema: dict[str, Any] = _parameters(tool)
    else:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    # (nested in the array's schema: its own "#/..." references re-rooted)
                    "parameters": _rerooted(
                        _parameters(t), f"#/items/anyOf/{i}/properties/parameters"
                    ),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for i, t in enumerate(mode.tools)
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
    spec = StructuredOutputs(json=schema, param="tools")
    compile_grammar(spec)  # a tool whose parameters are not a valid schema: a 400 here
    return spec


def _parameters(tool: ChatTool) -> dict[str, Any]:
    # A function without parameters takes none (as OpenAI reads an omitted schema).
    return tool.function.parameters or {"type": "object", "properties": {},
                                        "additionalProperties": False}  # fmt: skip


# Keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rerooted(schema: Any, base: str) -> Any:
    """``schema`` with its document-local references (``"#"``, ``"#/$defs/Address"``) made
    relative to ``base``, the JSON pointer where it sits inside a larger schema: a tool's
    ``$defs`` keep resolving once its parameters are nested in the ``required`` array."""
    if isinstance(schema, list):
        return [_rerooted(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rerooted(value, base)
    return out


def parse_reply(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished reply."""
    # (a constrained reply's calls, as the parser's format names them: Mistral's ids)
    named = mistral_ids if mode.parser == "mistral" else list
    if mode.kind == "named":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut by max_tokens: returned as it is
        assert mode.name is not None
        return None, named([make_call(mode.name, text)])
    if mode.kind == "required":
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, named([make_call(c["name"], c["parameters"]) for c in calls])
    if mode.kind == "auto":
        names = {t.function.name for t in mode.tools}
        if mode.parser == "llama3_json":
            return parse_llama3_json(text, names)
        if mode.parser == "mistral":
            return parse_mistral(text, names)
        return parse_hermes(text, names, block_parser(mode))
    return text, []


BlockParser = Callable[[str, set[str]], list[ToolCall]]


def block_parser(mode: ToolMode) -> BlockParser:
    """How a ``<tool_call>`` block's body makes calls in this mode: hermes' JSON (one), or
    ``qwen3_coder``'s ``<function=...>`` elements (typed by each tool's schema)."""
    if mode.parser != "qwen3_coder":
        return _hermes_calls
    schemas = {t.function.name: _parameters(t) for t in mode.tools}
    return lambda body, _names: qwen3_coder_calls(body, schemas)


def parse_hermes(text: str, names: set[str], parse_block: BlockParser | None = None
                 ) -> tuple[str | None, list[ToolCall]]:  # fmt: skip
    """Calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
    (``parse_block``: how a block's body makes calls, hermes' JSON by default).

    The content is the text outside the calls' blocks, less the whitespace next to each block
    (the line breaks a template writes around them); the stream gives the same content."""
    parse_block = parse_block or _hermes_calls
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        made = parse_block(match.group(1), names)
        if not made:
            continue
        before = text[last : match.start()]
        kept.append((before.lstrip() if calls else before).rstrip())
        last = match.end()
        calls.extend(made)
    if not calls:
        return text, []
    kept.append(text[last:].lstrip())
    return ("".join(kept) or None), calls


def _hermes_calls(body: str, names: set[str]) -> list[ToolCall]:
    """The call a block's JSON makes, none when it makes none (``call_from_json``)."""
    try:
        call = call_from_json(json.loads(body), names)
    except json.JSONDecodeError:
        return []
    return [] if call is None else [call]


@dataclass
class ToolStream:
    """Turns a streamed reply's text into content deltas and tool-call deltas.

    Constrained modes hold everything back and emit the calls when the reply ends (the
    arguments arrive whole, in one delta per call). Auto mode streams content as it comes,
    holding back only what could be the start of a ``<tool_call>`` block, and emits each
    block's call when the block closes.
    """

    mode: ToolMode
    text: str = ""
    sent: int = 0  # characters of ``text`` handled (emitted as content or consumed by calls)
    num_calls: int = 0
    calls: list[ToolCall] = field(default_factory=list)
    after_call: bool = False  # the unsent text follows a call's block
    is_call: bool | None = None  # llama3_json: whether the reply is calls (None: undecided)
    marker: int = -1  # mistral: where [TOOL_CALLS] is (-1: not yet seen in text[:scanned])
    scanned: int = 0
    parse_block: BlockParser | None = None  # (block_parser's, made on the first block)

    def feed(self, new_text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """The new content (what text there is, joined) and the new calls."""
        pieces = self.feed_pieces(new_text, finished)
        content = "".join(p for p in pieces if isinstance(p, str))
        return content, [p for p in pieces if not isinstance(p, str)]

    def feed_pieces(self, new_text: str, finished: bool) -> list[str | DeltaToolCall]:
        """The new content and calls in the order the reply wrote them (text after a call
        after it: what a front that answers in blocks needs, whatever the deltas' size)."""
        self.text += new_text
        if self.mode.constrained:
            if not finished:
                return []
            content, calls = parse_reply(self.mode, self.text)
            self.sent = len(self.text)
            return [content or "", *self._deltas(calls)]
        if self.mode.kind != "auto":
            out, self.sent = self.text[self.sent :], len(self.text)
            return [out]
        if self.mode.parser == "llama3_json":
            return self._feed_llama3(finished)
        if self.mode.parser == "mistral":
            return self._feed_mistral(finished)
        # Whitespace next to a call's block is not content (as in parse_hermes): trailing
        # whitespace waits until text follows it (or the reply ends without a call after it),
        # and whitespace after a call is dropped.
        content: list[str | DeltaToolCall] = []
        names = {t.function.name for t in self.mode.tools}
        if self.parse_block is None:
            self.parse_block = block_parser(self.mode)
        while True:
            rest = self.text[self.sent :]
            if self.after_call:
                stripped = rest.lstrip()
                self.sent += len(rest) - len(stripped)
                rest = stripped
                self.after_call = not rest
            start = rest.find(CALL_OPEN)
            if start < 0:
                if finished:
                    content.append(rest)
                    self.sent += len(rest)
                else:
                    self._emit(content, rest[: len(rest) - partial_suffix(rest, CALL_OPEN)])
                break
            end = rest.find(CALL_CLOSE, start)
            if end < 0:
                if finished:  # an unclosed block: it was text after all
                    content.append(rest)
                    self.sent += len(rest)
                else:
                    self._emit(content, rest[:start])
                break
            made = self.parse_block(rest[start + len(CALL_OPEN) : end].strip(), names)
            block_end = end + len(CALL_CLOSE)
            if not made:
                content.append(rest[:block_end])
            else:
                content.append(rest[:start].rstrip())
                content.extend(self._deltas(made))
                self.after_call = True
            self.sent += block_end
        return content

    def _feed_llama3(self, finished: bool) -> list[str | DeltaToolCall]:
        """A reply that may be calls (it opens with ``{`` or ``<|python_tag|>``) is held back
        whole until it ends; one that cannot be streams as content."""
        if self.is_call is None:  # (decided on the first characters, then kept)
            self.is_call = may_start_llama3_calls(self.text)
        if finished or self.is_call is False:
            return self._whole(finished)
        return []

    def _feed_mistral(self, finished: bool) -> list[str | DeltaToolCall]:
        """Content streams up to ``[TOOL_CALLS]`` (less its trailing whitespace, and what could
        be the marker's start); from the marker on, the calls are held back until the end."""
        if self.marker < 0:  # (looked for only where the new text could complete it)
            self.marker = self.text.find(TOOL_CALLS, max(0, self.scanned - len(TOOL_CALLS)))
            self.scanned = len(self.text)
        start = self.marker
        if finished:
            return self._whole(finished)
        rest = self.text[self.sent : start if start >= 0 else len(self.text)]
        if start < 0:
            rest = rest[: len(rest) - partial_suffix(rest, TOOL_CALLS)]
        content: list[str | DeltaToolCall] = []
        self._emit(content, rest)
        return content

    def _whole(self, finished: bool) -> list[str | DeltaToolCall]:
        """The unsent text: at the end, parsed as the whole reply is (content before the calls
        already sent), else as content."""
        if not finished:
            out, self.sent = self.text[self.sent :], len(self.text)
            return [out]
        content, calls = parse_reply(self.mode, self.text)
        if not calls:
            out, self.sent = self.text[self.sent :], len(self.text)
            return [out]
        unsent = (content or "")[self.sent :]
        self.sent = len(self.text)
        return [unsent, *self._deltas(calls)]

    def _emit(self, content: list[str | DeltaToolCall], text: str) -> None:
        """Send ``text`` (the start of the unsent text) less its trailing whitespace."""
        body = text.rstrip()
        content.append(body)
        self.sent += len(body)

    def _deltas(self, calls: list[ToolCall]) -> list[DeltaToolCall]:
        out = []
        for call in calls:
            out.append(DeltaToolCall(index=self.num_calls, id=call.id, type="function",
                                     function=DeltaFunctionCall(name=call.function.name,
                                                                arguments=call.function.arguments)))  # fmt: skip
            self.num_calls += 1
            self.calls.append(call)
        return out


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``: what a
    stream holds back in case the marker (a tag) is being written."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0

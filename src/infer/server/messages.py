"""``POST /v1/messages``: Anthropic's Messages API over the chat pipeline (what Anthropic's SDK
and the tools built on it, Claude Code among them, send to a local server).

A request becomes a chat request (:func:`chat_request`: ``system`` a system message; each
message's text blocks its content; an assistant's ``tool_use`` blocks its tool calls; a user's
``tool_result`` blocks tool messages before its text; ``tools`` as chat tools, ``tool_choice``
``auto`` / ``any`` / ``tool`` / ``none`` as ``auto`` / ``required`` / a named function / ``none``)
and runs as one (:mod:`infer.server.chat`); the reply comes back as content blocks::

    thinking   the thinking (--reasoning-parser; ``signature`` empty)
    text       the reply's text
    tool_use   each call: ``id``, ``name``, ``input`` (the arguments as an object)

with ``stop_reason`` ``end_turn``, ``max_tokens``, ``stop_sequence`` (and the sequence) or
``tool_use``. Streamed, Server-Sent Events with Anthropic's names: ``message_start``; per block
``content_block_start``, its deltas (``thinking_delta``, ``text_delta``, ``input_json_delta``)
and ``content_block_stop``; ``message_delta`` (stop reason, output tokens); ``message_stop``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.core.outputs import RequestOutput
from infer.server.chat import (
    ChatRun,
    as_chat_request,
    chat_prompt,
    renamed_params,
    submit_chat,
)
from infer.server.errors import APIError, internal_error
from infer.server.messages_protocol import (
    AnthropicMessage,
    AnthropicUsage,
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    MessagesResponse,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from infer.server.protocol import ChatCompletionRequest, ToolCall
from infer.server.reasoning import NO_PARSER, ReasoningStream
from infer.server.responses import new_item_id
from infer.server.serving import Serving, SSEResponse, cancel_on_disconnect, sse
from infer.server.tools import ToolStream

logger = logging.getLogger("infer.server")
# The chat request's fields a refusal may name, by their names here
_CHAT_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}
# Fields of the Messages API itself (not forwarded to the chat request as extensions)
_OWN_EXTRAS = {"thinking", "service_tier", "container", "mcp_servers", "context_management"}


def _text(content: list[TextBlock] | str) -> str:
    # (blocks are paragraphs: Claude Code sends its system prompt as several)
    return content if isinstance(content, str) else "\n\n".join(b.text for b in content)


def _joined(first: str | list[dict[str, Any]], then: str | list[dict[str, Any]]) -> Any:
    """Two turns' contents as one: texts as paragraphs; with images, the parts in order."""
    if isinstance(first, str) and isinstance(then, str):
        return "\n\n".join(t for t in (first, then) if t)

    def parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        if isinstance(content, list):
            return content
        return [{"type": "text", "text": content}] if content else []

    return parts(first) + parts(then)


def chat_messages(system: list[TextBlock] | str | None,
                  messages: list[AnthropicMessage]) -> list[dict[str, Any]]:  # fmt: skip
    """The conversation as chat messages (see the module docstring): a user turn's tool
    results first (tool messages, a failed one's output marked ``Error:``), then its text;
    consecutive turns of one role joined into one, as Anthropic's API joins them; thinking
    blocks left out, as chat templates leave earlier thinking out."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system)})
    for message in messages:
        blocks = message.content
        if isinstance(blocks, str):
            blocks = [TextBlock(type="text", text=blocks)]
        text = _text([b for b in blocks if isinstance(b, TextBlock)])
        content: str | list[dict[str, Any]] = text
        if any(isinstance(b, ImageBlock) for b in blocks):  # (its texts and images, in order)
            content = [{"type": "image_url", "image_url": {"url": b.source.as_url()}}
                       if isinstance(b, ImageBlock) else {"type": "text", "text": b.text}
                       for b in blocks if isinstance(b, ImageBlock | TextBlock)]  # fmt: skip
        turn: dict[str, Any] = {"role": message.role, "content": content}
        if message.role == "assistant":
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]  # fmt: skip
            if calls:
                turn["tool_calls"] = calls
        else:
            for b in blocks:
                if isinstance(b, ToolResultBlock):
                    result = ("Error: " if b.is_error else "") + _text(b.content)
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": result})  # fmt: skip
            if not content and any(isinstance(b, ToolResultBlock) for b in blocks):
                continue
        last = out[-1] if out else None
        if last is not None and last["role"] == turn["role"] != "tool":  # (one turn)
            last["content"] = _joined(last["content"], content)
            last["tool_calls"] = last.get("tool_calls", []) + turn.get("tool_calls", [])
            if not last["tool_calls"]:
                del last["tool_calls"]
            continue
        out.append(turn)
    return out


def chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that serves ``req`` (its vLLM sampling extensions passed on as they
    are: a bad one is a 400 naming it)."""
    extra = req.model_extra or {}
    body: dict[str, Any] = {k: v for k, v in extra.items() if k not in _OWN_EXTRAS}
    messages = chat_messages(req.system, req.messages)
    body |= {"model": req.model, "messages": messages}
    thinking = extra.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("enabled", "disabled"):  # (a hybrid model's switch: Qwen3's templates read it)
        own = body.get("chat_template_kwargs")  # (the request's own wins; not an object: a 400)
        if own is None or isinstance(own, dict):
            body["chat_template_kwargs"] = {"enable_thinking": kind == "enabled", **(own or {})}
    last = messages[-1]
    if last["role"] == "assistant" and last["content"] and "tool_calls" not in last:
        # (a reply begun for the model, Anthropic's "prefill": it goes on from there)
        body |= {"continue_final_message": True, "add_generation_prompt": False}
    if isinstance(req, MessagesRequest):
        body |= {"max_completion_tokens": req.max_tokens, "stop": req.stop_sequences,
                 "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}  # fmt: skip
        fmt = req.output_config.format if req.output_config is not None else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.schema_}}  # fmt: skip
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}}
            for t in req.tools]  # fmt: skip
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise APIError(400, 'tool_choice of type "tool" needs a name',
                               param="tool_choice.name")  # fmt: skip
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return as_chat_request(body)


# ---- the routes -----------------------------------------------------------------------------------


async def create_message(serving: Serving, req: MessagesRequest, raw: Request) -> Response:
    """``POST /v1/messages`` (see the module docstring)."""
    model = serving.check_model(req.model)
    chat = chat_request(req)
    with renamed_params(_CHAT_NAMES):
        # (Anthropic's clients ask for a large max_tokens whatever the model: Claude Code
        # 32k; cut to what the context leaves, the reply stops there with max_tokens)
        prompt = await chat_prompt(serving, chat, "/v1/messages", lengths="clamp")
        run = await submit_chat(serving, chat, raw, prompt, request_id=new_item_id("msg"))
    turn = MessageTurn(serving, run, model, raw)
    if req.stream:
        return SSEResponse(turn.events(), on_close=run.stream.abort)
    return await cancel_on_disconnect(raw, turn.collect())


async def count_tokens(serving: Serving, req: CountTokensRequest) -> JSONResponse:
    """``POST /v1/messages/count_tokens``: the tokens of the request's prompt, as the chat
    template writes it (its tools included; one longer than the context is counted too: a
    client asks to know whether to shorten it)."""
    serving.check_model(req.model)
    with renamed_params(_CHAT_NAMES):
        prompt = await chat_prompt(serving, chat_request(req), "/v1/messages/count_tokens",
                                   lengths="skip")  # fmt: skip
    return JSONResponse({"input_tokens": len(prompt.ids)})


def _tool_use(call: ToolCall) -> dict[str, Any]:
    """A call as a ``tool_use`` block (its arguments, an object; text that is not one is kept
    whole under ``arguments``)."""
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        args = {"arguments": call.function.arguments}
    return {"type": "tool_use", "id": call.id, "name": call.function.name, "input": args}


def _stop(final: RequestOutput, calls: bool) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished reply (None: it was aborted, by
    --request-timeout or a stopping server: the content so far, with no reason to give)."""
    if final.finish_reason == "abort":
        return None, None
    if final.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(final.stop_reason, str):
        return "stop_sequence", final.stop_reason
    return "end_turn", None


@dataclass
class MessageTurn:
    """One reply being generated, as content blocks as it streams (the same path whole:
    :meth:`collect` reads :meth:`events` to the end)."""

    serving: Serving
    run: ChatRun
    model: str
    raw: Request
    failure: APIError | None = None
    message: MessagesResponse | None = None  # (once finished)

    async def collect(self) -> Response:
        async for _ in self.events():
            pass
        if self.failure is not None:
            raise self.failure
        assert self.message is not None
        return JSONResponse(self.message.model_dump(mode="json"))

    def _fail(self, message: str, code: str) -> bytes:
        self.failure = APIError(500, message, type="server_error", code=code)
        return _event("error", error={"type": "api_error", "message": message})

    async def events(self) -> AsyncIterator[bytes]:
        """The reply as Anthropic's Server-Sent Events (the module docstring)."""
        blocks = _BlockStream()
        message = MessagesResponse(id=self.run.request_id, model=self.model, content=[],
                                   stop_reason=None, usage=AnthropicUsage(
                                       input_tokens=0, output_tokens=0))  # fmt: skip
        first = True
        thoughts = None if self.run.thinking is NO_PARSER else ReasoningStream(self.run.thinking)
        tools = ToolStream(self.run.mode)
        try:
            async for _, out in self.run.stream:
                if first:  # (the prompt's size is known with the first delta)
                    # (Anthropic counts the tokens read from the cache apart: the input is
                    # the sum of the two)
                    message.usage.input_tokens = out.num_prompt_tokens - out.num_cached_tokens
                    message.usage.cache_read_input_tokens = out.num_cached_tokens
                    yield _event("message_start", message=message.model_dump(mode="json"))
                    first = False
                if out.finish_reason == "error":
                    yield self._fail(f"the engine failed while serving this request: "
                                     f"{out.error}", "engine_error")  # fmt: skip
                    return
                text, thought = out.new_text, ""
                if thoughts is not None:
                    thought, text = thoughts.feed(text, out.finished)
                if thought:
                    for event in blocks.delta("thinking", thought):
                        yield event
                for piece in tools.feed_pieces(text, out.finished):  # (in the reply's order)
                    if not isinstance(piece, str):
                        for event in blocks.tool_use(_tool_use(tools.calls[piece.index])):
                            yield event
                    elif piece:
                        for event in blocks.delta("text", piece):
                            yield event
                if out.finished:
                    if not blocks.content:  # (nothing said: an empty text block)
                        for event in blocks.delta("text", ""):
                            yield event
                    for event in blocks.close():
                        yield event
                    stop, sequence = _stop(out, bool(tools.calls))
                    message.content, message.stop_reason = blocks.content, stop  # type: ignore[assignment]
                    message.stop_sequence = sequence
                    message.usage.output_tokens = out.num_output_tokens
                    self.message = message
                    self.raw.state.usage = (out.num_prompt_tokens, out.num_output_tokens)
                    yield _event("message_delta",
                                 delta={"stop_reason": stop, "stop_sequence": sequence},
                                 usage={"output_tokens": out.num_output_tokens})  # fmt: skip
                    yield _event("message_stop")
        except Exception as e:  # a bug while writing events: an error event, not a cut stream
            logger.exception("unhandled error while streaming a message")
            self.failure = internal_error(e)
            yield _event("error", error={"type": "api_error", "message": self.failure.message})
        finally:
            self.run.stream.abort()


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\n" + sse(json.dumps({"type": kind, **fields}))


class _BlockStream:
    """The content blocks of one reply (``content``, as the whole reply lists them): each
    started on its first delta and stopped when another block starts or the reply ends."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the open block (thinking or text)

    def delta(self, kind: str, piece: str) -> list[bytes]:
        events = []
        field = "thinking" if kind == "thinking" else "text"
        if self.open is None or self.open["type"] != kind:
            events = self.close()
            block = {"type": kind, field: ""} | ({"signature": ""} if kind == "thinking" else {})
            events.append(_event("content_block_start", index=len(self.content),
                                 content_block=dict(block)))  # fmt: skip
            self.content.append(block)
            self.open = block
        self.open[field] += piece
        delta = {"type": f"{field}_delta", field: piece}
        events.append(_event("content_block_delta", index=len(self.content) - 1, delta=delta))
        return events

    def tool_use(self, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        index = len(self.content)
        self.content.append(block)
        events.append(_event("content_block_start", index=index,
                             content_block=block | {"input": {}}))  # fmt: skip
        events.append(_event("content_block_delta", index=index, delta={
            "type": "input_json_delta", "partial_json": json.dumps(block["input"])}))  # fmt: skip
        events.append(_event("content_block_stop", index=index))
        return events

    def close(self) -> list[bytes]:
        """The open block's stop (none open: nothing)."""
        if self.open is None:
            return []
        index = len(self.content) - 1
        events = []
        if self.open["type"] == "thinking":  # (Anthropic's clients expect a signature)
            events.append(_event("content_block_delta", index=index,
                                 delta={"type": "signature_delta", "signature": ""}))  # fmt: skip
        self.open = None
        events.append(_event("content_block_stop", index=index))
        return events

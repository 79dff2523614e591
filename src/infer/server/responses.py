"""``POST /v1/responses``: OpenAI's Responses API over the chat pipeline.

A request becomes a chat request (:func:`chat_request`: ``instructions`` a system message, the
stored conversation of ``previous_response_id``, then the ``input`` items as messages, its tools
as chat tools, ``text.format`` as ``response_format``) and runs as one (:mod:`infer.server.chat`:
the chat template, tool calls, structured outputs, --reasoning-parser); its reply comes back as
output items::

    reasoning      the thinking (--reasoning-parser), as reasoning_text
    message        the reply's text, as output_text (with its logprobs where asked)
    function_call  each call (call_id, name, arguments), after the text

Streamed, the same items arrive as Server-Sent Events (``event: <type>`` and its JSON, numbered
by ``sequence_number``): ``response.created`` and ``response.in_progress``, then per item
``response.output_item.added``, its deltas (``response.reasoning_text.delta``,
``response.output_text.delta``, ``response.function_call_arguments.delta``) and their ``.done``
events, ``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it) with the whole response.

A response with ``store`` (the default) is kept in memory, the newest :data:`STORED` of them:
``GET /v1/responses/{id}`` answers it, ``DELETE`` forgets it, and ``previous_response_id``
continues its conversation (its input and output, but not its instructions, as OpenAI's).
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.core.outputs import RequestOutput
from infer.server.chat import (
    ChatRun,
    chat_logprobs,
    chat_prompt,
    final_reply,
    submit_chat,
)
from infer.server.errors import APIError, bad_request, validation_error
from infer.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallIn,
    ToolCall,
    ToolCallIn,
)
from infer.server.reasoning import NO_PARSER, ReasoningStream
from infer.server.responses_protocol import (
    FunctionCallInput,
    FunctionCallOutputInput,
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from infer.server.serving import Serving, SSEResponse, cancel_on_disconnect, sse
from infer.server.tools import ToolStream

STORED = 1024  # responses kept for previous_response_id / GET (the oldest forgotten first)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Responses API fields infer does not serve, whose values would change what is asked
_REFUSED = {"background": (None, False), "conversation": (None,), "prompt": (None,)}
# Fields of the Responses API itself (not forwarded to the chat request as extensions)
_OWN_EXTRAS = {"reasoning", "service_tier", "max_tool_calls", "prompt_cache_key",
               "safety_identifier", "stream_options", *_REFUSED}  # fmt: skip


@dataclass
class Stored:
    """A stored response and the conversation that continues it (messages, its output's
    included; its instructions not)."""

    response: dict[str, Any]
    messages: list[ChatMessage]


@dataclass
class ResponseStore:
    """The responses kept in memory, newest last (at most ``capacity``)."""

    capacity: int = STORED
    items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def put(self, response_id: str, stored: Stored) -> None:
        self.items[response_id] = stored
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        """The stored response (a 404, or a 400 naming ``param`` where a request's field names
        it, for one not kept)."""
        stored = self.items.get(response_id)
        if stored is None:
            raise APIError(404 if param is None else 400,
                           f"no response with id '{response_id}' is stored here (responses "
                           f"are kept in memory, the newest {self.capacity}, and only with "
                           "store: true)", param=param,
                           code="response_not_found")  # fmt: skip
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.items[response_id]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request as a chat request -------------------------------------------------------------


def input_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The ``input`` as chat messages: a string is one user message; a list's messages keep
    their role and text, a ``function_call`` joins the assistant message before it (or starts
    one), a ``function_call_output`` is a ``tool`` message; ``reasoning`` items are left out."""
    if isinstance(req.input, str):
        return [ChatMessage(role="user", content=req.input)]
    messages: list[ChatMessage] = []
    for item in req.input:
        if isinstance(item, InputMessage):
            text = item.content
            if not isinstance(text, str):
                text = "".join(part.text for part in text)
            messages.append(ChatMessage(role=item.role, content=text))
        elif isinstance(item, FunctionCallInput):
            call = ToolCallIn(id=item.call_id, function=FunctionCallIn(name=item.name,
                                                                      arguments=item.arguments))  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputInput):
            messages.append(ChatMessage(role="tool", content=item.output,
                                        tool_call_id=item.call_id))  # fmt: skip
    return messages


def chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that serves ``req`` (its vLLM sampling extensions passed on as they
    are: a bad one is a 400 naming it)."""
    extra = req.model_extra or {}
    for name, allowed in _REFUSED.items():
        if extra.get(name) not in allowed:
            raise bad_request(f"{name} is not supported by infer's /v1/responses", param=name)
    body: dict[str, Any] = {k: v for k, v in extra.items() if k not in _OWN_EXTRAS}
    body |= {
        "model": req.model,
        "messages": [m.model_dump(mode="json", exclude_none=True) for m in messages],
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "logprobs": wants_logprobs(req),
        "top_logprobs": req.top_logprobs if wants_logprobs(req) else None,
    }
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            mode="json", exclude_none=True, exclude={"type"})} for t in req.tools]  # fmt: skip
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = (choice if isinstance(choice, str) else
                               {"type": "function", "function": {"name": choice.name}})  # fmt: skip
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format json_schema needs a schema", param="text.format.schema")
        spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items()
                                                     if v is not None})  # fmt: skip
    except ValidationError as e:
        raise validation_error(e.errors()) from e


def wants_logprobs(req: ResponsesRequest) -> bool:
    return req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or ())


def _echo(req: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
    """The response as created: the request's settings echoed, nothing generated yet."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice
    return ResponseObject(
        id=response_id, status="in_progress", model=model, instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, metadata=req.metadata,
        parallel_tool_calls=req.parallel_tool_calls,
        previous_response_id=req.previous_response_id, temperature=req.temperature,
        top_p=req.top_p,
        text={"format": fmt.model_dump(mode="json", by_alias=True, exclude_none=True)
              if fmt is not None else {"type": "text"}},
        tool_choice=(choice if isinstance(choice, str) else
                     choice.model_dump(mode="json") if choice is not None else "auto"),
        tools=[t.model_dump(mode="json") for t in req.tools or ()],
        top_logprobs=req.top_logprobs, truncation=req.truncation or "disabled",
        store=req.store, user=req.user,
    )  # fmt: skip


# ---- the route ------------------------------------------------------------------------------------


async def create_response(serving: Serving, store: ResponseStore, req: ResponsesRequest,
                          raw: Request) -> Response:  # fmt: skip
    """``POST /v1/responses`` (see the module docstring)."""
    model = serving.check_model(req.model)
    history: list[ChatMessage] = []
    if req.previous_response_id is not None:
        history = list(store.get(req.previous_response_id, "previous_response_id").messages)
    new = input_messages(req)
    if not history and not new:
        raise bad_request("input has no message to answer", param="input")
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    chat = chat_request(req, system + history + new)
    prompt = await chat_prompt(serving, chat, "/v1/responses")
    run = await submit_chat(serving, chat, raw, prompt, prefix="resp")
    turn = Turn(serving, store, req, run, _echo(req, _id("resp"), model), history + new)
    if req.stream:
        return SSEResponse(turn.events(), on_close=run.stream.abort)
    return await cancel_on_disconnect(raw, turn.collect())


@dataclass
class Turn:
    """One response being generated: its reply turned into output items, streamed or whole,
    and stored when it ends."""

    serving: Serving
    store: ResponseStore
    req: ResponsesRequest
    run: ChatRun
    response: ResponseObject
    conversation: list[ChatMessage]

    async def collect(self) -> Response:
        text: list[str] = []
        logprobs: list = []
        final = None
        async for _, out in self.run.stream:
            text.append(out.new_text)
            logprobs.extend(out.new_logprobs)
            if out.finished:
                final = out
        assert final is not None
        if final.finish_reason == "error":
            raise APIError(500, f"the engine failed while serving this request: {final.error}",
                           type="server_error", code="engine_error")  # fmt: skip
        reasoning, content, calls = final_reply("".join(text), self.run)
        items: list[OutputItem] = []
        if reasoning:
            items.append(OutputReasoning(id=_id("rs"), status="completed",
                                         content=[ReasoningText(text=reasoning)]))  # fmt: skip
        if content or not (reasoning or calls):
            part = OutputText(text=content or "", logprobs=self._logprobs(logprobs))
            items.append(OutputMessage(id=_id("msg"), status=self._status(final),
                                       content=[part]))  # fmt: skip
        items.extend(_function_call(call) for call in calls)
        body = self._finish(final, items, reasoning or "")
        return JSONResponse(body)

    def _logprobs(self, lps: list) -> list[dict[str, Any]] | None:
        """The reply's tokens' log-probabilities as ``output_text.logprobs`` (None: not asked)."""
        if not wants_logprobs(self.req):
            return None
        chat = chat_logprobs(self.serving, lps, self.req.top_logprobs or 0)
        return [t.model_dump(mode="json") for t in chat.content or ()]

    @staticmethod
    def _status(final: RequestOutput) -> str:
        return "incomplete" if final.finish_reason == "length" else "completed"

    def _finish(self, final: RequestOutput, items: list[OutputItem],
                reasoning: str) -> dict[str, Any]:  # fmt: skip
        """The finished response (status, output, usage), stored if asked, as JSON."""
        response = self.response
        response.status = self._status(final)  # type: ignore[assignment]
        if response.status == "incomplete":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        response.output = items
        thought = len(self.serving.encode(reasoning)) if reasoning else 0
        response.usage = ResponseUsage(
            input_tokens=final.num_prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
            output_tokens=final.num_output_tokens,
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=min(thought, final.num_output_tokens)
            ),
            total_tokens=final.num_prompt_tokens + final.num_output_tokens,
        )
        body = response.model_dump(mode="json")
        if self.req.store:
            self.store.put(response.id, Stored(body, self.conversation + [_reply(items)]))
        return body

    async def events(self) -> AsyncIterator[bytes]:
        """The response as Server-Sent Events (the module docstring)."""
        stream = _EventStream()
        yield stream.event("response.created", response=self.response.model_dump(mode="json"))
        yield stream.event("response.in_progress",
                           response=self.response.model_dump(mode="json"))  # fmt: skip
        thoughts = None if self.run.thinking is NO_PARSER else ReasoningStream(self.run.thinking)
        tools = ToolStream(self.run.mode)
        reasoning: list[str] = []
        try:
            async for _, out in self.run.stream:
                if out.finish_reason == "error":
                    yield stream.event("error", code="engine_error", param=None,
                                       message=f"the engine failed while serving this request: "
                                               f"{out.error}")  # fmt: skip
                    self.response.status = "failed"  # type: ignore[assignment]
                    self.response.error = {"code": "server_error", "message": str(out.error)}
                    yield stream.event("response.failed",
                                       response=self.response.model_dump(mode="json"))  # fmt: skip
                    return
                text, thought = out.new_text, ""
                if thoughts is not None:
                    thought, text = thoughts.feed(text, out.finished)
                content, calls = tools.feed(text, out.finished)
                if thought:
                    reasoning.append(thought)
                    for event in stream.reasoning(thought):
                        yield event
                lps = self._logprobs(out.new_logprobs) or []
                if content or (lps and not calls):
                    for event in stream.text(content, lps):
                        yield event
                for call in calls:
                    for event in stream.call(call.id, call.function.name,
                                             call.function.arguments or ""):  # fmt: skip
                        yield event
                if out.finished:
                    if not stream.items:  # (nothing said: an empty message, as unstreamed)
                        for event in stream.text("", []):
                            yield event
                    for event in stream.close(self._status(out)):
                        yield event
                    body = self._finish(out, stream.items, "".join(reasoning))
                    kind = ("response.incomplete" if body["status"] == "incomplete" else
                            "response.completed")  # fmt: skip
                    yield stream.event(kind, response=body)
        finally:
            self.run.stream.abort()


def _function_call(call: ToolCall, status: str = "completed") -> OutputFunctionCall:
    return OutputFunctionCall(id=_id("fc"), call_id=call.id, name=call.function.name,
                              arguments=call.function.arguments, status=status)  # fmt: skip


def _reply(items: list[OutputItem]) -> ChatMessage:
    """The reply as the assistant message a next turn's prompt holds (its text and calls; the
    thinking left out)."""
    text = "".join(p.text for i in items if isinstance(i, OutputMessage) for p in i.content)
    calls = [ToolCallIn(id=i.call_id, function=FunctionCallIn(name=i.name, arguments=i.arguments))
             for i in items if isinstance(i, OutputFunctionCall)]  # fmt: skip
    return ChatMessage(role="assistant", content=text, tool_calls=calls or None)


class _EventStream:
    """Numbers the events of one streamed response and keeps its output items: each opened on
    its first delta (``output_item.added``, ``content_part.added``) and closed (the ``.done``
    events) when the next kind of item starts or the reply ends."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[OutputItem] = []
        self.open: OutputMessage | OutputReasoning | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + sse(json.dumps(body))

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.items.index(item)}

    def _start(self, item: OutputMessage | OutputReasoning) -> list[bytes]:
        events = self.close()
        self.items.append(item)
        self.open = item
        part = ({"type": "output_text", "text": "", "annotations": []}
                if isinstance(item, OutputMessage) else {"type": "reasoning_text", "text": ""})  # fmt: skip
        item_json = item.model_dump(mode="json") | {"content": []}
        events.append(self.event("response.output_item.added", item=item_json,
                                 output_index=len(self.items) - 1))  # fmt: skip
        events.append(self.event("response.content_part.added", **self._where(item),
                                 content_index=0, part=part))  # fmt: skip
        return events

    def reasoning(self, delta: str) -> list[bytes]:
        events = []
        if not isinstance(self.open, OutputReasoning):
            events = self._start(OutputReasoning(id=_id("rs"), status="in_progress",
                                                 content=[ReasoningText(text="")]))  # fmt: skip
        item = self.open
        assert isinstance(item, OutputReasoning)
        item.content[0].text += delta
        events.append(self.event("response.reasoning_text.delta", **self._where(item),
                                 content_index=0, delta=delta))  # fmt: skip
        return events

    def text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[bytes]:
        events = []
        if not isinstance(self.open, OutputMessage):
            events = self._start(OutputMessage(id=_id("msg"), status="in_progress",
                                               content=[OutputText(text="")]))  # fmt: skip
        item = self.open
        assert isinstance(item, OutputMessage)
        part = item.content[0]
        part.text += delta
        if logprobs:
            part.logprobs = (part.logprobs or []) + logprobs
        events.append(self.event("response.output_text.delta", **self._where(item),
                                 content_index=0, delta=delta, logprobs=logprobs))  # fmt: skip
        return events

    def call(self, call_id: str, name: str, arguments: str) -> list[bytes]:
        events = self.close()
        item = OutputFunctionCall(id=_id("fc"), call_id=call_id, name=name, arguments="",
                                  status="in_progress")  # fmt: skip
        self.items.append(item)
        where = self._where(item)
        events.append(self.event("response.output_item.added", item=item.model_dump(mode="json"),
                                 output_index=where["output_index"]))  # fmt: skip
        events.append(self.event("response.function_call_arguments.delta", **where,
                                 delta=arguments))  # fmt: skip
        item.arguments, item.status = arguments, "completed"
        events.append(self.event("response.function_call_arguments.done", **where, name=name,
                                 arguments=arguments))  # fmt: skip
        events.append(self.event("response.output_item.done", item=item.model_dump(mode="json"),
                                 output_index=where["output_index"]))  # fmt: skip
        return events

    def close(self, status: str = "completed") -> list[bytes]:
        """The ``.done`` events of the open item (none open: none)."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = self._where(item) | {"content_index": 0}
        if isinstance(item, OutputMessage):
            part = item.content[0]
            item.status = status  # type: ignore[assignment]
            events = [self.event("response.output_text.done", **where, text=part.text,
                                 logprobs=part.logprobs or [])]  # fmt: skip
        else:
            part = item.content[0]  # type: ignore[assignment]
            item.status = "completed"
            events = [self.event("response.reasoning_text.done", **where, text=part.text)]
        events.append(self.event("response.content_part.done", **where,
                                 part=part.model_dump(mode="json", exclude_none=True)))  # fmt: skip
        events.append(self.event("response.output_item.done", item=item.model_dump(mode="json"),
                                 output_index=where["output_index"]))  # fmt: skip
        return events

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
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.core.outputs import RequestOutput
from infer.server.chat import (
    ChatRun,
    as_chat_request,
    chat_logprobs,
    chat_prompt,
    renamed_params,
    submit_chat,
)
from infer.server.errors import APIError, bad_request, internal_error
from infer.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallIn,
    ImageUrl,
    ImageUrlContentPart,
    TextContentPart,
    ToolCallIn,
)
from infer.server.reasoning import NO_PARSER, ReasoningStream
from infer.server.responses_protocol import (
    FunctionCallInput,
    FunctionCallOutputInput,
    IncompleteDetails,
    InputImagePart,
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

logger = logging.getLogger("infer.server")
# The chat request's fields a refusal may name, by their names here
_CHAT_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input"}
STORED = 1024  # responses kept for previous_response_id / GET (the oldest forgotten first)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# A finish that is not a completion: its response's status
_STATUS = {"length": "incomplete", "abort": "failed"}
_ABORTED = ("the request ended before its reply did (its --request-timeout passed, or the "
            "server is stopping)")  # fmt: skip
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
    api_servers: int = 1  # --api-server-count: each process keeps the responses it served

    def put(self, response_id: str, stored: Stored) -> None:
        self.items[response_id] = stored
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        """The stored response (a 404, or a 400 naming ``param`` where a request's field names
        it, for one not kept)."""
        stored = self.items.get(response_id)
        if stored is None:
            where = ""
            if self.api_servers > 1:
                where = (f"; with --api-server-count {self.api_servers}, by the API server "
                         "process that served them")  # fmt: skip
            raise APIError(404 if param is None else 400,
                           f"no response with id '{response_id}' is stored here (responses "
                           f"are kept in memory, the newest {self.capacity}, and only with "
                           f"store: true{where})", param=param,
                           code="response_not_found")  # fmt: skip
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.items[response_id]


def new_item_id(prefix: str) -> str:
    """An id as OpenAI and Anthropic write theirs: ``<prefix>_<32 hex digits>``."""
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
            content: Any = item.content
            if not isinstance(content, str):
                if any(isinstance(part, InputImagePart) for part in content):
                    content = [  # (a vision-language model's images, among the texts)
                        ImageUrlContentPart(type="image_url",
                                            image_url=ImageUrl(url=part.image_url))
                        if isinstance(part, InputImagePart)
                        else TextContentPart(type="text", text=part.text)
                        for part in content
                    ]  # fmt: skip
                else:
                    content = "".join(part.text for part in content)  # type: ignore[union-attr]
            messages.append(ChatMessage(role=item.role, content=content))
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


def front_messages(req: ResponsesRequest, history: list[ChatMessage] | None = None,
                   new: list[ChatMessage] | None = None) -> list[ChatMessage]:  # fmt: skip
    """The conversation a response answers: ``instructions`` (a system message), the stored
    ``history`` of its previous response, then its input (``new``: :func:`input_messages`)."""
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    return system + (history or []) + (input_messages(req) if new is None else new)


def chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that serves ``req`` (its vLLM sampling extensions passed on as they
    are: a bad one is a 400 naming it)."""
    extra = req.model_extra or {}
    for name, allowed in _REFUSED.items():
        if extra.get(name) not in allowed:
            raise bad_request(f"{name} is not supported by infer's /v1/responses", param=name)
    body: dict[str, Any] = {k: v for k, v in extra.items() if k not in _OWN_EXTRAS}
    reasoning = extra.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if isinstance(effort, str):  # (the chat route's reasoning_effort: chat.template_kwargs)
        body["reasoning_effort"] = effort
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
    return as_chat_request(body)


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
    chat = chat_request(req, front_messages(req, history, new))
    response_id = new_item_id("resp")
    with renamed_params(_CHAT_NAMES):
        prompt = await chat_prompt(serving, chat, "/v1/responses")
        run = await submit_chat(serving, chat, raw, prompt, request_id=response_id)
    turn = Turn(serving, store, req, run, _echo(req, response_id, model), history + new, raw)
    if req.stream:
        return SSEResponse(turn.events(), on_close=run.stream.abort)
    return await cancel_on_disconnect(raw, turn.collect())


@dataclass
class Turn:
    """One response being generated: its reply turned into output items as it streams (the
    same path whole: :meth:`collect` reads :meth:`events` to the end), and stored when it
    ends."""

    serving: Serving
    store: ResponseStore
    req: ResponsesRequest
    run: ChatRun
    response: ResponseObject
    conversation: list[ChatMessage]
    raw: Request
    failure: APIError | None = None

    async def collect(self) -> Response:
        async for _ in self.events():
            pass
        if self.failure is not None:
            raise self.failure
        return JSONResponse(self.response.model_dump(mode="json"))

    def _logprobs(self, lps: list) -> list[dict[str, Any]]:
        """Tokens' log-probabilities as ``output_text.logprobs`` (none: not asked)."""
        if not lps or not wants_logprobs(self.req):
            return []
        chat = chat_logprobs(self.serving, lps, self.req.top_logprobs or 0)
        return [t.model_dump(mode="json") for t in chat.content or ()]

    def _finish(self, final: RequestOutput, items: list[OutputItem], reasoning: str) -> None:
        """The response finished: status, output, usage; stored if asked."""
        response = self.response
        response.status = _STATUS.get(final.finish_reason or "", "completed")  # type: ignore[assignment]
        if final.finish_reason == "length":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        elif final.finish_reason == "abort":
            response.error = {"code": "aborted", "message": _ABORTED}
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
        self.raw.state.usage = (final.num_prompt_tokens, final.num_output_tokens)
        if self.req.store and response.status != "failed":
            body = response.model_dump(mode="json")
            self.store.put(response.id, Stored(body, self.conversation + [_reply(items)]))

    async def events(self) -> AsyncIterator[bytes]:
        """The response as Server-Sent Events (the module docstring)."""
        stream = _EventStream()
        response = self.response
        yield stream.event("response.created", response=response.model_dump(mode="json"))
        yield stream.event("response.in_progress", response=response.model_dump(mode="json"))
        thoughts = None if self.run.thinking is NO_PARSER else ReasoningStream(self.run.thinking)
        tools = ToolStream(self.run.mode)
        reasoning: list[str] = []
        held: list = []  # logprobs of tokens whose text is not out yet (thinking, a call's)
        try:
            async for _, out in self.run.stream:
                if out.finish_reason == "error":
                    message = f"the engine failed while serving this request: {out.error}"
                    self.failure = APIError(500, message, type="server_error",
                                            code="engine_error")  # fmt: skip
                    for event in stream.close("incomplete"):
                        yield event
                    yield stream.event("error", code="engine_error", message=message, param=None)
                    response.status, response.output = "failed", stream.items  # type: ignore[assignment]
                    response.error = {"code": "server_error", "message": message}
                    yield stream.event("response.failed", response=response.model_dump(mode="json"))
                    return
                text, thought = out.new_text, ""
                if thoughts is not None:
                    thought, text = thoughts.feed(text, out.finished)
                held.extend(out.new_logprobs)
                if thought:
                    reasoning.append(thought)
                    for event in stream.reasoning(thought):
                        yield event
                for piece in tools.feed_pieces(text, out.finished):  # (in the reply's order)
                    if isinstance(piece, str):
                        if piece:
                            for event in stream.text(piece, self._logprobs(held)):
                                yield event
                            held = []
                        continue
                    call = piece.function
                    assert call is not None
                    for event in stream.call(piece.id or "", call.name or "",
                                             call.arguments or ""):  # fmt: skip
                        yield event
                if out.finished:
                    if not stream.items:  # (nothing said: an empty message)
                        for event in stream.text("", self._logprobs(held)):
                            yield event
                    elif held:  # (the last tokens' logprobs go with the text there is)
                        stream.add_logprobs(self._logprobs(held))
                    status = "incomplete" if out.finish_reason in _STATUS else "completed"
                    for event in stream.close(status):
                        yield event
                    self._finish(out, stream.items, "".join(reasoning))
                    kind = {"incomplete": "response.incomplete", "failed": "response.failed"}
                    yield stream.event(kind.get(response.status, "response.completed"),
                                       response=response.model_dump(mode="json"))  # fmt: skip
        except Exception as e:  # a bug while writing events: an error event, not a cut stream
            logger.exception("unhandled error while streaming a response")
            self.failure = internal_error(e)
            yield stream.event("error", code="server_error", message=self.failure.message,
                               param=None)  # fmt: skip
        finally:
            self.run.stream.abort()


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
            events = self._start(OutputReasoning(id=new_item_id("rs"), status="in_progress",
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
            events = self._start(OutputMessage(id=new_item_id("msg"), status="in_progress",
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
        # (an open message stays open: text after a call goes on in it, as a whole reply's
        # parse joins the text around its calls)
        events = self.close() if isinstance(self.open, OutputReasoning) else []
        item = OutputFunctionCall(id=new_item_id("fc"), call_id=call_id, name=name, arguments="",
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

    def add_logprobs(self, logprobs: list[dict[str, Any]]) -> None:
        """Log-probabilities of tokens that made no text, to the reply's message."""
        message = next((i for i in reversed(self.items) if isinstance(i, OutputMessage)), None)
        if message is not None and logprobs:
            message.content[0].logprobs = (message.content[0].logprobs or []) + logprobs

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
            item.status = status  # type: ignore[assignment]
            events = [self.event("response.reasoning_text.done", **where, text=part.text)]
        events.append(self.event("response.content_part.done", **where,
                                 part=part.model_dump(mode="json", exclude_none=True)))  # fmt: skip
        events.append(self.event("response.output_item.done", item=item.model_dump(mode="json"),
                                 output_index=where["output_index"]))  # fmt: skip
        return events

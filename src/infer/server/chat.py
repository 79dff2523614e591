"""``POST /v1/chat/completions``: messages rendered with the chat template, reply streamed or not."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.core.beam_search import beam_text
from infer.core.kv_transfer import KV_TRANSFER_SCOPE_KEY
from infer.core.multimodal import ImageInput
from infer.core.outputs import RequestOutput
from infer.core.request import TokenLogprob
from infer.core.sampling_params import InvalidRequestError, SamplingParams
from infer.core.structured import StructuredOutputs
from infer.engine.async_engine import RequestStream
from infer.model.chat_template import message_images, render_chat_ids
from infer.model.images import MAX_IMAGES_PER_PROMPT
from infer.server import beam
from infer.server.errors import APIError, bad_request, from_invalid_request, validation_error
from infer.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    ImageUrlContentPart,
    TokenizeRequest,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from infer.server.reasoning import (
    NO_PARSER,
    ReasoningStream,
    Thinking,
    split_reasoning,
    starts_thinking,
)
from infer.server.serving import (
    Choices,
    Serving,
    SSEResponse,
    cancel_on_disconnect,
    new_id,
    raise_if_failed,
    sse,
    stream_events,
    usage_totals,
)
from infer.server.stream_json import EventTemplate, chat_choice
from infer.server.tools import (
    ToolMode,
    ToolStream,
    parse_reply,
    tool_constraint,
    tool_mode,
)


def render_chat(serving: Serving, messages: list[ChatMessage], *, add_generation_prompt: bool,
                continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None,
                documents: list[dict[str, Any]] | None = None,
                add_special_tokens: bool = False) -> list[int]:  # fmt: skip
    """Token ids of the conversation as the model's chat template (or --chat-template) writes it
    (:func:`infer.model.chat_template.render_chat_ids`, as the offline API renders it)."""
    template = serving.settings.chat_template
    tok = serving.tokenizer
    if template is None and not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; start the server with "
                          "--chat-template FILE or use /v1/completions", param="messages")  # fmt: skip
    vision = getattr(serving, "image_prompts", None)  # (the router renders with less)
    try:
        return render_chat_ids(
            tok, [{"content": None, **m.model_dump(mode="json", exclude_none=True)}
                  for m in messages],
            chat_template=template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, add_special_tokens=add_special_tokens,
            tools=tools, documents=documents, template_kwargs=kwargs,
            image_token=None if vision is None else vision.token,
        )  # fmt: skip
    except InvalidRequestError as e:
        raise from_invalid_request(e) from e


def render_request(serving: Serving, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    """A chat request's (or a /tokenize request's) prompt ids: its messages, tools, documents
    and template options, rendered as :func:`render_chat` does; the same ids either way."""
    tools = [t.model_dump(mode="json", exclude_none=True) for t in body.tools or ()]
    return render_chat(serving, body.messages or [],
                       add_generation_prompt=body.add_generation_prompt,
                       continue_final_message=body.continue_final_message,
                       kwargs=template_kwargs(body), tools=tools or None,
                       documents=body.documents,
                       add_special_tokens=bool(body.add_special_tokens))  # fmt: skip


def with_images(serving: Serving, messages: list[ChatMessage],
                ids: list[int]) -> tuple[list[int], tuple[ImageInput, ...]]:  # fmt: skip
    """A rendered chat prompt's ids with its images' placeholders widened, and the images
    (read, fetched, made pixels): a vision-language model's image parts (none: as they are)."""
    vision = serving.image_prompts
    if vision is None or not has_images(messages):  # (a text chat: nothing dumped again)
        return ids, ()
    found = message_images([m.model_dump(mode="json", exclude_none=True) for m in messages])
    if len(found) > MAX_IMAGES_PER_PROMPT:
        raise bad_request(f"{len(found)} images: a prompt takes at most "
                          f"{MAX_IMAGES_PER_PROMPT}", param="messages")  # fmt: skip
    try:
        pixels = [vision.pixels(image, param) for image, param in found]
        return vision.expand(ids, pixels, "messages")
    except InvalidRequestError as e:
        raise from_invalid_request(e) from e


def has_images(messages: list[ChatMessage] | None) -> bool:
    """Whether any message has an image part."""
    return any(isinstance(part, ImageUrlContentPart) for m in messages or ()
               if isinstance(m.content, list) for part in m.content)  # fmt: skip


def template_kwargs(body: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any] | None:
    """The chat template's extra arguments: ``chat_template_kwargs``, and ``reasoning_effort``
    as gpt-oss's templates read it (``none``: thinking off, as Qwen3's read
    ``enable_thinking``) where those do not set it."""
    own = body.chat_template_kwargs
    effort = getattr(body, "reasoning_effort", None)
    if effort is None:
        return own
    mapped = {"enable_thinking": False} if effort == "none" else {"reasoning_effort": effort}
    return mapped | (own or {})


def chat_logprobs(serving: Serving, lps: list[TokenLogprob], k: int) -> ChatLogprobs:
    content = []
    for lp in lps:
        token = serving.token_str(lp.token_id)
        top = [
            TopLogprob(token=(s := serving.token_str(t)), logprob=v, bytes=list(s.encode()))
            for t, v in lp.top[:k]
        ]
        content.append(ChatLogprobToken(token=token, logprob=lp.logprob,
                                        bytes=list(token.encode()), top_logprobs=top))  # fmt: skip
    return ChatLogprobs(content=content)


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request checked and rendered: its prompt ids, tool mode (and the constraint a
    required or named tool choice imposes) and its ``max_tokens``."""

    ids: list[int]
    mode: ToolMode
    constraint: StructuredOutputs | None
    max_tokens: int | None
    images: tuple[ImageInput, ...] = ()  # (a vision-language model's, in prompt order)


@dataclass(frozen=True)
class ChatRun:
    """A chat request in the engine: its stream, how its reply's tool calls and thinking are
    read."""

    request_id: str
    stream: RequestStream
    mode: ToolMode
    thinking: Thinking


async def chat_prompt(serving: Serving, req: ChatCompletionRequest, route: str,
                      lengths: Literal["check", "clamp", "skip"] = "check") -> ChatPrompt:  # fmt: skip
    """The checks every chat-shaped request passes (fields, tools, lengths) and its prompt.
    ``lengths``: ``check`` refuses a prompt that, with its ``max_tokens``, passes the context;
    ``clamp`` cuts ``max_tokens`` to the room the prompt leaves (for clients that always ask
    for more than a small model's context holds); ``skip``: no check (a token count)."""
    serving.check_fields(req, route)
    if serving.encoder_only is not None:  # (before its chat template, which it has no use for)
        raise bad_request(serving.encoder_only, param="messages")
    if req.top_logprobs and not req.logprobs:  # top_logprobs 0 without logprobs asks nothing
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:  # (the newer name wins, as OpenAI's)
        max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
    try:
        mode = tool_mode(req, serving.settings.tool_call_parser)
        constraint = tool_constraint(mode, req.parallel_tool_calls)
    except InvalidRequestError as e:
        raise from_invalid_request(e) from e
    size = sum(len(m.content) if isinstance(m.content, str) else 64 for m in req.messages)
    if serving.image_prompts is not None:  # (images are read and made pixels off the loop)
        size += sum(1 << 20 for m in req.messages if not isinstance(m.content, str | None))
    ids, images = await serving.run_blocking(
        lambda: with_images(serving, req.messages, render_request(serving, req)), size=size
    )
    if images and req.truncate_prompt_tokens is not None:
        raise bad_request("truncate_prompt_tokens would cut a prompt with images (its "
                          "placeholders)", param="truncate_prompt_tokens")  # fmt: skip
    ids = serving.truncated(ids, req)
    if lengths == "clamp" and max_tokens is not None:
        room = serving.max_model_len - len(ids)
        if 0 < room < max_tokens:
            max_tokens = room
    if lengths != "skip":
        serving.check_lengths(ids, max_tokens, "messages", max_tokens_param)
    return ChatPrompt(ids, mode, constraint, max_tokens, images)


async def submit_chat(serving: Serving, req: ChatCompletionRequest, raw: Request,
                      prompt: ChatPrompt, request_id: str | None = None) -> ChatRun:  # fmt: skip
    """Queue a checked chat request (:func:`chat_prompt`) in the engine (``request_id``: its
    id, a new ``chatcmpl-...`` one by default)."""
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = serving.sampling_params(req, prompt.max_tokens, k, prompt.constraint)
    mode = prompt.mode
    if mode.kind == "auto" and mode.parser == "mistral":  # its [TOOL_CALLS] is a special token
        params = replace(params, skip_special_tokens=False)
    request_id = request_id or new_id("chatcmpl")
    raw.state.request_id = request_id
    stream = await serving.submit(
        request_id, [prompt.ids], params, req, raw.scope.get(KV_TRANSFER_SCOPE_KEY), prompt.images
    )
    return ChatRun(request_id, stream, mode, _thinking(serving, prompt.ids, params))


# Chat fields a one-reply front (the Responses and Messages APIs) cannot answer with its shape
_ONE_REPLY = {"n": 1, "use_beam_search": False, "echo": False, "prompt_logprobs": None}


def as_chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's front builds (``body``: its fields, None left out), a
    400 naming a bad one, or one that asks for more than one reply (``n``, beam search) or for
    what that API has no place for (``echo``, ``prompt_logprobs``)."""
    try:
        req = ChatCompletionRequest.model_validate({k: v for k, v in body.items()
                                                    if v is not None})  # fmt: skip
    except ValidationError as e:
        raise validation_error(e.errors()) from e
    for name, default in _ONE_REPLY.items():
        if getattr(req, name) != default:
            raise bad_request(f"{name} is not served on this route (one reply, no prompt "
                              "logprobs: use /v1/chat/completions)", param=name)  # fmt: skip
    return req


@contextmanager
def renamed_params(names: dict[str, str]) -> Iterator[None]:
    """A 400 raised inside names its field, in ``param`` and in its message, as the front's
    caller knows it (``names``: chat field -> theirs)."""
    try:
        yield
    except APIError as e:
        if e.param is not None:
            head, dot, rest = e.param.partition(".")
            base, bracket, index = head.partition("[")
            if base in names:
                e.param = names[base] + bracket + index + dot + rest
        for chat_name, theirs in names.items():
            if "_" in chat_name:  # (a field's name, never a plain word of the message)
                e.message = re.sub(rf"\b{chat_name}\b", theirs, e.message)
        raise


def final_reply(text: str, run: ChatRun, include_reasoning: bool = True
                ) -> tuple[str | None, str | None, list[ToolCall]]:  # fmt: skip
    """A finished reply's ``(reasoning, content, tool calls)``: its thinking split off as
    --reasoning-parser reads it (None: none, or not asked for), the rest parsed for calls as
    the request's tool mode says (content None where all of it was thinking)."""
    reasoning = None
    if run.thinking is not NO_PARSER:
        reasoning, text = split_reasoning(text, run.thinking)
        reasoning = (reasoning or None) if include_reasoning else None
    content, calls = parse_reply(run.mode, text)
    if run.thinking is not NO_PARSER and not content:
        content = None  # (all of it was thinking)
    return reasoning, content, calls


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest,
                                 raw: Request) -> Response:  # fmt: skip
    model = serving.check_model(req.model)
    if req.use_beam_search and has_images(req.messages):  # (before any image is fetched)
        raise bad_request("beam search of a prompt with images is not served",
                          param="use_beam_search")  # fmt: skip
    prompt = await chat_prompt(serving, req, "/v1/chat/completions")
    if req.use_beam_search:
        return await cancel_on_disconnect(raw, _beam_search(serving, req, raw, prompt.ids,
                                                            prompt.max_tokens, model))  # fmt: skip
    run = await submit_chat(serving, req, raw, prompt)
    if req.stream:
        return SSEResponse(_stream(serving, req, raw, run, model), on_close=run.stream.abort)
    return await cancel_on_disconnect(raw, _collect(serving, req, raw, run, model))


def _thinking(serving: Serving, ids: list[int], params: SamplingParams) -> Thinking:
    """How the reply's thinking is read (``reasoning.split_reasoning``'s ``thinking``), or
    ``NO_PARSER`` (no --reasoning-parser: all of it is content)."""
    parser = serving.settings.reasoning_parser
    if parser is None:
        return NO_PARSER
    tail = serving.tokenizer.decode(ids[-8:])  # (enough for a template's opening <think>)
    return starts_thinking(parser, tail, params.structured_outputs is not None)


async def _beam_search(serving: Serving, req: ChatCompletionRequest, raw: Request,
                       ids: list[int], max_tokens: int | None, model: str) -> Response:  # fmt: skip
    """``use_beam_search``: the ``n`` likeliest replies, best first (no tool calls)."""
    beam.check_beam_request(req)
    request_id = new_id("chatcmpl")
    raw.state.request_id = request_id
    (beams,), aborted = await beam.search(serving, req, [ids], max_tokens, request_id)
    echo = _echoed(req)
    choices = [
        ChatChoice(index=i, finish_reason=b.finish_reason(aborted),
                   message=ChatResponseMessage(content=echo + beam_text(
                       serving.tokenizer, b.token_ids, req.skip_special_tokens)))
        for i, b in enumerate(beams)
    ]  # fmt: skip
    prompt, completion = beam.usage_of([ids], [beams])
    raw.state.usage = (prompt, completion)
    body = ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=serving.usage(prompt, completion, 0))  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"))


def _echoed(req: ChatCompletionRequest) -> str:
    """``echo``: the last message's text when it is the assistant's own (the reply goes on from
    it, as with continue_final_message), put before the reply as vLLM does; else nothing."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant" or last.content is None:
        return ""
    return last.content if isinstance(last.content, str) else "".join(p.text for p in last.content)


def _finish_reason(out: RequestOutput, calls: list) -> str | None:
    """A reply that ended on its own with tool calls in it finishes with ``tool_calls``."""
    return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason


async def _collect(serving: Serving, req: ChatCompletionRequest, raw: Request, run: ChatRun,
                   model: str) -> Response:  # fmt: skip
    stream = run.stream
    acc = Choices(len(stream.request_ids))
    async for index, out in stream:
        acc.add(index, out)
    echo = _echoed(req)
    choices = []
    for index, final in enumerate(acc.final):
        assert final is not None
        raise_if_failed(final)
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(serving, acc.logprobs[index], req.top_logprobs or 0)
        reasoning, content, calls = final_reply("".join(acc.text[index]), run,
                                                req.include_reasoning)  # fmt: skip
        if echo:
            content = echo + (content or "")
        message = ChatResponseMessage(content=content, reasoning=reasoning,
                                      reasoning_content=reasoning, tool_calls=calls)  # fmt: skip
        message._reasoning_parser = run.thinking is not NO_PARSER
        choices.append(ChatChoice(
            index=index, message=message,
            logprobs=logprobs, finish_reason=_finish_reason(final, calls),
            stop_reason=final.stop_reason,
        ))  # fmt: skip
    prompt, completion, cached = usage_totals(acc.final, req.n)
    raw.state.usage = (prompt, completion)
    prompt_lps = None
    if req.prompt_logprobs is not None:  # one prompt: the first choice carries them
        prompt_lps = serving.prompt_logprobs(acc.prompt_logprobs[0], req.prompt_logprobs)
    body = ChatCompletionResponse(id=run.request_id, model=model, choices=choices,
                                  usage=serving.usage(prompt, completion, cached),
                                  prompt_logprobs=prompt_lps)  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"))


def _stream(serving: Serving, req: ChatCompletionRequest, raw: Request, run: ChatRun,
            model: str) -> AsyncIterator[bytes]:  # fmt: skip
    stream, request_id, mode, thinking = run.stream, run.request_id, run.mode, run.thinking
    created = int(time.time())
    tool_streams = [ToolStream(mode) for _ in stream.request_ids]
    thoughts = [] if thinking is NO_PARSER else [ReasoningStream(thinking) for _ in tool_streams]
    template = EventTemplate(
        ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[])
    )

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> bytes:
        body = ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                            choices=choices, usage=usage)  # fmt: skip
        return sse(body.model_dump_json())

    def render(index: int, out: RequestOutput, usage: UsageInfo | None) -> bytes | None:
        if not (out.new_text or out.new_token_ids or out.finished or out.new_logprobs):
            return None  # one event per generated token, even before it makes text
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(serving, out.new_logprobs, req.top_logprobs or 0)
        tools = tool_streams[index]
        text, reasoning = out.new_text, ""
        if thinking is not NO_PARSER:
            reasoning, text = thoughts[index].feed(out.new_text, out.finished)
            reasoning = reasoning if req.include_reasoning else ""
        content, calls = tools.feed(text, out.finished)
        if mode.kind != "none" and not (
            content or calls or reasoning or out.finished or logprobs or usage
        ):
            return None  # held back (a tool call being written): no empty chunk, as vLLM
        if logprobs is None and usage is None and not calls and not reasoning:  # most events
            finish = _finish_reason(out, tools.calls) if out.finished else None
            return template.event(chat_choice(index, content or None, finish, out.stop_reason))
        delta = DeltaMessage(content=content or None, reasoning=reasoning or None,
                             reasoning_content=reasoning or None, tool_calls=calls or None)  # fmt: skip
        return chunk([ChatStreamChoice(
            index=index, delta=delta, logprobs=logprobs,
            finish_reason=_finish_reason(out, tools.calls) if out.finished else None,
            stop_reason=out.stop_reason,
        )], usage)  # fmt: skip

    # The role comes first, before any token: clients start their message on it.
    echo = _echoed(req)
    roles = [chunk([ChatStreamChoice(index=index,
                                     delta=DeltaMessage(role="assistant", content=echo))])
             for index in range(len(stream.request_ids))]  # fmt: skip
    return stream_events(serving, req, raw, stream, render, lambda usage: chunk([], usage), roles)

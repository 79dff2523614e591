"""Bodies of OpenAI's Responses API (``POST /v1/responses``; :mod:`infer.server.responses`).

A request's ``input`` is a string (one user message) or a list of items: messages (``role``
and ``content``, a string or ``input_text`` / ``output_text`` parts), the model's earlier
``function_call`` items and the caller's ``function_call_output`` items; ``reasoning`` items
are accepted and left out of the prompt (as chat templates leave earlier thinking out). The
answer's ``output`` is a list of items: the thinking (``reasoning``, with --reasoning-parser),
the reply (``message`` of ``output_text``) and the calls (``function_call``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from infer.server.protocol import FUNCTION_NAME, MAX_LOGPROBS, _Request, _Response


class InputTextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: str


class InputImagePart(_Request):
    """An image (a vision-language model's): ``image_url`` a data URL or an http(s) address."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None


class InputMessage(_Request):
    """A message item (``type`` may be left out, as the SDK's easy form does)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    # (the list first: its errors name the part)
    content: list[InputTextPart | InputImagePart] | str


class FunctionCallInput(_Request):
    """A call the model made earlier (from a previous response's ``output``)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str


class FunctionCallOutputInput(_Request):
    """The caller's result of a call, matched to it by ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


class ReasoningInput(_Request):
    """An earlier reply's thinking: accepted, left out of the prompt."""

    type: Literal["reasoning"]


def _item_kind(value: Any) -> str:
    # (tags with a "-": an error's field path leaves them out, naming input[i].field)
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")
    return f"item-{kind}" if isinstance(kind, str) else ""


InputItem = Annotated[
    Annotated[InputMessage, Tag("item-message")]
    | Annotated[FunctionCallInput, Tag("item-function_call")]
    | Annotated[FunctionCallOutputInput, Tag("item-function_call_output")]
    | Annotated[ReasoningInput, Tag("item-reasoning")],
    Discriminator(
        _item_kind,
        custom_error_type="input_item_type",
        custom_error_message="an input item's type is message (the default), "
        "function_call, function_call_output or reasoning",
    ),
]


class FunctionToolIn(_Request):
    """A function the model may call (the Responses API's flat form of a chat tool)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME, description="a-z, A-Z, 0-9, _ - ., <= 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments")
    strict: bool | None = None


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` (``name``, ``schema``,
    ``strict``: the reply is JSON that the schema accepts)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    """``POST /v1/responses``. vLLM's sampling extensions (``top_k``, ``min_p``, ``seed``,
    ``stop``, ``repetition_penalty``, ``structured_outputs``, ``priority``, ...) are taken as
    the chat endpoint takes them."""

    model: str | None = Field(None, description="served model name; defaults to the only model")
    input: list[InputItem] | str  # (the list first: its errors name the item)
    instructions: str | None = Field(None, description="a system message before the input")
    previous_response_id: str | None = Field(
        None, description="continue a stored response: its input and output come first"
    )
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = Field(
        None, description="message.output_text.logprobs: each output token's log-probability"
    )
    stream: bool = False
    store: bool = Field(True, description="keep it (in memory) for previous_response_id")
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, description="accepted and ignored")
    truncation: Literal["auto", "disabled"] | None = None


# ---- the answer -------------------------------------------------------------------------------


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class OutputMessage(_Response):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(_Response):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class OutputFunctionCall(_Response):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(_Response):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # (the SDK's field; nothing is written to a cache for a fee)


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Response):
    """A response (``POST /v1/responses``' answer, ``GET /v1/responses/{id}``)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    truncation: str = "disabled"
    store: bool = True
    user: str | None = None
    usage: ResponseUsage | None = None


class ResponseStreamEvent(_Response):
    """One streamed event: ``type`` (``response.created``, ``response.output_text.delta``, ...,
    ``response.completed``), ``sequence_number``, and the fields of its type."""

    model_config = {"extra": "allow"}

    type: str
    sequence_number: int


class DeletedResponse(_Response):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True

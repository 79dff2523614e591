"""Bodies of Anthropic's Messages API (``POST /v1/messages``; :mod:`infer.server.messages`).

A message's ``content`` is a string or a list of blocks: ``text``; in an assistant turn the
model's ``tool_use`` blocks (and its ``thinking``, left out of the prompt); in a user turn the
caller's ``tool_result`` blocks. The answer's ``content`` is a list of blocks: ``thinking``
(with --reasoning-parser), ``text``, and a ``tool_use`` per call.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from infer.server.protocol import FUNCTION_NAME, NonEmptyStr, _Request, _Response


class TextBlock(_Request):
    type: Literal["text"]
    text: str


class ImageSource(_Request):
    """``base64`` (``media_type`` and ``data``) or ``url``."""

    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    def as_url(self) -> str:
        """The image as the chat route reads it: a data URL, or the address."""
        if self.type == "url":
            return self.url or ""
        return f"data:{self.media_type or 'image/png'};base64,{self.data or ''}"


class ImageBlock(_Request):
    """An image of a user turn (a vision-language model's)."""

    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Request):
    """A call the model made in an earlier turn."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(pattern=FUNCTION_NAME)
    input: dict[str, Any]


class ToolResultBlock(_Request):
    """The caller's result of a call, matched to it by ``tool_use_id``."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] | str = ""
    is_error: bool | None = None


class ThinkingBlock(_Request):
    """An earlier turn's thinking: accepted, left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]


def _block_kind(value: Any) -> str:
    # (tags with a "-": an error's field path leaves them out, naming content[i].field)
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"block-{kind}" if isinstance(kind, str) else ""


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("block-text")]
    | Annotated[ImageBlock, Tag("block-image")]
    | Annotated[ToolUseBlock, Tag("block-tool_use")]
    | Annotated[ToolResultBlock, Tag("block-tool_result")]
    | Annotated[ThinkingBlock, Tag("block-thinking")]
    | Annotated[ThinkingBlock, Tag("block-redacted_thinking")],
    Discriminator(_block_kind, custom_error_type="content_block_type",
                  custom_error_message="a content block's type is text, image, tool_use, "
                  "tool_result, thinking or redacted_thinking (no document)"),
]  # fmt: skip


class AnthropicMessage(_Request):
    role: Literal["user", "assistant"]
    content: list[ContentBlock] | str  # (the list first: its errors name the block)


class AnthropicTool(_Request):
    """A function the model may call (``input_schema``: JSON schema of its input)."""

    name: str = Field(pattern=FUNCTION_NAME, description="a-z, A-Z, 0-9, _ - ., <= 64")
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Request):
    """``auto`` (the model decides), ``any`` (at least one call), ``tool`` (a call of
    ``name``), ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    """``format``: the reply is JSON its ``schema`` accepts (Anthropic's structured outputs);
    ``effort`` is accepted and ignored."""

    format: OutputFormat | None = None
    effort: str | None = None


class MessagesRequest(_Request):
    """``POST /v1/messages``. ``temperature``, ``top_p`` and ``top_k`` (which newer Anthropic
    SDKs send only in ``extra_body``) and vLLM's sampling extensions (``min_p``, ``seed``,
    ``repetition_penalty``, ``structured_outputs``, ``priority``, ...) are taken as the chat
    endpoint takes them."""

    model: str | None = Field(None, description="served model name; defaults to the only model")
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: list[TextBlock] | str | None = None
    stop_sequences: list[NonEmptyStr] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    output_config: OutputConfig | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")


class CountTokensRequest(_Request):
    """``POST /v1/messages/count_tokens``: what a request's prompt would hold."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: list[TextBlock] | str | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


# ---- the answer -------------------------------------------------------------------------------


class AnthropicUsage(_Response):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessagesResponse(_Response):
    """A reply: its content blocks, why it stopped (``end_turn``, ``max_tokens``,
    ``stop_sequence`` with the ``stop_sequence`` matched, ``tool_use``) and its usage."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class MessagesStreamEvent(_Response):
    """One streamed event: ``type`` (``message_start``, ``content_block_start``,
    ``content_block_delta``, ``content_block_stop``, ``message_delta``, ``message_stop``) and
    the fields of its type."""

    model_config = {"extra": "allow"}

    type: str


class CountTokensResponse(_Response):
    input_tokens: int

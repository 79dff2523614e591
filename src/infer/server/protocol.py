"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests validate strictly (no ``"16"`` for an int, no ``"yes"`` for a bool, no NaN) so that a
malformed body is a 400 naming the field, never a silently different request. Unknown fields are
kept (``extra="allow"``) so the server can log them; fields OpenAI defines but we do not implement
and that change what the request means are listed in ``UNSUPPORTED_FIELDS`` and refused.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    model_serializer,
    model_validator,
)

from infer.core.sampling_params import MAX_BAD_WORDS

# ---- shared pieces ----------------------------------------------------------------------------

TokenId = Annotated[int, Field(ge=0)]
# A token id the model reads: the published schema bounds it by the vocabulary (the app fills
# in the maximum where it sees VOCAB_BOUND; see ``app.openapi``).
VOCAB_BOUND = "x-vocab-bound"
InputTokenId = Annotated[int, Field(ge=0, json_schema_extra={VOCAB_BOUND: True})]
# logit_bias: the bounds are published here and enforced by SamplingParams, whose errors say
# "keys must be token ids" and "[-100, 100]" rather than pydantic's pattern and bound messages.
TokenIdKey = Annotated[str, Field(json_schema_extra={VOCAB_BOUND: True})]
Bias = Annotated[float, Field(json_schema_extra={"minimum": -100, "maximum": 100})]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# A character that is not blank as Python's str.strip() sees it (a pattern matches anywhere in
# the string; \s leaves out the separators \x1c-\x1f that strip() also takes for blanks)
NonBlankStr = Annotated[str, Field(pattern=r"[^\s\x1c-\x1f]")]
# +-2**53: every seed is exact as a float too, so any JSON validator agrees with the server.
Seed = Annotated[int, Field(ge=-(2**53), le=2**53)]
MAX_N = 128  # choices per request: each is a full sequence in the batch
MAX_LOGPROBS = 20


_SCALARS = frozenset({int, str, bool, type(None)})


class InvalidTextError(ValueError):
    """A string of the body that is not Unicode text: JSON's ``\\ud800`` escapes can write a
    lone UTF-16 surrogate, which no tokenizer, template or UTF-8 encoder takes. ``param``: where
    (``messages[0].content``), for the 400's ``param``."""

    def __init__(self, char: str) -> None:
        self.char = char
        self.path: list[str | int] = []  # filled in on the way out of the body
        self.in_key = False  # a key of the object at ``path``, not its value
        super().__init__()

    @property
    def param(self) -> str:
        out = ""
        for part in self.path:
            out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
        return out

    def __str__(self) -> str:
        where = f"'{self.param}'" if self.path else "the body"
        if self.in_key:
            where = f"a key of {where}"
        return (f"{where} is not valid text: it holds a lone UTF-16 surrogate "
                f"(\\u{ord(self.char):04x}) with no pair")  # fmt: skip


def _check_text(s: str, at: str | int | None = None) -> None:
    """Raise :class:`InvalidTextError` if ``s`` is not text (``at``: its index or key)."""
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            error = InvalidTextError(s[e.start])
            if at is not None:
                error.path.append(at)
            raise error from None


def _normalized(value: Any) -> Any:
    """The body as the models validate it: ``1.0`` -> ``1`` throughout (JSON Schema counts a
    number with no fraction as an integer, so a schema-valid body may write one so; strings
    and bools stay refused), and every string and key checked to be text
    (:class:`InvalidTextError`, its path filled in on the way out)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        _check_text(value)
        return value
    if isinstance(value, list):
        # NOTE: the common big list (prompt token ids, strings) has nothing to convert; checking
        # its element types in C is ~6x cheaper than rebuilding it in Python.
        types = set(map(type, value))
        if types <= _SCALARS:
            if str in types:
                for i, v in enumerate(value):
                    if type(v) is str:
                        _check_text(v, at=i)
            return value
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_normalized(v))
            except InvalidTextError as e:
                e.path.insert(0, i)
                raise
        return out
    if isinstance(value, dict):
        out_dict = {}
        for k, v in value.items():
            try:
                if type(k) is str:
                    _check_text(k)
            except InvalidTextError as e:
                e.in_key = True
                raise
            try:
                out_dict[k] = _normalized(v)
            except InvalidTextError as e:
                e.path.insert(0, k)
                raise
        return out_dict
    return value


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _json_values(cls, data: Any) -> Any:
        return _normalized(data)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model: str | None = Field(None, description="served model name; defaults to the only model")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(
        None, ge=0.0, description="0 is greedy; default: the model's generation config, else 1.0"
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 disables")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: Seed | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[InputTokenId] | None = None
    allowed_token_ids: list[InputTokenId] | None = Field(
        None, min_length=1, description="only these token ids may be sampled (vLLM's)"
    )
    bad_words: list[NonBlankStr] | None = Field(
        None,
        max_length=MAX_BAD_WORDS,
        description="words never generated, alone or after a space (vLLM's)",
    )
    ignore_eos: bool = False
    use_beam_search: bool = Field(False, description="the n likeliest replies (vLLM's)")
    length_penalty: float = Field(1.0, description="beam search: score = sum / length ** this")
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="lower runs first")
    cache_salt: str | None = Field(None, min_length=1, description="isolates prefix-cache hits")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="vLLM: logprobs of the prompt tokens, + top-k"
    )
    logit_bias: dict[TokenIdKey, Bias] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit"
    )
    user: str | None = Field(None, description="accepted and ignored")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="keep the prompt's last k tokens (-1: the context length)"
    )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[InputTokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[InputTokenId], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(..., description="a string, strings, token ids, or lists of token ids")
    max_tokens: int | None = Field(16, ge=1, description="null: up to the context length")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = Field(True, description="the tokenizer's BOS etc. (vLLM's)")
    best_of: int | None = Field(
        None, ge=1, le=MAX_N, description="generate this many, return the n most likely"
    )
    suffix: str | None = Field(None, description="text after the completion (fill-in-the-middle)")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ImageUrl(_Request):
    url: str = Field(..., description="data:image/...;base64,... or an http(s):// address")
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlContentPart(_Request):
    """An image of a user turn (a vision-language model's)."""

    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCallIn(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Request):
    """A tool call of an earlier assistant turn, sent back in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart | ImageUrlContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None


FUNCTION_NAME = r"^[A-Za-z0-9_\-.]{1,64}$"


class FunctionDefinition(_Request):
    name: str = Field(..., pattern=FUNCTION_NAME, description="a-z, A-Z, 0-9, _ - ., <= 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments")
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    # top_logprobs >= 1 needs logprobs: true (a rule the server enforces; stated for clients).
    model_config = ConfigDict(
        json_schema_extra={
            "if": {
                "required": ["top_logprobs"],
                "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
            },
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        }  # fmt: skip
    )

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, description="deprecated alias of max_completion_tokens"
    )
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = Field(None, description="passed to the template")
    add_special_tokens: bool = Field(False, description="also the tokenizer's (a second BOS)")
    echo: bool = Field(False, description="reply prefixed by a last message of its role")
    include_reasoning: bool = Field(
        True, description="--reasoning-parser: false leaves the thinking out of the reply"
    )
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = Field(
        None,
        description="passed to the chat template as reasoning_effort (gpt-oss's); "
        "'none' also as enable_thinking: false (Qwen3's switch)",
    )


# Fields that change what a request means; accepting and ignoring them would return something
# other than what was asked. Values that mean "nothing special" are allowed through.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "lora_request": lambda v: v is None,
    "prompt_embeds": lambda v: v is None,
    "chat_template": lambda v: v is None,  # a template from the request: --chat-template only
}


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # replace an adapter of that name (new requests get the new one)


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and unused)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class TokenizeRequest(_Request):
    """``POST /tokenize``: either ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, "
                                            "false for messages (as generation does)")  # fmt: skip
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False  # also each token's string (vLLM's field)


class _PoolingFields(_Request):
    """Fields shared by the embedding routes (embeddings, score, rerank)."""

    model: str | None = Field(None, description="served model name; defaults to the only model")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="keep each input's last k tokens (-1: the context length)"
    )
    add_special_tokens: bool = Field(True, description="the tokenizer's BOS/EOS etc. (vLLM's)")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="lower runs first")
    cache_salt: str | None = Field(None, min_length=1, description="isolates prefix-cache hits")


MAX_TEXTS = 1024
"""At most this many texts in one list of an embedding route (each is an engine request)."""
_Texts = Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_TEXTS)]
# What a pooling route's ``input`` holds: one or more texts, or one or more token-id lists.
_Inputs = (
    NonEmptyStr
    | _Texts
    | Annotated[list[InputTokenId], Field(min_length=1)]
    | Annotated[
        list[Annotated[list[InputTokenId], Field(min_length=1)]],
        Field(min_length=1, max_length=MAX_TEXTS),
    ]
)
_INPUTS = "a string, strings, token ids, or lists of token ids"


class _InputOrMessages(_PoolingFields):
    """``input``, or ``messages`` in its place: one conversation as the chat template writes it
    (vLLM's chat form of the pooling routes)."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["input"], "properties": {"input": {"not": {"type": "null"}}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )

    input: _Inputs | None = Field(None, description=_INPUTS)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = Field(False, description="with messages (vLLM's default)")
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = Field(None, description="accepted and ignored")


class _Activation(_Request):
    """vLLM's switch for a classifier's activation (``activation`` and ``softmax`` are its
    older names): false answers the raw logits."""

    use_activation: bool | None = Field(None, description="sigmoid / softmax over the logits "
                                        "(default: true); false: the raw logits")  # fmt: skip
    activation: bool | None = Field(None, description="use_activation's older name")
    softmax: bool | None = Field(None, description="use_activation's older name")

    @property
    def wants_activation(self) -> bool:
        for value in (self.use_activation, self.activation, self.softmax):
            if value is not None:
                return value
        return True


class EmbeddingRequest(_InputOrMessages):
    """``POST /v1/embeddings`` (OpenAI's fields plus vLLM's ``truncate_prompt_tokens``,
    ``add_special_tokens``, ``normalize`` and ``priority``); ``messages`` in place of ``input``
    embeds one conversation as the chat template writes it (vLLM's chat form)."""

    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's little-endian float32 bytes"
    )
    dimensions: int | None = Field(
        None, ge=1, description="keep the first d values (Matryoshka), normalized after the cut"
    )
    normalize: bool | None = Field(
        None, description="unit length (default: as the model's sentence-transformers files say)"
    )


class PoolingRequest(_InputOrMessages, _Activation):
    """``POST /pooling`` (vLLM's): each input's pooled data as the ``task`` asks:
    ``token_embed`` one vector per input token (an encoder's; a ColBERT model's default),
    ``token_classify`` each input token's label probabilities (a token classifier's default;
    BGE-M3's sparse weights), ``embed`` the embedding ``/v1/embeddings`` gives (an embedding
    model's default), ``classify`` a sequence classifier's label probabilities (its default);
    ``use_activation: false``: a classification's raw logits."""

    task: Literal["token_embed", "token_classify", "embed", "classify"] | None = Field(
        None,
        description="default: the model's (classify, token_classify for a token "
        "classifier, token_embed for ColBERT, else embed)",
    )
    input_type: Literal["query", "document"] | None = Field(
        None,
        description="a ColBERT model: encode every input as a query or a document "
        "(prefix, length, query padding; a document's punctuation vectors left out)",
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the data's little-endian float32 bytes, rows in order"
    )
    dimensions: int | None = Field(
        None, ge=1, description="keep the first d values of each vector, normalized after"
    )
    normalize: bool | None = Field(
        None, description="unit length (default: as the model's sentence-transformers files say)"
    )


class ClassificationRequest(_InputOrMessages, _Activation):
    """``POST /classify`` (and ``/v1/classify``): each input's label probabilities by a
    sequence classifier (vLLM's classification API); ``messages`` in place of ``input``
    classifies one conversation as the chat template writes it (a reward model's input)."""


class ScoreRequest(_PoolingFields, _Activation):
    """``POST /score`` (and ``/v1/score``): how alike ``text_1`` and each ``text_2`` are: the
    cosine similarity of their embeddings (an embedding model), or a cross-encoder's relevance
    of the pair, the sigmoid of its logit (a one-label sequence classifier); vLLM's score API."""

    text_1: NonEmptyStr | _Texts
    text_2: NonEmptyStr | _Texts
    user: str | None = Field(None, description="accepted and ignored")


class RerankDocumentIn(_Request):
    text: NonEmptyStr


class RerankRequest(_PoolingFields, _Activation):
    """``POST /rerank`` (and ``/v1/rerank``, ``/v2/rerank``): ``documents`` ordered by how alike
    each is to ``query`` (Jina's and Cohere's shape, as vLLM serves it)."""

    query: NonEmptyStr
    documents: Annotated[
        list[NonEmptyStr | RerankDocumentIn], Field(min_length=1, max_length=MAX_TEXTS)
    ]
    top_n: int | None = Field(None, ge=0, description="the best n (0 or null: every document)")
    return_documents: bool = Field(True, description="each result's document text too")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[InputTokenId]


# ---- responses --------------------------------------------------------------------------------


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


PromptLogprobs = list[dict[str, dict[str, Any]] | None]
"""vLLM's shape: per prompt token, ``{token id: {"logprob", "rank", "decoded_token"}}`` for the
token itself and the top-k alternatives; None for the first token."""


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = Field(None, description="the stop token id or string matched")


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE ``data:`` event of a streamed completion (``usage`` only when asked)."""


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # --reasoning-parser: the thinking, apart from the content (vLLM's field, and its older
    # name, which clients read too); left out of the JSON without a parser
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # With a parser the keys are always there (null when the reply did not think): clients
    # read message.reasoning_content as an attribute, as vLLM's example does.
    _reasoning_parser: bool = PrivateAttr(default=False)

    @model_serializer(mode="wrap")
    def _drop_no_reasoning(self, handler):  # noqa: ANN001 - pydantic's serializer protocol
        out = handler(self)
        if not self._reasoning_parser:
            for key in ("reasoning", "reasoning_content"):
                if out.get(key) is None:
                    out.pop(key, None)
        return out


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # noqa: ANN001 - pydantic's serializer protocol
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # noqa: ANN001 - pydantic's serializer protocol
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    system_fingerprint: str | None = None


class DeltaMessage(_Response):
    """A piece of the assistant message; absent keys are left out of the JSON, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # (--reasoning-parser: see ChatResponseMessage)
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # noqa: ANN001 - pydantic's serializer protocol
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    """One SSE ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "infer"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class EmbeddingData(_Response):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # (a string: base64)


class EmbeddingUsage(_Response):
    prompt_tokens: int = 0
    total_tokens: int = 0


class _PoolingList(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: EmbeddingUsage


class EmbeddingResponse(_PoolingList):
    data: list[EmbeddingData]


class PoolingData(_Response):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[list[float]] | list[float] | str = Field(
        description="token_embed: a vector per input token; token_classify: each input "
        "token's label probabilities (or logits); embed: one vector; classify: the label "
        "probabilities (or logits) (a string: base64)"
    )


class PoolingResponse(_PoolingList):
    data: list[PoolingData]


class ClassificationData(_Response):
    index: int
    label: str = Field(description="the likeliest label's name (the model's id2label)")
    probs: list[float] = Field(description="each label's probability (softmax; sigmoid for one)")
    num_classes: int


class ClassificationResponse(_PoolingList):
    data: list[ClassificationData]


class ScoreData(_Response):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_PoolingList):
    data: list[ScoreData]


class RerankDocumentOut(_Response):
    text: str


class RerankResult(_Response):
    index: int
    document: RerankDocumentOut | None = None
    relevance_score: float


class RerankResponse(_Response):
    id: str
    model: str
    usage: EmbeddingUsage
    results: list[RerankResult]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(_Response):
    """Every 4xx/5xx body."""

    error: ErrorInfo


class HealthResponse(_Response):
    status: Literal["ok"] = "ok"

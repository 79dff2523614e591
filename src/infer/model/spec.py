"""What the engine needs to know about a model before (and without) loading its weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    """Shape and special tokens of a checkpoint, read from ``config.json`` (+ generation config).

    ``num_layers``, ``num_kv_heads`` and ``head_dim`` size the KV cache; ``eos_token_ids`` stop
    generation; ``torch_dtype`` is the checkpoint's own dtype, used by ``--dtype auto``.
    ``labels``: a sequence classifier's label names, in the order of its outputs (empty for a
    language model).
    """

    architecture: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    labels: tuple[str, ...] = ()
    # What a one-label classifier's pair score is of its logit: sigmoid or identity.
    score_activation: str = "sigmoid"
    # A reranker's prompt for a pair, "{query}" and "{document}" in it (a GGUF reranker's
    # "rerank" chat template; config.json's "rerank_template"); None: the tokenizer's pair.
    rerank_template: str | None = None
    # A bidirectional encoder (BERT, RoBERTa): every token sees its whole input; it embeds only.
    is_encoder: bool = False
    # A token classifier's label names (``*ForTokenClassification``: an NER tagger's; its
    # head labels every input token), in the order of its outputs; empty for any other model.
    token_labels: tuple[str, ...] = ()
    # A vision-language model (LLaVA): the token standing for an image in a prompt, how many
    # of them one image is (its feature vectors), and the pixels' shape ``(C, H, W)`` its
    # processor makes (None, 0, None: a model that reads no images).
    image_token_id: int | None = None
    image_tokens: int = 0
    image_shape: tuple[int, int, int] | None = None

    def encoder_only(self) -> str:
        """Why an encoder refuses to generate (the engine's and the chat endpoint's error)."""
        if self.token_labels:
            return (f"this model ({self.architecture}) is a token classifier: it labels every "
                    "input token (/pooling with task token_classify, LLM.encode) and generates "
                    "nothing")  # fmt: skip
        return (f"this model ({self.architecture}) is an encoder: it embeds (/v1/embeddings, "
                "LLM.embed, /score of embeddings) and generates nothing")  # fmt: skip

    @property
    def is_classifier(self) -> bool:
        """A sequence classifier (cross-encoder, reward or label model): it scores prompts,
        never generates."""
        return bool(self.labels)


def token_ids(value: Any) -> tuple[int, ...]:
    """``eos_token_id`` as written in configs (absent, an int, or a list) -> a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def config_dtype(config: dict[str, Any]) -> str | None:
    """The checkpoint dtype: transformers 5 writes ``dtype``, older versions ``torch_dtype``."""
    value = config.get("dtype") or config.get("torch_dtype")
    if value is None:
        return None
    return str(value).removeprefix("torch.")

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
    # A vision-language model's images (LLaVA, LLaVA-NeXT): how they stand in a prompt (None:
    # a model that reads no images).
    images: ImageLayout | None = None

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


@dataclass(frozen=True)
class ImageLayout:
    """How a vision-language model reads an image: the placeholder token (``token_id``) one
    image's run of is as long as the vectors the model makes of it, from pixels its processor
    makes ``image_size`` square (``channels`` deep) and its vision tower cuts in patches of
    ``patch_size``, one vector each (and the CLS vector where ``cls``: the ``full`` feature
    selection). LLaVA-NeXT (``pinpoints``: its ``image_grid_pinpoints``, ``(height, width)``
    each) also tiles the image at the pinpoint that fits it best: the tiles' vectors follow the
    whole image's, cut to the image's aspect ratio, each row ended by a newline vector::

        tokens = base (patches^2 [+1]) + rows x (columns + 1)     rows x columns: the tiles'
                                                                   vectors left once unpadded
    """

    token_id: int
    image_size: int
    patch_size: int
    channels: int = 3
    cls: bool = False
    pinpoints: tuple[tuple[int, int], ...] = ()

    @property
    def side(self) -> int:
        """Patches along a tile's side."""
        return self.image_size // self.patch_size

    @property
    def base_tokens(self) -> int:
        """The vectors of one tile (LLaVA's whole image)."""
        return self.side**2 + self.cls

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """LLaVA-NeXT: the tiles ``(rows, columns)`` an image of ``size`` (height, width) is cut
        in: the pinpoint that keeps most of its pixels and wastes least, in tiles."""
        from transformers.image_processing_utils import select_best_resolution

        height, width = select_best_resolution(list(size), [list(p) for p in self.pinpoints])
        return height // self.image_size, width // self.image_size

    def unpadded(self, size: tuple[int, int]) -> tuple[int, int]:
        """LLaVA-NeXT: the tiles' vector grid ``(rows, columns)`` once the padding the image was
        fitted into its pinpoint with is cut away (transformers' ``unpad_image``)."""
        rows, columns = self.grid(size)
        height, width = rows * self.side, columns * self.side
        original_height, original_width = size
        if original_width / original_height > width / height:
            new_height = int(round(original_height * (width / original_width), 7))
            height -= (height - new_height) // 2 * 2
        else:
            new_width = int(round(original_width * (height / original_height), 7))
            width -= (width - new_width) // 2 * 2
        return height, width

    def tokens_for(self, size: tuple[int, int] | None) -> int:
        """An image's placeholder tokens (``size``: its height and width as sent; LLaVA's
        count is the same for any)."""
        if not self.pinpoints:
            return self.base_tokens
        assert size is not None
        rows, columns = self.unpadded(size)
        return self.base_tokens + rows * (columns + 1)

    def pixel_shape(self, size: tuple[int, int] | None) -> tuple[int, ...]:
        """The pixels' shape the processor makes: ``(C, S, S)``, LLaVA-NeXT's ``(1 + tiles, C,
        S, S)`` (the whole image first)."""
        tile = (self.channels, self.image_size, self.image_size)
        if not self.pinpoints:
            return tile
        assert size is not None
        rows, columns = self.grid(size)
        return (1 + rows * columns, *tile)


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

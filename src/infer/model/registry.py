"""Which :class:`CausalLM` class serves a checkpoint, by ``architectures`` or ``model_type``.

A sequence classifier (``LlamaForSequenceClassification``, ``Qwen3ForSequenceClassification``,
...: a cross-encoder reranker, a reward or label model) is its family's decoder with a ``score``
head over the last token's final hidden state instead of the vocabulary projection: the same
class serves it, with the head the loader adds (``classifier_labels``). A token classifier
(``BertForTokenClassification``, ...: an NER or part-of-speech tagger) is its family's encoder
with a head over every token's final state (``token_classifier_labels``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infer.model.bert import BertModel, HFColBERT, RobertaModel, XLMRobertaModel
from infer.model.distilbert import DistilBertModel
from infer.model.gemma3 import Gemma3ForCausalLM, Gemma3TextEncoder
from infer.model.gpt2 import GPT2LMHeadModel
from infer.model.gte import GteModel, NewModel
from infer.model.jina_bert import JinaBertModel
from infer.model.layers import CausalLM
from infer.model.llama import LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM
from infer.model.llava import ARCHITECTURE as LLAVA
from infer.model.llava import NEXT_ARCHITECTURE as LLAVA_NEXT
from infer.model.llava import llava_class
from infer.model.modernbert import ModernBertModel
from infer.model.mpnet import MPNetModel
from infer.model.nomic_bert import NomicBertModel
from infer.model.qwen import (
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

ARCHITECTURES: dict[str, type[CausalLM]] = {
    cls.architecture: cls
    for cls in (
        LlamaForCausalLM,
        MistralForCausalLM,
        MixtralForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
        Qwen2MoeForCausalLM,
        Qwen3MoeForCausalLM,
        Gemma3ForCausalLM,
        GPT2LMHeadModel,
        BertModel,
        RobertaModel,
        XLMRobertaModel,
        NomicBertModel,
        GteModel,
        NewModel,
        ModernBertModel,
        MPNetModel,
        DistilBertModel,
        JinaBertModel,
        Gemma3TextEncoder,
        HFColBERT,
    )
}
# An encoder published with its masked-language-model head (all-mpnet-base-v2's
# MPNetForMaskedLM, Jina's JinaBertForMaskedLM): its encoder embeds; the head is not read.
# (EmbeddingGemma is Gemma 3's base model read as an encoder: it has no head of its own)
# (nor has Stanford's ColBERT, whose name is no family's)
_HEADLESS = (Gemma3TextEncoder, HFColBERT)
ARCHITECTURES |= {
    cls.architecture.removesuffix("Model") + "ForMaskedLM": cls
    for cls in list(ARCHITECTURES.values())
    if cls.is_encoder and cls not in _HEADLESS
}

MODEL_TYPES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "bert": BertModel,
    "roberta": RobertaModel,
    "xlm-roberta": XLMRobertaModel,
    "nomic_bert": NomicBertModel,
    "gte": GteModel,
    "new": NewModel,
    "modernbert": ModernBertModel,
    "mpnet": MPNetModel,
    "distilbert": DistilBertModel,
}


def _classifier_name(cls: type[CausalLM]) -> str:
    """transformers' name of a family's sequence classifier (``GPT2LMHeadModel`` ->
    ``GPT2ForSequenceClassification``; Gemma 3's text-only one is ``Gemma3Text...``)."""
    family = cls.architecture.removesuffix("ForCausalLM").removesuffix("LMHeadModel")
    if cls.is_encoder:  # BertModel -> BertForSequenceClassification
        family = family.removesuffix("Model")
    return f"{'Gemma3Text' if family == 'Gemma3' else family}ForSequenceClassification"


CLASSIFIERS: dict[str, type[CausalLM]] = {
    _classifier_name(cls): cls for cls in ARCHITECTURES.values() if cls not in _HEADLESS
}


# transformers' token classifiers of the encoder families it has one for: a linear head over
# every token's state (ModernBERT's: its prediction head first)
TOKEN_CLASSIFIERS: dict[str, type[CausalLM]] = {
    cls.architecture.removesuffix("Model") + "ForTokenClassification": cls
    for cls in (BertModel, RobertaModel, XLMRobertaModel, DistilBertModel, ModernBertModel,
                MPNetModel)
}  # fmt: skip


# LLaVA over each decoder family its text_config may name (by model_type)
LLAVA_TEXT_TYPES = ("llama", "mistral", "qwen2")
_LLAVA_CLASSES: dict[tuple[str, str], type[CausalLM]] = {}


def _llava(arch: str, config: dict[str, Any]) -> type[CausalLM]:
    text_type = (config.get("text_config") or {}).get("model_type")
    if text_type not in LLAVA_TEXT_TYPES:
        raise UnsupportedArchitectureError(
            f"{arch} with a {text_type!r} language model; supported: {', '.join(LLAVA_TEXT_TYPES)}"
        )
    key = (arch, text_type)
    if key not in _LLAVA_CLASSES:
        text_cls = MODEL_TYPES[text_type]
        _LLAVA_CLASSES[key] = llava_class(text_cls, next_=arch == LLAVA_NEXT)  # type: ignore[arg-type]
    return _LLAVA_CLASSES[key]


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no implementation here."""


def model_class(config: dict[str, Any]) -> tuple[str, type[CausalLM]]:
    """``(architecture name, class)`` for a ``config.json`` dict.

    ``architectures`` decides when present; ``model_type`` is the fallback for configs that
    omit it (NanoGPT exports often do).
    """
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in (LLAVA, LLAVA_NEXT):
            return arch, _llava(arch, config)
        if arch in ARCHITECTURES:
            return arch, ARCHITECTURES[arch]
        if arch in CLASSIFIERS:
            return arch, CLASSIFIERS[arch]
        if arch in TOKEN_CLASSIFIERS:
            return arch, TOKEN_CLASSIFIERS[arch]
    model_type = config.get("model_type")
    if not archs and model_type in MODEL_TYPES:
        cls = MODEL_TYPES[model_type]
        return cls.architecture, cls
    named = ", ".join(archs) if archs else f"model_type {model_type!r}"
    raise UnsupportedArchitectureError(
        f"unsupported architecture {named}; supported: {', '.join(ARCHITECTURES)}, {LLAVA}, {LLAVA_NEXT} "
        f"(and each one's sequence classifier: {', '.join(CLASSIFIERS)}; token classifiers: "
        f"{', '.join(TOKEN_CLASSIFIERS)})"
    )


@dataclass(frozen=True)
class ClassifierFromTokens:
    """A classifier whose head is made from rows of a causal model's vocabulary projection
    (vLLM's ``classifier_from_token`` / ``method`` config fields, set with ``--hf-overrides``):
    a reranker trained to answer "yes" or "no" as its next token.

    ``two_way`` (``method: from_2_way_softmax``, or ``is_original_qwen3_reranker``): two tokens,
    ``[false, true]``, make one label whose weight is ``W[true] - W[false]``: its sigmoid is the
    softmax probability of ``true`` over the two. Otherwise (``no_post_processing``) each token's
    row is one label."""

    tokens: tuple[str, ...]
    two_way: bool

    @property
    def labels(self) -> tuple[str, ...]:
        return self.tokens[1:] if self.two_way else self.tokens


METHODS = ("from_2_way_softmax", "no_post_processing")


def classifier_from_tokens(config: dict[str, Any]) -> ClassifierFromTokens | None:
    """What ``classifier_from_token`` (and ``method``) say, None where the config has none.
    ValueError names a bad field."""
    tokens = config.get("classifier_from_token")
    if tokens is None:
        return None
    if (not isinstance(tokens, list) or not tokens
            or not all(isinstance(t, str) and t for t in tokens)):  # fmt: skip
        raise ValueError(f"classifier_from_token must be a list of token strings, got {tokens!r}")
    method = config.get("method")
    if method is None:
        method = METHODS[0] if config.get("is_original_qwen3_reranker") else METHODS[1]
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")
    if method == METHODS[0] and len(tokens) != 2:
        raise ValueError(f"{method} takes two tokens, [false, true]; classifier_from_token "
                         f"has {len(tokens)}")  # fmt: skip
    return ClassifierFromTokens(tuple(tokens), method == METHODS[0])


def classifier_labels(arch: str, config: dict[str, Any]) -> tuple[str, ...]:
    """A sequence classifier's label names in output order (the tokens of
    ``classifier_from_token``, else ``id2label``; ``LABEL_0``, ... where the config names none
    or its ``num_labels`` says another count, as transformers reads it: two by default); ``()``
    for a language model."""
    if arch not in CLASSIFIERS:
        if "classifier_from_token" in config:
            raise ValueError(f"classifier_from_token is for a sequence classifier, and "
                             f"{arch} is not one: set architectures too, e.g. "
                             f"{_classifier_name(model_class({'architectures': [arch]})[1])}"
                             )  # fmt: skip
        return ()
    from_tokens = classifier_from_tokens(config)
    if from_tokens is not None:
        return from_tokens.labels
    return _label_names(config)


def token_classifier_labels(arch: str, config: dict[str, Any]) -> tuple[str, ...]:
    """A token classifier's label names in output order (as :func:`classifier_labels` reads
    them); ``()`` for any other model."""
    return _label_names(config) if arch in TOKEN_CLASSIFIERS else ()


def _label_names(config: dict[str, Any]) -> tuple[str, ...]:
    id2label = config.get("id2label")
    n = config.get("num_labels")
    if isinstance(id2label, dict) and id2label and n in (None, len(id2label)):
        try:
            by_index = {int(k): str(v) for k, v in id2label.items()}
        except (TypeError, ValueError):
            raise ValueError(
                f"id2label keys must be label indices, got {sorted(id2label)}"
            ) from None
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"id2label must number its labels 0..n-1, got {sorted(by_index)}")
        return tuple(by_index[i] for i in range(len(by_index)))
    n = 2 if n is None else n  # (transformers' default; a num_labels given wins over id2label)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_labels must be a positive integer, got {n!r}")
    return tuple(f"LABEL_{i}" for i in range(n))


# sentence-transformers' cross-encoder activations infer applies, by class name
ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}


def cross_encoder_activation(config: dict[str, Any]) -> str:
    """What a cross-encoder's pair score is of its logit: ``sigmoid`` (the default) or
    ``identity``, as a sentence-transformers ``CrossEncoder`` saved it in the config
    (``sentence_transformers.activation_fn``; older: ``sbert_ce_default_activation_function``).
    ValueError for another activation."""
    saved = config.get("sentence_transformers")
    name = saved.get("activation_fn") if isinstance(saved, dict) else None
    name = name or config.get("sbert_ce_default_activation_function")
    if name is None:
        return "sigmoid"
    short = str(name).rsplit(".", 1)[-1]
    if short not in ACTIVATIONS:
        raise ValueError(f"the cross-encoder's activation {name!r} is not one infer applies "
                         f"({', '.join(ACTIVATIONS)})")  # fmt: skip
    return ACTIVATIONS[short]


def rerank_template(config: dict[str, Any]) -> str | None:
    """A reranker's prompt for a pair (config.json's ``rerank_template``, which a GGUF
    reranker's folder takes from its ``rerank`` chat template), None where there is none.
    ValueError unless it holds ``{query}`` and, once, ``{document}``."""
    template = config.get("rerank_template")
    if template is not None and (
        not isinstance(template, str)
        or "{query}" not in template
        or template.count("{document}") != 1
    ):
        raise ValueError("rerank_template must be a string holding {query} and, once, {document}")
    return template

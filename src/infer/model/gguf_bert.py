"""A BERT-family GGUF file's config and tokenizer (llama.cpp's ``bert`` architecture).

llama.cpp writes BERT and XLM-RoBERTa embedding models (BGE, all-MiniLM, mxbai-embed,
snowflake-arctic-embed, multilingual-E5, BGE-M3) and rerankers (BGE-reranker) as architecture
``bert`` (a RoBERTa's too, with its byte-level BPE vocabulary), Nomic BERT as ``nomic-bert``,
Jina BERT v2 (jina-embeddings-v2-base-en) as ``jina-bert-v2`` and ModernBERT (modernbert-embed,
gte-modernbert) as ``modern-bert``.
transformers reads no such file, so the folder standing for one (:mod:`infer.model.gguf_folder`)
gets its ``config.json`` and tokenizer from here. No torch.

The config: llama.cpp's keys for BERT's fields; the position table as stored (an XLM-RoBERTa's
is stored without its first ``pad + 1`` rows, so every file counts positions from 0 and is
served as a ``BertModel``).

The vocabulary, as llama.cpp's converter stores a WordPiece one (``tokenizer.ggml.model``
``bert``), marks where words start rather than where they go on::

    WordPiece (tokenizer.json)    GGUF token list
    [CLS]                         [CLS]          (control tokens as they are)
    hello                         ▁hello         (a word's first piece: U+2581 before it)
    ##lo                          lo             (a continuation: "##" dropped)

which is undone here into a ``tokenizers`` WordPiece tokenizer with BERT's normalizer,
pre-tokenizer and ``[CLS] A [SEP]`` template. Lowercasing and accent stripping are read from
``tokenizer.ggml.normalizer.lowercase`` / ``.strip_accents``; a file written before llama.cpp
stored them was tokenized lowercased (llama.cpp lowercased every WordPiece input then), and is
here too. A SentencePiece vocabulary (``t5``: XLM-RoBERTa's Unigram, with its scores) becomes a
``tokenizers`` Unigram tokenizer with ``<s> A </s>``, normalized as llama.cpp's UGM tokenizer
does: the file's precompiled character map (NFKC for XLM-RoBERTa), then with
``remove_extra_whitespaces`` spaces stripped and collapsed and one before each word (the
first too), else with ``add_space_prefix`` one before the text (keys absent: neither). A
byte-level BPE vocabulary (``gpt2``: RoBERTa's, ModernBERT's) is its tokens as they are and its
merges, split by GPT-2's pre-tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infer.model.folders import ModelLoadError
from infer.model.gguf_folder import RANK, _field

WORD_START = "\u2581"  # what llama.cpp's converter puts before a word's first piece
MEAN, CLS = 1, 2  # llama.cpp's pooling types
CONTROL = 3  # llama.cpp's token type of a control token ([CLS], <s>, ...)


def bert_config(reader: Any, arch: str, tensors: dict[str, Any], file: Path) -> dict[str, Any]:
    """``config.json``'s fields for a ``bert`` GGUF file (a ``BertModel`` of it), a
    ``nomic-bert`` one (a ``NomicBertModel``: rotary positions, no position table) or a
    ``jina-bert-v2`` one (a ``JinaBertModel``: ALiBi, its gated MLP's two halves in one
    ``ffn_up``)."""

    def field(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None and default is None:
            raise ModelLoadError(f"{file}: GGUF metadata {arch}.{key!r} is missing")
        return default if value is None else value

    if field("attention.causal", False):
        raise ModelLoadError(f"{file}: a {arch} file with causal attention is not an encoder")
    needed = ("token_embd.weight",) + (("position_embd.weight",) if arch == "bert" else ())
    for name in needed:
        if name not in tensors:
            raise ModelLoadError(f"{file}: tensor {name} is missing")
    types = tensors.get("token_types.weight")
    config = {
        "hidden_size": int(field("embedding_length")),
        "num_hidden_layers": int(field("block_count")),
        "num_attention_heads": int(field("attention.head_count")),
        "intermediate_size": int(field("feed_forward_length")),
        "layer_norm_eps": float(field("attention.layer_norm_epsilon", 1e-12)),
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "type_vocab_size": 0 if types is None else int(types.shape[-1]),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id") or 0),
    }
    if arch == "nomic-bert":
        if field("expert_count", 0):
            raise ModelLoadError(f"{file}: a nomic-bert file with experts (nomic-embed-text "
                                 "v2's) is not supported")  # fmt: skip
        return config | {
            "architectures": ["NomicBertModel"],
            "model_type": "nomic_bert",
            "max_position_embeddings": int(field("context_length")),
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default",
                                # (llama.cpp's default where the key is absent)
                                "rope_theta": float(field("rope.freq_base", 10000.0))},
        }  # fmt: skip
    if arch == "modern-bert":
        return config | _modern_bert(reader, field, tensors, file)
    if arch == "jina-bert-v2":
        if "cls.weight" in tensors or int(field("pooling_type", 0)) == RANK:
            raise ModelLoadError(f"{file}: a jina-bert-v2 reranker file (jina-reranker) is not "
                                 "supported; its embedding files are")  # fmt: skip
        if "blk.0.ffn_gate.weight" in tensors:
            raise ModelLoadError(f"{file}: a jina-bert-v2 file with the gated MLP's halves split "
                                 "(as older llama.cpp converters wrote them: convert it again) "
                                 "is not supported")  # fmt: skip
        # Jina's code model: q / k norms and a second residual norm (model/jina_bert.py)
        code = [f"blk.0.{p}.weight" in tensors for p in ("attn_q_norm", "attn_k_norm",
                                                           "attn_norm_2")]  # fmt: skip
        if any(code) and not all(code):
            raise ModelLoadError(f"{file}: a jina-bert-v2 file with only some of Jina's code "
                                 "model's attn_q_norm, attn_k_norm and attn_norm_2")  # fmt: skip
        return config | {
            "qk_post_norm": all(code),
            "architectures": ["JinaBertModel"],
            "model_type": "bert",
            "position_embedding_type": "alibi",
            "feed_forward_type": "geglu",
            "max_position_embeddings": int(field("context_length")),
            "hidden_act": "gelu",
        }  # fmt: skip
    return config | {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "max_position_embeddings": int(tensors["position_embd.weight"].shape[-1]),
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
    }


def _modern_bert(reader: Any, field: Any, tensors: dict[str, Any], file: Path) -> dict[str, Any]:
    """A ``modern-bert`` file's ``ModernBertModel`` fields: its two rope bases (global:
    ``rope.freq_base``; local: ``rope.freq_base_swa``), the local layers' full window
    (``attention.sliding_window``, ``local_attention``) and which layers are local
    (``attention.sliding_window_pattern``: every n-th layer global from the first, or a flag
    per layer; llama.cpp's default 3), its MLP's activation (``hidden_activation``, GELU
    when absent). A reranker (gte-reranker-modernbert: ``cls``, ``cls.norm``, ``cls.output``)
    is a ``ModernBertForSequenceClassification`` pooling as ``classifier.pooling_type`` says
    (mean where absent, as llama.cpp), its head's activation GELU (the file does not say;
    llama.cpp takes GELU)."""
    layers = int(field("block_count"))
    window = int(field("attention.sliding_window", 0))
    pattern = _field(reader, "modern-bert.attention.sliding_window_pattern")
    if window <= 0:
        local = [False] * layers
    elif isinstance(pattern, list):
        if len(pattern) < layers:
            raise ModelLoadError(f"{file}: sliding_window_pattern has {len(pattern)} flags for "
                                 f"{layers} layers")  # fmt: skip
        local = [bool(p) for p in pattern][:layers]
    else:
        every = 3 if pattern is None else int(pattern)  # (0: every layer local, as llama.cpp)
        local = [every == 0 or i % every != 0 for i in range(layers)]
    base = float(field("rope.freq_base", 160_000.0))
    config = {
        "architectures": ["ModernBertModel"],
        "model_type": "modernbert",
        "max_position_embeddings": int(field("context_length")),
        # (llama.cpp's converter writes ModernBERT's norm_eps as an RMS norm's epsilon)
        "norm_eps": float(_field(reader, "modern-bert.attention.layer_norm_epsilon")
                          or field("attention.layer_norm_rms_epsilon", 1e-5)),
        "norm_bias": "token_embd_norm.bias" in tensors,
        "hidden_activation": str(_field(reader, "modern-bert.hidden_activation") or "gelu"),
        "local_attention": window if window > 0 else 128,
        "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": base},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(field("rope.freq_base_swa", base))},
        },
    }  # fmt: skip
    head = tensors.get("cls.output.weight")
    if head is None:
        return config
    for name in ("cls.weight", "cls.norm.weight"):
        if name not in tensors:
            raise ModelLoadError(f"{file}: a modern-bert reranker without {name}")
    labels = int(head.shape[-1]) if len(head.shape) > 1 else 1
    field_labels = reader.fields.get("modern-bert.classifier.output_labels")
    names = [] if field_labels is None else [str(v) for v in field_labels.contents()]
    if len(names) != labels:
        names = [f"LABEL_{i}" for i in range(labels)]
    pooling = int(_field(reader, "modern-bert.classifier.pooling_type") or MEAN)
    return config | {
        "architectures": ["ModernBertForSequenceClassification"],
        "num_labels": labels,
        "id2label": {str(i): name for i, name in enumerate(names)},
        "classifier_pooling": "cls" if pooling == CLS else "mean",
        "classifier_bias": "cls.bias" in tensors,
        "classifier_activation": "gelu",
    }


def is_bert_reranker(reader: Any, tensors: dict[str, Any]) -> bool:
    """Whether a bert file is a cross-encoder: it holds a classifier head (``cls.output``;
    llama.cpp's converter writes no pooling type for one, llama-server takes ``--reranking``),
    or says pooling RANK."""
    return "cls.output.weight" in tensors or int(_field(reader, "bert.pooling_type") or 0) == RANK


def bert_reranker(reader: Any, tensors: dict[str, Any], file: Path) -> dict[str, Any]:
    """A cross-encoder reranker's config (BGE-reranker, an XLM-RoBERTa): a
    ``BertForSequenceClassification`` whose head is the file's ``cls`` (dense, then tanh)
    and ``cls.output`` (a row per label) over the first token's state, as RoBERTa's
    ``classifier.dense`` and ``classifier.out_proj`` are. A file without ``cls`` (llama.cpp's
    converter drops a BERT classifier's pooler, so its scores are no longer the model's) is
    refused."""
    if "cls.weight" not in tensors or "cls.output.weight" not in tensors:
        raise ModelLoadError(
            f"{file}: a bert reranker file without both cls.weight and "
            "cls.output.weight; infer serves the cross-encoders whose head the file holds "
            "whole (BGE-reranker's: dense, tanh, out_proj). A BERT cross-encoder's pooler is "
            "left out by llama.cpp's converter: serve its Hugging Face folder instead"
        )
    shape = tensors["cls.output.weight"].shape  # (GGUF order: [hidden, labels])
    labels = int(shape[1]) if len(shape) > 1 else 1
    field = reader.fields.get("bert.classifier.output_labels")
    names = [] if field is None else [str(v) for v in field.contents()]
    if len(names) != labels:
        names = [f"LABEL_{i}" for i in range(labels)]
    return {
        "architectures": ["BertForSequenceClassification"],
        "num_labels": labels,
        "id2label": {str(i): name for i, name in enumerate(names)},
    }


def write_bert_tokenizer(reader: Any, arch: str, out: Path, file: Path, max_length: int) -> None:
    """The file's vocabulary as a Hugging Face fast tokenizer saved in ``out`` (module doc)."""
    model = _field(reader, "tokenizer.ggml.model")
    tokens = [str(t) for t in (_field(reader, "tokenizer.ggml.tokens") or [])]
    if not tokens:
        raise ModelLoadError(f"{file}: the file holds no vocabulary (tokenizer.ggml.tokens)")
    types = [int(t) for t in (_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))]
    if model == "bert":
        tokenizer = _wordpiece(reader, tokens, types, file)
    elif model == "t5":
        tokenizer = _unigram(reader, tokens, types, file)
    elif model == "gpt2":
        tokenizer = _byte_level_bpe(reader, tokens, types, file)
    else:
        raise ModelLoadError(
            f"{file}: a {arch} file with a {model!r} vocabulary; infer reads WordPiece ('bert'), "
            "SentencePiece Unigram ('t5') and byte-level BPE ('gpt2') ones"
        )
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(out)


def _special(reader: Any, tokens: list[str], key: str, *fallbacks: str) -> str | None:
    """The text of special token ``tokenizer.ggml.<key>_token_id`` (else the first of
    ``fallbacks`` in the vocabulary)."""
    value = _field(reader, f"tokenizer.ggml.{key}_token_id")
    if value is not None and 0 <= int(value) < len(tokens):
        return tokens[int(value)]
    return next((t for t in fallbacks if t in tokens), None)


def _wordpiece(reader: Any, tokens: list[str], types: list[int], file: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != CONTROL:
            text = text[1:] if text.startswith(WORD_START) else "##" + text
        vocab.setdefault(text, i)
    unk = _special(reader, tokens, "unknown", "[UNK]") or "[UNK]"
    # (llama.cpp's converter stores [CLS] as bos: GGUF has no key for it)
    cls = _special(reader, tokens, "cls") or _special(reader, tokens, "bos", "[CLS]")
    sep = _special(reader, tokens, "seperator", "[SEP]")  # (llama.cpp's spelling)
    if cls is None or sep is None:
        raise ModelLoadError(f"{file}: a WordPiece vocabulary without [CLS] / [SEP] tokens")
    lowercase = _field(reader, "tokenizer.ggml.normalizer.lowercase")
    lowercase = True if lowercase is None else bool(lowercase)
    strip = _field(reader, "tokenizer.ggml.normalizer.strip_accents")
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, lowercase=lowercase,
        strip_accents=None if strip is None else bool(strip),
    )  # fmt: skip
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )  # fmt: skip
    names = {"pad_token": _special(reader, tokens, "padding", "[PAD]"),
             "mask_token": _special(reader, tokens, "mask", "[MASK]")}  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=unk, cls_token=cls, sep_token=sep,
        **{k: v for k, v in names.items() if v is not None},
    )  # fmt: skip


def _unigram(reader: Any, tokens: list[str], types: list[int], file: Path) -> Any:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    scores = _field(reader, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError(f"{file}: a Unigram vocabulary needs one score per token")
    unk_id = int(_field(reader, "tokenizer.ggml.unknown_token_id") or 0)
    tok = Tokenizer(models.Unigram([(t, float(s)) for t, s in zip(tokens, scores, strict=True)],
                                   unk_id=unk_id, byte_fallback=False))  # fmt: skip
    steps = []
    charsmap = reader.fields.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap is not None and len(charsmap.data):
        steps.append(normalizers.Precompiled(bytes(charsmap.contents())))
    merge = bool(_field(reader, "tokenizer.ggml.remove_extra_whitespaces"))
    if merge:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    tok.normalizer = normalizers.Sequence(steps)
    prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix"))
    scheme = "always" if merge or prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(WORD_START, prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(WORD_START, prepend_scheme=scheme)
    bos = _special(reader, tokens, "bos", "<s>")
    eos = _special(reader, tokens, "eos", "</s>")
    if bos is None or eos is None:
        raise ModelLoadError(f"{file}: a Unigram vocabulary without <s> / </s> tokens")
    ids = {bos: tokens.index(bos), eos: tokens.index(eos)}
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=list(ids.items()),
    )  # fmt: skip
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == CONTROL]
    tok.add_special_tokens(control)
    names = {"pad_token": _special(reader, tokens, "padding", "<pad>"),
             "mask_token": _special(reader, tokens, "mask", "<mask>"),
             "unk_token": tokens[unk_id]}  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, cls_token=bos, sep_token=eos,
        **{k: v for k, v in names.items() if v is not None},
    )  # fmt: skip


def _byte_level_bpe(reader: Any, tokens: list[str], types: list[int], file: Path) -> Any:
    """A byte-level BPE vocabulary (``gpt2``: RoBERTa's, ModernBERT's, Jina's German and
    Chinese ones) as a ``tokenizers`` BPE with its merges and GPT-2's byte-level pre-tokenizer
    (no space added before the text), the file's control tokens special; where ``<s>`` is one
    of them, RoBERTa's ``<s> A </s>`` (a pair ``<s> A </s></s> B </s>``), else BERT's
    ``[CLS] A [SEP]`` (``[CLS] A [SEP] B [SEP]``: ModernBERT's)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    merges = [str(m) for m in (_field(reader, "tokenizer.ggml.merges") or [])]
    if not merges:
        raise ModelLoadError(f"{file}: a byte-level BPE vocabulary without its merges "
                             "(tokenizer.ggml.merges)")  # fmt: skip
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, unk_token=_special(reader, tokens, "unknown")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    roberta = "<s>" in control
    names = ("<s>", "</s>") if roberta else ("[CLS]", "[SEP]")
    cls = _special(reader, tokens, "cls") or _special(reader, tokens, "bos", names[0])
    sep = (_special(reader, tokens, "seperator") or _special(reader, tokens, "sep")
           or _special(reader, tokens, "eos", names[1]))  # fmt: skip
    if cls is None or sep is None:
        raise ModelLoadError(f"{file}: a byte-level BPE vocabulary without {' / '.join(names)}")
    pair = f"{cls} $A {sep} {sep} $B {sep}" if roberta else f"{cls} $A {sep} $B {sep}"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=pair, special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])]
    )
    extra = {"pad_token": _special(reader, tokens, "padding", "<pad>", "[PAD]"),
             "mask_token": _special(reader, tokens, "mask", "<mask>", "[MASK]"),
             "unk_token": _special(reader, tokens, "unknown", "<unk>", "[UNK]")}  # fmt: skip
    if roberta:
        extra |= {"bos_token": cls, "eos_token": sep}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token=cls, sep_token=sep,
        **{k: v for k, v in extra.items() if v is not None},
    )  # fmt: skip

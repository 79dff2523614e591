"""Tiny random BERT-family embedding models, saved as sentence-transformers publishes them.

Each is transformers' own ``BertModel`` / ``XLMRobertaModel`` (seeded random weights) saved with
``save_pretrained``, beside a WordPiece tokenizer trained with ``tokenizers`` on the offline
corpus (``[CLS] text [SEP]``, as BERT's) and sentence-transformers' ``modules.json`` and
``1_Pooling/config.json`` naming the pooling (and a ``Normalize`` module, as BGE ships one).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from infer.model.pooling import write_pooling_files
from infer.testing.checkpoints import build_once, default_root

ENCODER_KINDS = {"bert": "BertModel", "xlm_roberta": "XLMRobertaModel",
                 "nomic_bert": "NomicBertModel", "gte": "GteModel",
                 "modernbert": "ModernBertModel", "mpnet": "MPNetModel",
                 "distilbert": "DistilBertModel", "roberta": "RobertaModel"}  # fmt: skip
VERSION = "v2"  # bump when a recipe changes: folders built before are not reused


def default_encoder_root() -> Path:
    """The tests' folder of encoders: beside the tiny checkpoints' cache."""
    return default_root().parent / f"encoders-{VERSION}"


VOCAB_SIZE = 512
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# MPNet's order (its <s> <pad> </s> <unk>): transformers' MPNet takes id 1 for padding
MPNET_SPECIAL = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]


def _tokenizer(out: Path, token_types: bool, special: list[str] = SPECIAL) -> None:
    """A lowercasing WordPiece tokenizer with BERT's post-processor, saved into ``out``
    (``token_types``: it gives token type ids, as BERT's do and RoBERTa's do not; ``special``:
    the special tokens, ids from 0)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    from infer.data.corpus import load_corpus

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB_SIZE, special_tokens=special,
                                        show_progress=False)  # fmt: skip
    tok.train_from_iterator(load_corpus(include_docstrings=False), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )  # fmt: skip
    names = ["input_ids", *(["token_type_ids"] if token_types else []), "attention_mask"]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_max_length=128,
                                   model_input_names=names)  # fmt: skip
    fast.save_pretrained(out)


def _bpe_tokenizer(out: Path, roberta: bool) -> None:
    """A byte-level BPE tokenizer trained on the offline corpus (GPT-2's pre-tokenizer, no
    space before the text), saved into ``out``: RoBERTa's (``<s> <pad> </s> <unk> <mask>``,
    ``<s> A </s>``, a pair ``<s> A </s></s> B </s>``) or ModernBERT's (BERT's special tokens,
    ``[CLS] A [SEP]``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from infer.data.corpus import load_corpus

    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"] if roberta else SPECIAL
    cls, pad, sep, unk, mask = (special if roberta else
                                ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"])  # fmt: skip
    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(load_corpus(include_docstrings=False), trainer=trainer)
    ids = {t: tok.token_to_id(t) for t in (cls, sep)}
    pair = f"{cls} $A {sep} {sep} $B {sep}" if roberta else f"{cls} $A {sep} $B {sep}"
    tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=pair,
                                                       special_tokens=list(ids.items()))  # fmt: skip
    names = {"bos_token": cls, "eos_token": sep} if roberta else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, cls_token=cls, sep_token=sep,
                                   pad_token=pad, unk_token=unk, mask_token=mask,
                                   model_max_length=128,
                                   model_input_names=["input_ids", "attention_mask"],
                                   **names)  # fmt: skip
    fast.save_pretrained(out)


def _sentencepiece_tokenizer(out: Path) -> int:
    """XLM-RoBERTa's kind of tokenizer, saved into ``out``: a SentencePiece Unigram model
    (``nmt_nfkc`` normalization, as XLM-RoBERTa's) trained on the offline corpus and a few
    lines that NFKC changes, converted as transformers converts XLM-RoBERTa's (fairseq's
    ``<s> <pad> </s> <unk>`` first, ``<mask>`` last), beside its ``sentencepiece.bpe.model``
    (what llama.cpp's converter reads). Needs the ``sentencepiece`` package. Returns the
    vocabulary's size."""
    import sentencepiece
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import XLMRobertaConverter

    from infer.data.corpus import load_corpus

    lines = [line for doc in load_corpus(include_docstrings=False) for line in doc.splitlines()]
    lines += ["ﬁnancial ① Ｆｕｌｌ　ｗｉｄｔｈ café naïve Ångström 東京 ½"] * 20
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(line for line in lines if line.strip()),
        model_prefix=str(out / "sentencepiece.bpe"), vocab_size=600, model_type="unigram",
        bos_id=0, unk_id=1, eos_id=2, pad_id=-1, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip

    class _Original:  # (what the converter reads of a slow XLMRobertaTokenizer)
        vocab_file = str(out / "sentencepiece.bpe.model")
        handle_byte_fallback = False
        ids = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}

        def convert_tokens_to_ids(self, token: str) -> int:
            return self.ids[token]

    fast = PreTrainedTokenizerFast(
        tokenizer_object=XLMRobertaConverter(_Original()).converted(), bos_token="<s>",
        eos_token="</s>", cls_token="<s>", sep_token="</s>", unk_token="<unk>",
        pad_token="<pad>", mask_token="<mask>", model_max_length=128,
    )  # fmt: skip
    fast.save_pretrained(out)
    (out / "sentencepiece.bpe.vocab").unlink(missing_ok=True)
    return len(fast)


def nomic_published(folder: Path, out: Path) -> Path:
    """A copy at ``out`` of the Nomic BERT ``folder`` (transformers' config names) with
    ``config.json`` as Nomic publishes its models (nomic-embed-text v1.5's fields, GPT-2's
    names: ``n_embd``, ``n_layer``, ``rotary_emb_base``, ...; 8,192 positions, trained for
    2,048), which llama.cpp's converter reads; the tensors are the same either way."""
    import json

    if out.is_dir():
        return out
    shutil.copytree(folder, out)
    native = json.loads((folder / "config.json").read_text())
    config = {
        "architectures": ["NomicBertModel"], "model_type": "nomic_bert",
        "activation_function": "swiglu", "causal": False, "prenorm": False,
        "n_embd": native["hidden_size"], "n_head": native["num_attention_heads"],
        "n_inner": native["intermediate_size"], "n_layer": native["num_hidden_layers"],
        "n_positions": 8192, "max_trained_positions": 2048,
        "layer_norm_epsilon": native["layer_norm_eps"],
        "rotary_emb_base": native["rope_parameters"]["rope_theta"], "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False, "rotary_emb_scale_base": None,
        "rotary_scaling_factor": None, "qkv_proj_bias": False, "mlp_fc1_bias": False,
        "mlp_fc2_bias": False, "type_vocab_size": native["type_vocab_size"],
        "vocab_size": native["vocab_size"], "pad_token_id": native["pad_token_id"],
    }  # fmt: skip
    # transformers' names too: llama.cpp's converter reads config.json through transformers,
    # whose own NomicBertConfig takes only those (the published sizes are its defaults)
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers"):
        config[key] = native[key]
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def build_cross_encoder(kind: str, root: Path, **config: Any) -> Path:
    """The folder ``root/<kind>-reranker``: a tiny ``kind`` (:data:`ENCODER_KINDS`) as a
    one-label ``*ForSequenceClassification`` (a cross-encoder reranker, as BGE-reranker and
    ms-marco-MiniLM are published: no sentence-transformers files), ``config`` set in its
    config (a ModernBERT's ``classifier_pooling``, ...: in the name too); built if absent."""
    tag = "".join(f"-{k}-{v}" for k, v in sorted(config.items()))
    return build_encoder(kind, root, name=f"{kind}-reranker{tag}", labels=1, **config)


NER_LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")  # (a tagger's, as CoNLL's are named)


def build_token_classifier(kind: str, root: Path, labels: tuple[str, ...] = NER_LABELS,
                           **config: Any) -> Path:  # fmt: skip
    """The folder ``root/<kind>-tagger-<n>``: a tiny ``kind`` (:data:`ENCODER_KINDS`) as a
    ``*ForTokenClassification`` of ``labels`` (its ``id2label``: an NER tagger, as
    dslim/bert-base-NER is published), ``config`` set in its config; built if absent."""
    tag = "".join(f"-{k}-{v}" for k, v in sorted(config.items()))
    return build_encoder(kind, root, name=f"{kind}-tagger-{len(labels)}{tag}",
                         token_labels=labels, **config)  # fmt: skip


def build_encoder(kind: str, root: Path, pooling: str = "mean", normalize: bool = True,
                  name: str | None = None, labels: int = 0, sentencepiece: bool = False,
                  bpe: bool = False, token_labels: tuple[str, ...] = (),
                  **shape: Any) -> Path:  # fmt: skip
    """The folder ``root/<kind>-<pooling>`` (or ``root/<name>``): a tiny ``kind``
    (:data:`ENCODER_KINDS`) embedding model, or one of ``shape`` (config fields: hidden_size,
    num_hidden_layers, ...), whose sentence-transformers files pool by ``pooling`` (``mean``,
    ``cls``, ``last``) and normalize with ``normalize``; with ``labels``, a sequence
    classifier of that many labels instead (no sentence-transformers files); with
    ``token_labels``, a token classifier of those labels (neither); with
    ``sentencepiece`` (an XLM-RoBERTa), XLM-RoBERTa's kind of tokenizer in place of the
    WordPiece one (:func:`_sentencepiece_tokenizer`: needs the ``sentencepiece`` package);
    with ``bpe`` (a RoBERTa always; a ModernBERT), a byte-level BPE one (:func:`_bpe_tokenizer`);
    built if absent."""
    import torch
    import transformers

    root = Path(root)
    final = root / (name or f"{kind}-{pooling}{'' if normalize else '-raw'}")

    def write(tmp: Path) -> None:
        if sentencepiece:  # (XLM-RoBERTa's ids: <pad> is 1)
            vocab_size, pad = _sentencepiece_tokenizer(tmp), 1
        elif bpe or kind == "roberta":
            _bpe_tokenizer(tmp, roberta=kind == "roberta")
            vocab_size, pad = VOCAB_SIZE, 1 if kind == "roberta" else 0
        else:
            plain = kind not in ("xlm_roberta", "mpnet", "distilbert")  # (BERT's token types)
            _tokenizer(tmp, token_types=plain,
                       special=MPNET_SPECIAL if kind == "mpnet" else SPECIAL)  # fmt: skip
            vocab_size, pad = VOCAB_SIZE, 1 if kind == "mpnet" else 0
        base = ENCODER_KINDS[kind]
        config_cls = getattr(transformers, base.replace("Model", "Config"))
        arch = (base.replace("Model", "ForSequenceClassification") if labels else
                base.replace("Model", "ForTokenClassification") if token_labels else base)  # fmt: skip
        fields = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=128,
                      max_position_embeddings=130 if kind in ("xlm_roberta", "mpnet", "roberta")
                      else 128)  # fmt: skip
        if kind == "modernbert":  # (no token types; a global layer, then two local ones
            # whose 8-token window short inputs reach past)
            fields.update(num_hidden_layers=3, local_attention=8, max_position_embeddings=128)
        elif kind == "distilbert":  # (its own names, no token types)
            fields = dict(vocab_size=vocab_size, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                          max_position_embeddings=128)  # fmt: skip
        elif kind != "mpnet":  # (MPNet has no token types)
            fields["type_vocab_size"] = 1 if kind in ("xlm_roberta", "roberta") else 2
        config = config_cls(**{**fields, **shape}, pad_token_id=pad, architectures=[arch])
        if labels:
            config.num_labels = labels
        if token_labels:
            config.id2label = dict(enumerate(token_labels))
            config.label2id = {label: i for i, label in enumerate(token_labels)}
        torch.manual_seed(5)
        headless = labels or token_labels or kind in ("modernbert", "distilbert")  # (no pooler)
        pooler = not headless
        extra = {"add_pooling_layer": True} if pooler else {}
        model = getattr(transformers, arch)(config, **extra).to(torch.float32)
        with torch.no_grad():  # wider than the default init: every layer moves the output
            for name, param in model.named_parameters():
                if "LayerNorm" not in name and "layer_norm" not in name:
                    param.normal_(0.0, 0.1)
        model.save_pretrained(tmp, safe_serialization=True)
        if labels or token_labels:
            return
        write_pooling_files(tmp, pooling.upper(), normalize)

    return build_once(final, write)


def build_jina(root: Path, pooling: str = "mean", name: str | None = None, code: bool = False,
               **shape: int) -> Path:  # fmt: skip
    """The folder ``root/jina-<pooling>`` (or ``root/<name>``): a tiny Jina BERT v2 embedding
    model as Jina publishes one (``JinaBertForMaskedLM``, model_type ``bert``, ALiBi, a GELU
    gated MLP; tensors in its code's names: transformers has no class for it, so seeded random
    tensors are written directly), a WordPiece tokenizer with token types (its
    ``tokenizer_config.json`` naming ``BertTokenizer``, as Jina's, which llama.cpp's converter
    reads), and sentence-transformers' pooling files; ``shape``: config fields (6 heads by
    default: ALiBi's slopes of a head count that is not a power of two); ``code``: Jina's code
    model's layers instead (q / k norms, ``layer_norm_1`` / ``_2``, ``up_gated_layer``; its
    ``auto_map`` naming ``jina-bert-v2-qk-post-norm``). Built if absent."""
    import json

    import torch
    from safetensors.torch import save_file

    root = Path(root)
    final = root / (name or f"jina-{pooling}")

    def write(tmp: Path) -> None:
        _tokenizer(tmp, token_types=True)
        tok_config = json.loads((tmp / "tokenizer_config.json").read_text())
        tok_config["tokenizer_class"] = "BertTokenizer"
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
        config = {"architectures": ["JinaBertForMaskedLM"], "model_type": "bert",
                  "position_embedding_type": "alibi", "feed_forward_type": "geglu",
                  "emb_pooler": "mean", "attn_implementation": "torch", "hidden_act": "gelu",
                  "hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6,
                  "intermediate_size": 128, "max_position_embeddings": 128,
                  "type_vocab_size": 2, "vocab_size": VOCAB_SIZE, "layer_norm_eps": 1e-12,
                  "pad_token_id": 0, "initializer_range": 0.02} | shape  # fmt: skip
        if code:
            impl = "jinaai/jina-bert-v2-qk-post-norm--"
            config["auto_map"] = {"AutoConfig": impl + "configuration_bert.JinaBertConfig",
                                  "AutoModel": impl + "modeling_bert.JinaBertModel"}  # fmt: skip
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        h, inter = config["hidden_size"], config["intermediate_size"]
        gen = torch.Generator().manual_seed(5)

        def rand(*size: int, mean: float = 0.0) -> torch.Tensor:
            return mean + 0.1 * torch.randn(*size, generator=gen)

        tensors = {"embeddings.word_embeddings.weight": rand(VOCAB_SIZE, h),
                   "embeddings.token_type_embeddings.weight": rand(2, h),
                   "embeddings.LayerNorm.weight": rand(h, mean=1.0),
                   "embeddings.LayerNorm.bias": rand(h),
                   "pooler.dense.weight": rand(h, h), "pooler.dense.bias": rand(h)}  # fmt: skip
        for i in range(config["num_hidden_layers"]):
            at = f"encoder.layer.{i}."
            for part in ("attention.self.query", "attention.self.key", "attention.self.value",
                         "attention.output.dense"):  # fmt: skip
                tensors[f"{at}{part}.weight"], tensors[f"{at}{part}.bias"] = rand(h, h), rand(h)
            norms = ("attention.output.LayerNorm", "mlp.layernorm")
            mlp = ("mlp.gated_layers", "mlp.wo")
            if code:
                norms = ("attention.output.LayerNorm", "layer_norm_1", "layer_norm_2",
                         "attention.self.layer_norm_q", "attention.self.layer_norm_k")  # fmt: skip
                mlp = ("mlp.up_gated_layer", "mlp.down_layer")
            for norm in norms:
                tensors[f"{at}{norm}.weight"] = rand(h, mean=1.0)
                tensors[f"{at}{norm}.bias"] = rand(h)
            tensors[f"{at}{mlp[0]}.weight"] = rand(2 * inter, h)
            tensors[f"{at}{mlp[1]}.weight"], tensors[f"{at}{mlp[1]}.bias"] = rand(h, inter), rand(h)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_pooling_files(tmp, pooling.upper(), normalize=True)

    return build_once(final, write)


def with_dense_modules(
    folder: Path, out: Path, widths: list[int], seed: int = 7, plain: bool = False
) -> Path:
    """A copy at ``out`` of the embedding model ``folder`` whose sentence-transformers pipeline
    projects the pooled vector by a ``Dense`` module per entry of ``widths`` (its
    ``out_features``) before normalizing, as LaBSE's and stella's do: the first with a tanh
    and its weights in ``model.safetensors``, the others without an activation (``Identity``)
    and in ``pytorch_model.bin`` (older sentence-transformers' file); with ``plain``, every one
    bias-free, without an activation, in ``model.safetensors`` (EmbeddingGemma's); seeded
    random weights. Built if absent."""
    import json

    import torch
    from safetensors.torch import save_file

    out = Path(out)

    def write(tmp: Path) -> None:
        shutil.copytree(folder, tmp, dirs_exist_ok=True)
        modules = json.loads((tmp / "modules.json").read_text())
        normalize = [m for m in modules if m["type"].endswith(".Normalize")]
        modules = [m for m in modules if not m["type"].endswith(".Normalize")]
        width = json.loads((tmp / "config.json").read_text()).get("hidden_size")
        gen = torch.Generator().manual_seed(seed)
        for i, out_features in enumerate(widths):
            path = f"{len(modules)}_Dense"
            (tmp / path).mkdir()
            act = "Tanh" if i == 0 and not plain else "Identity"
            module = "activation" if act == "Tanh" else "linear"
            (tmp / path / "config.json").write_text(json.dumps({
                "in_features": width, "out_features": out_features, "bias": not plain,
                "activation_function": f"torch.nn.modules.{module}.{act}"}))  # fmt: skip
            state = {"linear.weight": 0.2 * torch.randn(out_features, width, generator=gen),
                     "linear.bias": 0.1 * torch.randn(out_features, generator=gen)}  # fmt: skip
            if plain:
                del state["linear.bias"]
            if i == 0 or plain:
                save_file(state, str(tmp / path / "model.safetensors"))
            else:
                torch.save(state, tmp / path / "pytorch_model.bin")
            modules.append({"idx": len(modules), "name": str(len(modules)), "path": path,
                            "type": "sentence_transformers.models.Dense"})  # fmt: skip
            width = out_features
        for m in normalize:
            modules.append(m | {"idx": len(modules), "name": str(len(modules))})
        (tmp / "modules.json").write_text(json.dumps(modules, indent=1))

    return build_once(out, write)


def build_colbert(kind: str, root: Path, name: str | None = None, dim: int = 32,
                  stanford: bool = False, shape: dict[str, Any] | None = None,
                  **settings: Any) -> Path:  # fmt: skip
    """The folder ``root/<name>`` (``colbert-<kind>``): a tiny ColBERT model as PyLate saves
    one, on ``build_encoder(kind)``'s weights: its tokenizer with the ``[Q] `` and ``[D] ``
    prefix tokens added (two new embedding rows), a bias-free ``pylate.models.Dense.Dense``
    projection to ``dim`` values in ``1_Dense``, no pooling, and
    ``config_sentence_transformers.json`` (``model_type: ColBERT``; ``settings``: its
    ``query_length`` (default 16), ``document_length`` (24), ``do_query_expansion``,
    ``attend_to_expansion_tokens``, ... over PyLate's defaults); seeded random weights. With
    ``stanford`` (a BERT), as Stanford's ColBERT library saves one instead: ``HF_ColBERT``,
    ``bert.``-prefixed weights with ``linear.weight`` beside them, ``[unused0]`` /
    ``[unused1]`` as the prefixes, ``artifact.metadata`` (``settings``: its keys); ``shape``:
    the encoder's config fields (hidden_size, ...). Built if absent."""
    import json
    import string

    import torch
    import transformers
    from safetensors.torch import save_file

    root = Path(root)
    final = root / (name or f"colbert-{kind}")

    def write(tmp: Path) -> None:
        base = build_encoder(kind, root, "cls", name=f"{final.name}-base" if shape else None,
                             **(shape or {}))  # fmt: skip
        tokenizer = transformers.AutoTokenizer.from_pretrained(base)
        tokenizer.add_tokens(["[unused0]", "[unused1]"] if stanford else ["[Q] ", "[D] "])
        model = transformers.AutoModel.from_pretrained(base, dtype=torch.float32)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        gen = torch.Generator().manual_seed(11)
        hidden = model.config.hidden_size
        with torch.no_grad():
            model.get_input_embeddings().weight[-2:] = 0.1 * torch.randn(2, hidden, generator=gen)
        tokenizer.save_pretrained(tmp)
        linear = 0.2 * torch.randn(dim, hidden, generator=gen)
        if stanford:
            model.save_pretrained(tmp)
            state = {f"bert.{k}": v.contiguous() for k, v in model.state_dict().items()}
            save_file(state | {"linear.weight": linear}, str(tmp / "model.safetensors"))
            config = json.loads((tmp / "config.json").read_text())
            (tmp / "config.json").write_text(json.dumps(config | {"architectures": ["HF_ColBERT"]}))
            meta = {"query_token_id": "[unused0]", "doc_token_id": "[unused1]", "query_maxlen": 16,
                    "doc_maxlen": 24, "attend_to_mask_tokens": False, "dim": dim,
                    "similarity": "cosine"} | settings  # fmt: skip
            (tmp / "artifact.metadata").write_text(json.dumps(meta, indent=1))
            return
        model.save_pretrained(tmp)
        (tmp / "1_Dense").mkdir()
        (tmp / "1_Dense" / "config.json").write_text(json.dumps({
            "in_features": hidden, "out_features": dim, "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False}))  # fmt: skip
        save_file({"linear.weight": linear}, str(tmp / "1_Dense" / "model.safetensors"))
        modules = [{"idx": 0, "name": "0", "path": "",
                    "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]  # fmt: skip
        (tmp / "modules.json").write_text(json.dumps(modules))
        config = {"model_type": "ColBERT", "similarity_fn_name": "MaxSim", "query_prefix": "[Q] ",
                  "document_prefix": "[D] ", "query_length": 16, "document_length": 24,
                  "attend_to_expansion_tokens": False, "do_query_expansion": True,
                  "skiplist_words": list(string.punctuation)} | settings  # fmt: skip
        (tmp / "config_sentence_transformers.json").write_text(json.dumps(config, indent=1))

    return build_once(final, write)


def build_embedding_gemma(root: Path, tokenizer_folder: Path, name: str = "embedding-gemma",
                          **shape: Any) -> Path:  # fmt: skip
    """The folder ``root/<name>``: a tiny EmbeddingGemma (transformers' ``Gemma3TextModel``
    with ``use_bidirectional_attention``, seeded random weights: 2 sliding layers of window 8,
    then a global one; 4 query heads over 2 kv heads), ``tokenizer_folder``'s tokenizer (a Gemma
    3 one), and sentence-transformers' files pooling by the mean, unnormalized; ``shape``:
    config fields. Built if absent."""
    import torch
    import transformers

    root = Path(root)
    final = root / name

    def write(tmp: Path) -> None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_folder)
        tokenizer.save_pretrained(tmp)
        fields = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, sliding_window=8, max_position_embeddings=128,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                      query_pre_attn_scalar=32, use_bidirectional_attention=True,
                      pad_token_id=tokenizer.pad_token_id or 0,
                      architectures=["Gemma3TextModel"])  # fmt: skip
        config = transformers.Gemma3TextConfig(**{**fields, **shape})
        torch.manual_seed(5)
        model = transformers.Gemma3TextModel(config).to(torch.float32)
        with torch.no_grad():  # wider than the default init: every layer moves the output
            for param in model.parameters():
                param.normal_(0.0, 0.1)
        model.save_pretrained(tmp, safe_serialization=True)
        write_pooling_files(tmp, "MEAN", normalize=False)

    return build_once(final, write)

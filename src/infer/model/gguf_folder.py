"""A GGUF file (llama.cpp's format) seen as a model folder.

Everything in infer reads a model as a Hugging Face folder: ``config.json``, the tokenizer's
files, ``generation_config.json``. A GGUF file holds all of that in its metadata, and its
weights. :func:`gguf_model_folder` writes the metadata out once as such a folder, in the cache,
beside a ``gguf.json`` naming the file; the weights stay in the GGUF file, read from there at
load (:mod:`infer.model.gguf_checkpoint`)::

    <cache>/gguf/<stem>-<key>/config.json             from the GGUF metadata (transformers)
                              tokenizer.json ...      the GGUF tokenizer, converted (transformers)
                              generation_config.json  its bos / eos ids
                              gguf.json               {"file": ..., "size": ..., "mtime_ns": ...}

``<key>`` hashes the file's absolute path, size and modification time, :data:`FOLDER_VERSION`
and transformers' version: a changed file (or reader) gets a new folder. transformers reads the metadata (it maps llama.cpp's keys to config fields, and
its tokenizer converters rebuild a fast tokenizer from the vocabulary, merges and chat
template stored there); this module does not import torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from infer.model.folders import ModelLoadError, make_folder_once
from infer.model.pooling import write_pooling_files

POINTER_FILE = "gguf.json"
# GGML types that hold plain floats; every other type is quantized.
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# The 4-bit types whose integers the int4 kernel takes as they are (groups of 32;
# model/gguf_checkpoint.py unpacks them).
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# The 5- and 6-bit types the w4a8 kernel takes as they are (the nibbles plus one or two bit
# planes): with int8 activations only (--gguf-int8-activations). Q6_K's int8 sub-scales per 16
# inputs are applied in the kernel's integer sums (model/gguf_checkpoint.py unpack_q6k).
WIDE_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")
# Bump when what a folder holds changes (a config fix-up): folders made before are not reused.
FOLDER_VERSION = 4
GGUF_MAGIC = b"GGUF"

# llama.cpp architecture -> the Hugging Face class infer serves it as (model/registry.py).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Mistral's too: llama.cpp's converter writes them as llama
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "bert": "BertModel",  # XLM-RoBERTa's too (model/gguf_bert.py)
    "nomic-bert": "NomicBertModel",
    "jina-bert-v2": "JinaBertModel",
    "modern-bert": "ModernBertModel",
    "gemma-embedding": "Gemma3TextModel",  # EmbeddingGemma (model/gguf_embedding_gemma.py)
}
# (transformers reads none of these: model/gguf_bert.py writes their folders)
BERT_ARCHITECTURES = ("bert", "nomic-bert", "jina-bert-v2", "modern-bert")


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a file that starts as a GGUF file does."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a folder made by :func:`gguf_model_folder` stands for, None for any other
    folder; a GGUF file that changed or went away since is a :class:`ModelLoadError`."""
    pointer = Path(model_dir) / POINTER_FILE
    if not pointer.is_file():
        return None
    data = json.loads(pointer.read_text())
    file = Path(data["file"])
    try:
        stat = file.stat()
    except OSError:
        raise ModelLoadError(f"{model_dir} stands for {file}, which is gone") from None
    if (stat.st_size, stat.st_mtime_ns) != (data["size"], data["mtime_ns"]):
        raise ModelLoadError(
            f"{file} changed after {model_dir} was made from it; load the file again"
        )
    return file


def gguf_model_folder(file: Path, cache: Path | None = None) -> Path:
    """The model folder standing for GGUF ``file`` (made on first use; see the module doc)."""
    file = Path(file).expanduser().absolute()  # (a hub cache's link keeps its file name)
    if not is_gguf_file(file):
        raise ModelLoadError(f"{file} is not a GGUF file (it does not start with 'GGUF')")
    stat = file.stat()
    # the file, and what read it: a newer infer or transformers writes the folder afresh
    made_by = f"{FOLDER_VERSION}\0{importlib.metadata.version('transformers')}"
    key = hashlib.sha256(
        f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}\0{made_by}".encode()
    ).hexdigest()[:16]
    if cache is None:
        from infer.builtin.cache import cache_root

        cache = cache_root()
    folder = Path(cache) / "gguf" / f"{file.stem}-{key}"
    if (folder / POINTER_FILE).is_file():
        return folder

    def write(tmp: Path) -> None:
        try:
            _write_folder(file, tmp)
        except (TypeError, ValueError, KeyError) as e:  # a field missing or of another shape
            raise ModelLoadError(
                f"{file}: unexpected GGUF metadata ({type(e).__name__}: {e})"
            ) from None
        pointer = {"file": str(file), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        (tmp / POINTER_FILE).write_text(json.dumps(pointer, indent=1) + "\n")

    return make_folder_once(folder, write)


def gguf_tensors(file: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape as ``[rows, cols]``, GGML type name) of each tensor of ``file``, from
    its header (memory-mapped; no data read)."""
    from gguf import GGUFReader

    return [
        (t.name, tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name)
        for t in GGUFReader(file).tensors
    ]


def _write_folder(file: Path, out: Path) -> None:
    """config.json, the tokenizer and generation_config.json of GGUF ``file`` into ``out``."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(file)
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, struct.error, ...
        raise ModelLoadError(f"cannot read GGUF file {file}: {e}") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{file}: GGUF architecture {arch!r} is not supported (infer reads "
            f"{', '.join(sorted(ARCHITECTURES))})"
        )
    if _field(reader, "split.count") not in (None, 1):
        raise ModelLoadError(
            f"{file} is one part of a split GGUF; merge the parts into one file first "
            "(llama.cpp's `llama-gguf-split --merge FIRST-PART OUT.gguf`)"
        )
    if arch in BERT_ARCHITECTURES:
        _write_bert_folder(reader, arch, file, out)
    elif arch == "gemma-embedding":
        from infer.model.gguf_embedding_gemma import write_embedding_gemma_folder

        write_embedding_gemma_folder(reader, file, out)
    else:
        write_decoder_folder(reader, arch, file, out)


def write_decoder_folder(reader: Any, arch: str, file: Path, out: Path,
                         metadata_file: Path | None = None, tokenizer_class: Any = None) -> None:  # fmt: skip
    """config.json, the tokenizer, generation_config.json and the pooling of a decoder's GGUF
    ``file`` (open as ``reader``) into ``out``; transformers reads the config and tokenizer
    from ``metadata_file`` (a file of the same metadata under an architecture it knows),
    else from ``file``, the tokenizer as ``tokenizer_class`` (else the one its config
    names)."""
    from transformers import AutoConfig, AutoTokenizer

    source = metadata_file or file
    try:
        config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
        tokenizer = (tokenizer_class or AutoTokenizer).from_pretrained(source.parent,
                                                                       gguf_file=source.name)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - transformers' converters raise many types
        raise ModelLoadError(f"{file}: cannot read its config or tokenizer: {e}") from None
    tensors = {t.name: t for t in reader.tensors}
    data = config.to_dict()
    for key in ("_name_or_path", "_model_name_or_path"):
        data.pop(key, None)
    data["architectures"] = [ARCHITECTURES[arch]]
    if arch == "llama":
        # transformers reads a "llama" file whose name says Mistral as Mistral (sliding
        # window and all); llama.cpp runs every "llama" file as Llama, and so does infer.
        data["model_type"] = "llama"
        data.pop("sliding_window", None)
        # Biases are in the file or not (its metadata does not say).
        data["attention_bias"] = "blk.0.attn_q.bias" in tensors
        data["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    # transformers' mapping leaves head_dim at its default where the heads are not
    # hidden / heads wide (Qwen3): the file says it.
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        data["head_dim"] = int(key_length)
    if arch in ("gemma3", "gemma-embedding"):
        data.update(_gemma3_config(reader, arch, data))
    elif "rope_freqs.weight" not in tensors:
        scaling = _rope_scaling(reader, arch, file)
        if scaling:
            rope = dict(data.get("rope_parameters") or {})
            rope.setdefault("rope_theta", data.get("rope_theta", 10000.0))
            rope.update(scaling)
            data["rope_parameters"] = rope
    experts = _field(reader, f"{arch}.expert_count")
    if experts:
        data.update(_moe_config(reader, arch, int(experts)))
    data["tie_word_embeddings"] = "output.weight" not in tensors
    data.update(_reranker(reader, arch, tensors, file))
    if "rope_freqs.weight" in tensors:
        # A Llama 3 rope's scaling, as llama.cpp's converter stores it: each frequency's divisor
        # (infer's rope reads "freq_factors"; model/rope.py).
        factors = tensors["rope_freqs.weight"].data
        rope = dict(data.get("rope_parameters") or {})
        rope.setdefault("rope_theta", data.get("rope_theta", 10000.0))
        rope.update(rope_type="default", freq_factors=[float(v) for v in factors])
        data["rope_parameters"] = rope
        data.pop("rope_scaling", None)
    data["torch_dtype"] = _compute_dtype(tensors)
    data.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    tokenizer.save_pretrained(out)
    generation: dict[str, Any] = {}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        generation["bos_token_id"] = int(bos)
    ends = _end_tokens(reader)
    if ends:
        generation["eos_token_id"] = ends if len(ends) > 1 else ends[0]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
    _write_pooling(reader, arch, out)


def _write_bert_folder(reader: Any, arch: str, file: Path, out: Path) -> None:
    """config.json, the tokenizer and the pooling of a ``bert``, ``nomic-bert``,
    ``jina-bert-v2`` or ``modern-bert`` file (model/gguf_bert.py)."""
    from infer.model.gguf_bert import (
        bert_config,
        bert_reranker,
        is_bert_reranker,
        write_bert_tokenizer,
    )

    tensors = {t.name: t for t in reader.tensors}
    data = bert_config(reader, arch, tensors, file)
    if arch == "bert" and is_bert_reranker(reader, tensors):
        data |= bert_reranker(reader, tensors, file)
    data["torch_dtype"] = _compute_dtype(tensors)
    (out / "config.json").write_text(json.dumps(data, indent=1) + "\n")
    write_bert_tokenizer(reader, arch, out, file, data["max_position_embeddings"])
    (out / "generation_config.json").write_text("{}\n")
    _write_pooling(reader, arch, out)


def _compute_dtype(tensors: dict[str, Any]) -> str:
    """Weights are dequantized (or kept 4-bit) at load: compute in bf16 unless every tensor is
    float32 (the GGUF's own precision); --dtype overrides it."""
    from gguf import GGMLQuantizationType

    all_f32 = all(t.tensor_type == GGMLQuantizationType.F32 for t in tensors.values())
    return "float32" if all_f32 else "bfloat16"


RANK = 4  # llama.cpp's pooling_type of a reranker (LLAMA_POOLING_TYPE_RANK)
# The config key that says a sequence classifier's head is a GGUF reranker's two-row
# cls.output.weight, [true, false] (model/loader.py makes its one label from them).
RANK_HEAD = "gguf_rank_head"


def _reranker(reader: Any, arch: str, tensors: dict[str, Any], file: Path) -> dict[str, Any]:
    """A reranker file's config (pooling_type RANK), as llama.cpp's converter writes
    Qwen3-Reranker: a two-row ``cls.output.weight`` (the "yes" and "no" rows of its vocabulary
    projection) whose softmax's first value is a pair's score, and a ``rerank`` chat template
    with ``{query}`` and ``{document}`` (llama-server formats each pair with it). Served as a
    one-label classifier, ``W[yes] - W[no]``: the sigmoid of its logit is that softmax value.
    {} for a file that is not a reranker."""
    if int(_field(reader, f"{arch}.pooling_type") or 0) != RANK:
        return {}
    head = tensors.get("cls.output.weight")
    shape = None if head is None else [int(n) for n in reversed(head.shape)]
    if arch != "qwen3" or shape is None or len(shape) != 2 or shape[0] != 2:
        raise ModelLoadError(
            f"{file}: a reranker file (pooling RANK) of architecture {arch!r} with "
            f"cls.output.weight {shape}; infer serves Qwen3-Reranker's (qwen3, a two-row "
            "cls.output.weight)"
        )
    field = reader.fields.get(f"{arch}.classifier.output_labels")
    labels = [] if field is None else [str(v) for v in field.contents()]
    config: dict[str, Any] = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "num_labels": 1,
        "id2label": {"0": labels[0] if labels else "yes"},
        RANK_HEAD: True,
    }
    template = _field(reader, "tokenizer.chat_template.rerank")
    if template:
        config["rerank_template"] = str(template)
    return config


# llama.cpp's pooling_type -> the pooling type's name (model/pooling.py reads its files)
_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}


def _write_pooling(reader: Any, arch: str, out: Path, dense: tuple[str, ...] = (),
                   default: str | None = None) -> None:  # fmt: skip
    """An embedding model's ``{arch}.pooling_type`` (else ``default``) as the
    sentence-transformers files infer reads (mean / CLS / last token, the ``dense`` modules'
    folders, then normalized as llama-server's embeddings are), so its embedding requests pool
    as the file says (or are refused naming the pooling)."""
    kind = _POOLING_TYPES.get(int(_field(reader, f"{arch}.pooling_type") or 0), default)
    if kind is None:
        return  # none (a generative model) or a reranker's: infer's default, the last token
    write_pooling_files(out, kind, normalize=True, dense=dense)


# Token texts llama.cpp ends generation on whatever the file's eos says ("end of turn", "end of
# message" and "end of text" tokens of the common chat formats; its list as of the llama.cpp
# this was checked against), so a chat stops where llama-server's would.
END_TOKEN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
})  # fmt: skip


def _end_tokens(reader: Any) -> list[int]:
    """The ids that end generation: the file's eos, eot and eom ids, then every token whose
    text llama.cpp treats as an end of generation (:data:`END_TOKEN_TEXTS`)."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    ids += [i for i, text in enumerate(tokens) if text in END_TOKEN_TEXTS and i not in ids]
    return ids


def _rope_scaling(reader: Any, arch: str, file: Path) -> dict[str, Any]:
    """The rope scaling a file's metadata names (``rope.scaling.type``): linear, or YaRN from
    its original context (Qwen's long-context files); none, or a start-up error naming a
    type infer does not run."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ModelLoadError(f"{file}: rope scaling {kind!r} is not supported (linear, yarn)")


def _moe_config(reader: Any, arch: str, experts: int) -> dict[str, Any]:
    """A mixture of experts' fields: a "llama" file with experts is a Mixtral (each expert as
    wide as ``feed_forward_length``, the top k renormalised); Qwen2-MoE / Qwen3-MoE experts are
    ``expert_feed_forward_length`` wide, every layer sparse (llama.cpp has no dense ones
    between), Qwen3-MoE's top k renormalised, Qwen2-MoE's not and beside a shared expert."""

    def field(key: str) -> Any:
        return _field(reader, f"{arch}.{key}")

    top_k = int(field("expert_used_count"))
    if arch == "llama":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": experts, "num_experts_per_tok": top_k}  # fmt: skip
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(field("expert_feed_forward_length")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": arch == "qwen3moe",
    }
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = int(field("expert_shared_feed_forward_length"))
    return fields


def _gemma3_config(reader: Any, arch: str, data: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 text model's fields as llama.cpp runs a "gemma3" file: every 6th layer global
    (unless the file lists the pattern), the others sliding over ``sliding_window`` tokens with
    a rope base of 10k (or ``rope.freq_base_swa``) never scaled; the global layers' base and
    linear scaling from the file; queries scaled by 1 / sqrt(head_dim) (27B, 62 layers:
    1 / sqrt(hidden / heads)); a final logit soft-cap only if the file has one."""

    def field(key: str) -> Any:
        return _field(reader, f"{arch}.{key}")

    layers, head_dim = int(field("block_count")), int(data["head_dim"])
    window = field("attention.sliding_window")
    pattern = field("attention.sliding_window_pattern")
    if not window:
        types = ["full_attention"] * layers
    elif isinstance(pattern, list):  # (llama.cpp: true = sliding)
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:  # every n-th layer global; 0: none (llama.cpp's reading)
        n = 6 if pattern is None else int(pattern)
        types = [
            "sliding_attention" if n == 0 or i % n < n - 1 else "full_attention"
            for i in range(layers)
        ]
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(field("rope.freq_base"))}
    if field("rope.scaling.type") == "linear" and field("rope.scaling.factor"):
        full.update(rope_type="linear", factor=float(field("rope.scaling.factor")))
    local = {"rope_type": "default", "rope_theta": float(field("rope.freq_base_swa") or 10000.0)}
    scalar = data["hidden_size"] / data["num_attention_heads"] if layers == 62 else head_dim
    return {
        "model_type": "gemma3_text",
        "layer_types": types,
        "sliding_window": int(window) if window else None,
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": field("final_logit_softcapping"),
        "attn_logit_softcapping": None,
    }


def _field(reader: Any, key: str) -> Any:
    """A scalar or string metadata value of a GGUF reader, None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()

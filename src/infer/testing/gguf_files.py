"""GGUF files written from a Hugging Face folder, the way llama.cpp's converter lays them out.

Tests and benchmarks need GGUF files and no hub: :func:`write_gguf` turns one of the tiny
checkpoints (``infer.testing.checkpoints``) into a GGUF with llama.cpp's metadata keys and
tensor names (through the ``gguf`` package's writer and name map, which llama.cpp maintains),
Llama's q / k rows permuted and Gemma 3's norms plus one as llama.cpp stores them, and each
2-D weight in the type asked for. ``gguf`` quantizes Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 itself;
the K-quants it cannot, so :func:`quantize_q4_k`, :func:`quantize_q5_k` and
:func:`quantize_q6_k` write their blocks here from the format's definition (the ``gguf``
package's dequantization, llama.cpp's reference, reads them back in the tests)::

    block_q4_K (256 weights, 144 bytes): d f16 | dmin f16 | scales[12] | qs[128]
      8 sub-blocks of 32, each with a 6-bit scale sc and a 6-bit min m packed in scales[12]:
        j < 4:  sc = scales[j] & 63,  m = scales[j + 4] & 63
        j >= 4: sc = scales[j + 4] & 15 | (scales[j - 4] >> 6) << 4
                m  = scales[j + 4] >> 4 | (scales[j] >> 6) << 4
      qs: 4 chunks of 32 bytes; chunk c's byte l holds q[64c + l] (low nibble) and
          q[64c + 32 + l] (high nibble)
      weight = d * sc * q - dmin * m

    block_q5_K (256 weights, 176 bytes): d | dmin | scales[12] | qh[32] | qs[128]
      Q4_K's scales and nibbles; bit 2c of qh[l] is bit 4 of q[64c + l], bit 2c + 1 that of
      q[64c + 32 + l]; 5-bit q
    block_q6_K (256 weights, 210 bytes): ql[128] | qh[64] | scales[16] int8 | d f16
      weight = d * scales[i // 16] * (q - 32), 6-bit q; per half h of 128 (ql[64h..],
      qh[32h..]), quarter r = 0..3 of 32 (l = 0..31): the low nibble of ql[l] (r 0), ql[l + 32]
      (r 1), the high nibble of ql[l] (r 2), ql[l + 32] (r 3); bits 2r, 2r + 1 of qh[l] on top
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

QK_K = 256


def _k_quantize(w: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's rounding: each sub-block of 32's range (widened to hold 0) in ``top``
    steps, its scale and min to 6 bits of the super-block's largest. Returns the d and dmin
    (float16 ``[rows, blocks]``), the header's 12 bytes a block, and q ``[rows, blocks, chunk
    c, half, l]`` (value 64c + 32 half + l of each block)."""
    rows, k = w.shape
    sub = w.astype(np.float32).reshape(rows, k // QK_K, 8, 32)
    lo = np.minimum(sub.min(axis=3), 0.0)
    hi = np.maximum(sub.max(axis=3), 0.0)
    scale, mn = (hi - lo) / top, -lo  # both >= 0
    d = (scale.max(axis=2) / 63.0).astype(np.float16)
    dmin = (mn.max(axis=2) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.where(df > 0, np.rint(scale / np.where(df > 0, df, 1)), 0).clip(0, 63).astype(np.uint8)
    m = np.where(dminf > 0, np.rint(mn / np.where(dminf > 0, dminf, 1)), 0)
    m = m.clip(0, 63).astype(np.uint8)
    s, off = (df * sc)[..., None], (dminf * m)[..., None]
    q = np.where(s > 0, np.rint((sub + off) / np.where(s > 0, s, 1)), 0).clip(0, top)
    scales = np.zeros((rows, k // QK_K, 12), np.uint8)
    scales[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    header = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales],
                            axis=2)  # fmt: skip
    return header, q.astype(np.uint8).reshape(rows, k // QK_K, 4, 2, 32)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``[rows, k]`` float (k % 256 == 0) -> Q4_K blocks, uint8 ``[rows, k / 256 * 144]``:
    each sub-block's range in 15 steps (:func:`_k_quantize`)."""
    rows, k = w.shape
    header, q = _k_quantize(w, 15)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(rows, k // QK_K, 128)
    return np.concatenate([header, qs], axis=2).reshape(rows, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """``[rows, k]`` float (k % 256 == 0) -> Q5_K blocks, uint8 ``[rows, k / 256 * 176]``:
    each sub-block's range in 31 steps, the fifth bit in ``qh``."""
    rows, k = w.shape
    header, q = _k_quantize(w, 31)
    qs = ((q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4)).reshape(rows, k // QK_K, 128)
    high = q >> 4  # [rows, blocks, c, half, l]
    qh = np.zeros((rows, k // QK_K, 32), np.uint8)
    for c in range(4):
        qh |= (high[:, :, c, 0] << (2 * c)) | (high[:, :, c, 1] << (2 * c + 1))
    return np.concatenate([header, qh, qs], axis=2).reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``[rows, k]`` float (k % 256 == 0) -> Q6_K blocks, uint8 ``[rows, k / 256 * 210]``:
    each group of 16 symmetric over 31 steps a side, its scale an int8 multiple of the
    super-block's ``d``."""
    rows, k = w.shape
    sub = w.astype(np.float32).reshape(rows, k // QK_K, 16, 16)
    scale = np.abs(sub).max(axis=3) / 31.0
    d = (scale.max(axis=2) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    sc = np.where(df > 0, np.rint(scale / np.where(df > 0, df, 1)), 0).clip(0, 127)
    s = (df * sc)[..., None]
    q = np.where(s > 0, np.rint(sub / np.where(s > 0, s, 1)), 0).clip(-32, 31) + 32
    q = q.astype(np.uint8).reshape(rows, k // QK_K, 2, 4, 32)  # half h, quarter r, l
    lo, hi = q & 15, q >> 4
    ql = np.concatenate([lo[:, :, :, 0] | (lo[:, :, :, 2] << 4),
                         lo[:, :, :, 1] | (lo[:, :, :, 3] << 4)], axis=3)  # fmt: skip
    qh = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
    blocks = np.concatenate([ql.reshape(rows, k // QK_K, 128), qh.reshape(rows, k // QK_K, 64),
                             sc.astype(np.int8).view(np.uint8), d[..., None].view(np.uint8)],
                            axis=2)  # fmt: skip
    return blocks.reshape(rows, -1)


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's order of a Llama q / k projection's rows (each head's two rotary halves
    interleaved); ``n_head``: the projection's own head count."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    folder: Path,
    out: Path,
    weight_type: str = "F32",
    name: str = "tiny",
    drop: tuple = (),
    pooling: str | None = None,
    reranker: tuple[int, int, str] | None = None,
    types: dict[str, str] | None = None,
) -> Path:
    """Write the Hugging Face checkpoint in ``folder`` (a Llama, Mistral, Qwen2, Qwen3, a
    Gemma 3 whose every 6th layer is global and whose queries scale by its head size, or a
    Mixtral / Qwen2-MoE / Qwen3-MoE with no dense layers: experts stacked per layer) as
    GGUF ``out``: 2-D weights whose inputs split into its blocks in ``weight_type`` (F32, F16,
    BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; ``types``: another type for the
    tensors whose GGUF name holds a key, e.g. ``{"attn_v": "Q6_K"}`` as in a Q4_K_M file), the
    others and every 1-D tensor in F32; the Hugging Face
    tensors named in ``drop`` left out (a damaged file, for tests); ``pooling`` (MEAN, CLS,
    LAST) marks an embedding model; ``reranker`` ``(true id, false id, template)``: a causal
    reranker as llama.cpp's converter writes Qwen3-Reranker (pooling RANK, the two rows of its
    vocabulary projection as ``cls.output.weight`` in place of an untied one, labels
    ``yes`` / ``no``, the ``rerank`` chat template)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((Path(folder) / "config.json").read_text())
    arch = _ARCH.get(config["model_type"], config["model_type"])
    embedding_gemma = config.get("use_bidirectional_attention", False)
    if embedding_gemma:
        arch = "gemma-embedding"
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    if arch in ("gemma3", "gemma-embedding"):  # the global layers' rope (local: 10k)
        rope = rope["full_attention"]
        writer.add_sliding_window(config["sliding_window"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") in ("linear", "yarn"):
        kind = (
            gguf.RopeScalingType.LINEAR
            if rope["rope_type"] == "linear"
            else gguf.RopeScalingType.YARN
        )
        writer.add_rope_scaling_type(kind)
        writer.add_rope_scaling_factor(rope["factor"])
        if rope.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    if pooling is not None:
        writer.add_pooling_type(gguf.PoolingType[pooling])
    if reranker is not None:
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_classifier_output_labels(["yes", "no"])
        writer.add_string(gguf.Keys.Tokenizer.CHAT_TEMPLATE_N.format(name="rerank"), reranker[2])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            size = config["shared_expert_intermediate_size"]
            writer.add_expert_shared_feed_forward_length(size)
    _write_tokenizer(writer, Path(folder))

    def tensor_type(gguf_name: str, w: np.ndarray) -> Any:
        kind = next((t for key, t in (types or {}).items() if key in gguf_name), weight_type)
        qtype = gguf.GGMLQuantizationType[kind]
        fits = w.ndim >= 2 and w.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
        return qtype if fits else gguf.GGMLQuantizationType.F32

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], layers)
    state: dict[str, Any] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(file)))
    if embedding_gemma:  # (a bare Gemma3TextModel's names; its Dense modules as llama.cpp's)
        state = {f"model.{k}": v for k, v in state.items()}
        for dense, path in (("dense_2", "2_Dense"), ("dense_3", "3_Dense")):
            if (Path(folder) / path / "model.safetensors").is_file():
                w = load_file(str(Path(folder) / path / "model.safetensors"))["linear.weight"]
                writer.add_dense_features_dims(dense, w.shape[1], w.shape[0])
                _add(writer, f"{dense}.weight", w.astype(np.float32), tensor_type(dense, w))
    state = _stack_experts({k: v for k, v in state.items() if k not in drop})
    if reranker is not None:
        vocab = state.pop("lm_head.weight", None)
        vocab = state["model.embed_tokens.weight"] if vocab is None else vocab
        head = np.stack([vocab[reranker[0]], vocab[reranker[1]]]).astype(np.float32)
        _add(writer, "cls.output.weight", head, gguf.GGMLQuantizationType.F32)
    for hf_name, tensor in state.items():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        w = tensor.astype(np.float32)
        if arch in ("gemma3", "gemma-embedding") and hf_name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp stores the (1 + w) Gemma's norms multiply by
        if arch == "llama" and hf_name.endswith(
            ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
        ):
            w = permute_rows(w, heads if "q_proj" in hf_name else kv_heads)
        if hf_name.endswith("shared_expert_gate.weight"):
            w = w[0]  # Qwen2-MoE's [1, hidden] gate, stored as llama.cpp reads it: [hidden]
        _add(writer, f"{gguf_name}.{suffix}", w, tensor_type(gguf_name, w))
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_freq_factors(Path(folder)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# Hugging Face model_type -> llama.cpp architecture, where they differ.
_ARCH = {"gemma3_text": "gemma3", "mistral": "llama", "mixtral": "llama",
         "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}  # fmt: skip


def _stack_experts(state: dict[str, Any]) -> dict[str, Any]:
    """Each layer's experts' ``LAYER.experts.E.PART`` as one ``LAYER.experts.PART``
    ``[experts, rows, cols]`` tensor, as llama.cpp stores them."""
    pattern = re.compile(r"^(.+\.experts)\.(\d+)\.(.+)$")
    out: dict[str, Any] = {}
    stacks: dict[str, dict[int, Any]] = {}
    for name, tensor in state.items():
        match = pattern.match(name)
        if match is None:
            out[name] = tensor
        else:
            stacks.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = tensor
    for name, parts in stacks.items():
        out[name] = np.stack([parts[i] for i in range(len(parts))])
    return out


def _llama3_freq_factors(folder: Path) -> np.ndarray:
    """A Llama 3 rope's scaling as llama.cpp stores it: each frequency's divisor, here
    transformers' plain frequencies over its Llama 3 ones."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(folder)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    theta = config.rope_parameters["rope_theta"]
    dim = config.head_dim
    plain = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    return (plain / scaled.double().numpy()).astype(np.float32)


def _add(writer: Any, name: str, w: np.ndarray, qtype: Any) -> None:
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, w)
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:  # 2-D, or 3-D (stacked experts): quantized row by row, the rows' bytes re-stacked
        rows = w.reshape(-1, w.shape[-1])
        k_quants = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
        if qtype.name in k_quants:
            blocks = k_quants[qtype.name](rows)
        else:
            blocks = gguf.quants.quantize(rows, qtype)
        writer.add_tensor(name, blocks.reshape(*w.shape[:-1], -1), raw_dtype=qtype)


def _write_tokenizer(writer: Any, folder: Path) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp stores one ("gpt2" model)."""
    import gguf

    data = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    special = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    vocab.update(special)
    size = json.loads((folder / "config.json").read_text())["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if text in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    generation_file = folder / "generation_config.json"  # (an encoder's: its config's)
    if not generation_file.is_file():
        generation_file = folder / "config.json"
    generation = json.loads(generation_file.read_text())
    writer.add_bos_token_id(generation["bos_token_id"])
    writer.add_eos_token_id(generation["eos_token_id"])
    writer.add_add_bos_token(False)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    template = tok_config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def write_bert_gguf(
    folder: Path,
    out: Path,
    weight_type: str = "F32",
    pooling: str | None = None,
    lowercase: bool | None = True,
) -> Path:
    """Write the BERT / (XLM-)RoBERTa / Nomic BERT / Jina BERT v2 / ModernBERT embedding
    model or cross-encoder in ``folder`` (``infer.testing.encoders``: a WordPiece or byte-level
    BPE tokenizer) as GGUF ``out`` the way llama.cpp's converter writes one: architecture
    ``bert`` (``nomic-bert``: its rope base, no position table; ``jina-bert-v2``: no position
    table, the gated MLP's ``gated_layers`` whole as ``ffn_up``; ``modern-bert``: its two rope
    bases, window and layer pattern), a WordPiece vocabulary with U+2581 before each word's
    first piece and ``##`` dropped from the others (control tokens as they are; a BPE one as it
    is, with its merges: ``gpt2``), an (XLM-)RoBERTa's position table without its first
    ``pad + 1`` rows, no pooler (a
    cross-encoder: its head as ``cls`` / ``cls.output``, its labels, no pooling type); 2-D
    weights in ``weight_type``; ``pooling`` (MEAN, CLS, LAST, RANK) as ``bert.pooling_type``;
    ``lowercase`` as ``tokenizer.ggml.normalizer.lowercase`` (None: left out, as in files
    written before llama.cpp stored it)."""
    import gguf
    from safetensors.numpy import load_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    robertas = ("xlm-roberta", "roberta")
    offset = config["pad_token_id"] + 1 if config["model_type"] in robertas else 0
    nomic = config["model_type"] == "nomic_bert"
    jina = config.get("position_embedding_type") == "alibi"
    modern = config["model_type"] == "modernbert"
    arch = ("nomic-bert" if nomic else "jina-bert-v2" if jina else "modern-bert" if modern
            else "bert")  # fmt: skip
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("tiny-encoder")
    writer.add_context_length(config["max_position_embeddings"] - offset)
    if nomic:
        writer.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    if modern:  # (global: every third layer from the first, as transformers' default)
        ropes = config["rope_parameters"]
        writer.add_rope_freq_base(float(ropes["full_attention"]["rope_theta"]))
        writer.add_rope_freq_base_swa(float(ropes["sliding_attention"]["rope_theta"]))
        writer.add_sliding_window(config["local_attention"])
        writer.add_sliding_window_pattern(3)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(float(config["norm_eps" if modern else "layer_norm_eps"]))
    writer.add_causal_attention(False)
    if pooling is not None:
        writer.add_pooling_type(gguf.PoolingType[pooling])
    if config["architectures"][0].endswith("ForSequenceClassification"):  # a cross-encoder
        labels = config["id2label"]
        writer.add_classifier_output_labels([labels[str(i)] for i in range(len(labels))])
        if modern:  # (llama.cpp's MEAN 1, CLS 2)
            pooled = {"mean": 1, "cls": 2}[config.get("classifier_pooling", "cls")]
            writer.add_uint32("modern-bert.classifier.pooling_type", pooled)
    data = json.loads((folder / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in data.get("added_tokens", []) if t["special"]}
    tokens = [""] * config["vocab_size"]
    types = [gguf.TokenType.NORMAL] * config["vocab_size"]
    bpe = data["model"]["type"] == "BPE"
    for text, i in data["model"]["vocab"].items():
        if text in special:
            tokens[i], types[i] = text, gguf.TokenType.CONTROL
        elif bpe:
            tokens[i] = text
        else:
            tokens[i] = text[2:] if text.startswith("##") else "\u2581" + text
    writer.add_tokenizer_model("gpt2" if bpe else "bert")
    writer.add_tokenizer_pre("gpt-2" if bpe else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if bpe:
        merges = data["model"]["merges"]
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    if not modern:
        writer.add_token_type_count(config["type_vocab_size"])
    # (as llama.cpp's converter: [CLS] as bos and [SEP] as eos; it has no key for "cls")
    names = ("<s>", "</s>", "<unk>", "</s>", "<pad>", "<mask>") if "<s>" in special else (
        "[CLS]", "[SEP]", "[UNK]", "[SEP]", "[PAD]", "[MASK]")  # fmt: skip
    for key, text in zip(("BOS", "EOS", "UNK", "SEP", "PAD", "MASK"), names, strict=True):
        writer.add_uint32(getattr(gguf.Keys.Tokenizer, f"{key}_ID"), special[text])
    if lowercase is not None:
        writer.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)
    kind = {
        "nomic-bert": gguf.MODEL_ARCH.NOMIC_BERT,
        "jina-bert-v2": gguf.MODEL_ARCH.JINA_BERT_V2,
        "modern-bert": gguf.MODEL_ARCH.MODERN_BERT,
    }
    name_map = gguf.get_tensor_name_map(kind.get(arch, gguf.MODEL_ARCH.BERT), layers)
    state: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    for hf_name, tensor in state.items():
        hf_name = hf_name.removeprefix("bert.").removeprefix("roberta.").removeprefix("model.")
        if hf_name.startswith("pooler.") or hf_name.endswith("position_ids"):
            continue  # (llama.cpp's converter drops them, a BERT classifier's pooler too)
        if hf_name.startswith("classifier.") and hf_name.count(".") == 1:  # (BERT's head)
            hf_name = hf_name.replace("classifier.", "classifier.out_proj.")
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        w = tensor.astype(np.float32)
        if gguf_name == "position_embd":
            w = w[offset:]
        qtype = gguf.GGMLQuantizationType[weight_type]
        fits = w.ndim == 2 and w.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
        _add(writer, f"{gguf_name}.{suffix}", w, qtype if fits else gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def build_wide_llama(out: Path, tokenizer_folder: Path) -> Path:
    """A tiny random Llama whose layers' inputs are 256 and 512 wide (Q4_K's blocks are 256
    inputs; the tiny checkpoints' 64 are too narrow), tied embeddings, the tokenizer of
    ``tokenizer_folder``; saved by transformers into ``out`` (once)."""

    import torch
    import transformers

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    eos = json.loads((Path(tokenizer_folder) / "generation_config.json").read_text())
    eos_id = eos["eos_token_id"]
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    # (wide enough weights that greedy tokens are not a flat tie)
    return _save_random(transformers.LlamaForCausalLM(config), 0.05, out, Path(tokenizer_folder))


def build_gemma3_for_gguf(out: Path, tokenizer_folder: Path) -> Path:
    """A tiny random Gemma 3 text model as llama.cpp runs one: 6 layers, the 6th global (its
    rope linearly scaled by 4, as Gemma 3 4B's), the others sliding over 16 tokens, queries
    scaled by 1 / sqrt(head_dim), no soft-cap; saved by transformers into ``out`` (once)."""

    import torch
    import transformers

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    eos_id = json.loads((Path(tokenizer_folder) / "generation_config.json").read_text())[
        "eos_token_id"
    ]
    config = transformers.Gemma3TextConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=16, max_position_embeddings=1024, final_logit_softcapping=None,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        architectures=["Gemma3ForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.3 if name.endswith("norm.weight") else 0.1)
    model.save_pretrained(out)
    _copy_tokenizer(Path(tokenizer_folder), out)
    return out


def build_sparse_qwen2_moe(out: Path, qwen2_moe_folder: Path) -> Path:
    """The tiny Qwen2-MoE's config with every layer sparse (llama.cpp's "qwen2moe" has no
    dense layers between), random weights; saved by transformers into ``out`` (once)."""

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    config = AutoConfig.from_pretrained(qwen2_moe_folder)
    config.mlp_only_layers = []
    torch.manual_seed(0)
    return _save_random(AutoModelForCausalLM.from_config(config), 0.1, out, Path(qwen2_moe_folder))


def _save_random(model: Any, std: float, out: Path, tokenizer_source: Path) -> Path:
    """``model`` with its 2-D weights drawn from N(0, std), saved into ``out`` beside the
    tokenizer of ``tokenizer_source``."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, std)
    model.save_pretrained(out)
    _copy_tokenizer(tokenizer_source, out)
    return out


def _copy_tokenizer(source: Path, out: Path) -> None:
    """The tokenizer, chat template and generation config of ``source`` into ``out``."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "chat_template.jinja"):  # fmt: skip
        if (source / name).is_file():
            shutil.copy(source / name, out / name)

"""BERT-family GGUF files (llama.cpp's ``bert`` architecture): an embedding model's file gives
its folder's vectors and tokens, pools as the file says, and what infer cannot read is refused
naming it.

The files are written by ``infer.testing.gguf_files.write_bert_gguf`` as llama.cpp's
converter lays them out (test_gguf_llamacpp.py repeats the first check with the converter
itself, and against llama-server, where a llama.cpp tree is at hand)."""

from __future__ import annotations

import pytest
import torch

from infer.core.pooling_params import PoolingParams
from infer.data.corpus import load_corpus
from infer.model.folders import ModelLoadError, find_model_folder
from infer.testing.encoders import build_encoder, default_encoder_root
from infer.testing.gguf_files import write_bert_gguf, write_gguf

from .conftest import PROMPTS

TEXTS = [PROMPTS[0], PROMPTS[5], "a", "Hello, World! Naïve CAFÉ 東京 x\u00a0y", PROMPTS[2]]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def encoder_root():
    return default_encoder_root()


def _corpus_lines() -> list[str]:
    return [line for doc in load_corpus(include_docstrings=False) for line in doc.splitlines()]


def _vectors(results) -> torch.Tensor:
    return torch.tensor([r.outputs.embedding for r in results])


@pytest.mark.parametrize(
    "kind", ["bert", "xlm_roberta", "roberta", "nomic_bert", "jina", "jina_code", "modernbert"]
)
def test_a_float32_file_embeds_exactly_as_its_folder(kind, encoder_root, make_llm, tmp_path):
    """Same tokens, same vectors (every weight as stored; an (XLM-)RoBERTa's position table
    stored without its first pad + 1 rows; a RoBERTa's byte-level BPE vocabulary with its
    merges; a Nomic BERT as ``nomic-bert``: fused q/k/v, rope base from the file; a Jina BERT
    v2 as ``jina-bert-v2``: ALiBi, the gated MLP whole in ``ffn_up``; a ModernBERT as
    ``modern-bert``: two rope bases, its local window and layer pattern, a byte-level BPE
    vocabulary with BERT's [CLS] / [SEP]), the pooling the file names (its folder's MEAN)."""
    from infer.testing.encoders import build_jina

    if kind.startswith("jina"):
        code = kind == "jina_code"  # (q / k norms, a second residual norm, its MLP's up first)
        folder = build_jina(encoder_root, name="jina-code" if code else None, code=code)
    elif kind == "modernbert":
        folder = build_encoder(kind, encoder_root, name="modernbert-mean-bpe", bpe=True)
    else:
        folder = build_encoder(kind, encoder_root)
    file = write_bert_gguf(folder, tmp_path / f"{kind}.gguf", pooling="MEAN")
    want = make_llm(str(folder), dtype="float32")
    want_results = want.embed(TEXTS)
    want.shutdown()
    llm = make_llm(str(file), dtype="auto")
    results = llm.embed(TEXTS)
    assert llm.engine.model.word_embeddings.weight.dtype == torch.float32  # (all F32)
    assert llm.engine.pooler_config.pooling_type == "MEAN"
    assert [r.prompt_token_ids for r in results] == [r.prompt_token_ids for r in want_results]
    torch.testing.assert_close(_vectors(results), _vectors(want_results), atol=1e-6, rtol=0)


def test_a_quantized_file_embeds_close_to_its_folder(encoder_root, make_llm, tmp_path):
    """Q8_0 linears and embeddings, computed in bf16: cosine over 0.99 with the float32
    folder's vectors. An encoder's Q8_0 layers are dequantized by default (every input is one
    compute-bound pass: int8 weights buy no speed); ``--gguf-int8`` holds them in int8."""
    folder = build_encoder("bert", encoder_root, "mean")
    file = write_bert_gguf(folder, tmp_path / "bert-q8.gguf", "Q8_0", pooling="MEAN")
    want = make_llm(str(folder), dtype="float32")
    want_vectors = _vectors(want.embed(TEXTS))
    want.shutdown()
    for gguf_int8 in (None, True):
        llm = make_llm(str(file), dtype="auto", gguf_int8=gguf_int8)
        if gguf_int8 and not llm.engine._checkpoint_int8(None):
            llm.shutdown()
            continue  # (int8 layers need the CPU kernels)
        held = {type(m).__name__ for layer in llm.engine.model.layers
                for m in (layer.qkv_proj, layer.intermediate)}  # fmt: skip
        assert (held == {"Int8Linear"}) if gguf_int8 else ("Int8Linear" not in held), held
        got = _vectors(llm.embed(TEXTS))
        llm.shutdown()
        cosine = torch.nn.functional.cosine_similarity(got, want_vectors)
        assert cosine.min() > 0.99, cosine


def test_the_files_tokenizer_is_its_folders(encoder_root, tmp_path):
    """The WordPiece vocabulary rebuilt from llama.cpp's word-start marks encodes every corpus
    line, and a pair, as the folder's tokenizer does, and decodes back the same text."""
    from transformers import AutoTokenizer

    folder = build_encoder("bert", encoder_root, "mean")
    file = write_bert_gguf(folder, tmp_path / "bert.gguf")
    want = AutoTokenizer.from_pretrained(folder)
    got = AutoTokenizer.from_pretrained(find_model_folder(file))
    lines = [line for line in _corpus_lines() if line][:400]
    for text in [*lines, *TEXTS]:
        ids = want(text)["input_ids"]
        assert got(text)["input_ids"] == ids, text
        assert got.decode(ids, skip_special_tokens=True) == want.decode(
            ids, skip_special_tokens=True
        )
    pair = got(TEXTS[0], TEXTS[1])["input_ids"]
    assert pair == want(TEXTS[0], TEXTS[1])["input_ids"]
    assert (got.cls_token, got.sep_token, got.pad_token) == ("[CLS]", "[SEP]", "[PAD]")


@pytest.mark.parametrize("lowercase", [True, False, None])
def test_lowercasing_follows_the_file(lowercase, encoder_root, tmp_path):
    """``tokenizer.ggml.normalizer.lowercase``: false keeps case (an upper-case word the
    lower-case vocabulary lacks is [UNK]); true, and a file from before llama.cpp wrote the
    key, lowercase."""
    from transformers import AutoTokenizer

    folder = build_encoder("bert", encoder_root, "mean")
    file = write_bert_gguf(folder, tmp_path / "bert.gguf", lowercase=lowercase)
    got = AutoTokenizer.from_pretrained(find_model_folder(file))
    lower, upper = got("the")["input_ids"], got("THE")["input_ids"]
    assert (upper == lower) == (lowercase is not False)
    if lowercase is False:
        assert upper[1] == got.unk_token_id


@pytest.mark.parametrize("pooling", ["CLS", "LAST"])
def test_the_files_pooling_type_is_used(pooling, encoder_root, make_llm, tmp_path):
    """``bert.pooling_type`` CLS / LAST: each vector is that token's state, normalized, as
    the folder's engine gives with the same pooling asked by --pooler-config."""
    folder = build_encoder("bert", encoder_root, "mean")
    file = write_bert_gguf(folder, tmp_path / f"bert-{pooling}.gguf", pooling=pooling)
    override = {"pooling_type": pooling}
    want = make_llm(str(folder), dtype="float32", pooler_config=override)
    want_vectors = _vectors(want.embed(TEXTS))
    want.shutdown()
    llm = make_llm(str(file))
    assert llm.engine.pooler_config.pooling_type == pooling
    torch.testing.assert_close(_vectors(llm.embed(TEXTS)), want_vectors, atol=1e-6, rtol=0)
    raw = _vectors(llm.embed(TEXTS, PoolingParams(normalize=False)))
    assert not torch.allclose(raw.norm(dim=1), torch.ones(len(TEXTS)))


def test_a_file_without_a_pooling_type_pools_the_first_token(encoder_root, make_llm, tmp_path):
    folder = build_encoder("bert", encoder_root, "mean")
    file = write_bert_gguf(folder, tmp_path / "bert-none.gguf")
    assert make_llm(str(file)).engine.pooler_config.pooling_type == "CLS"


def test_a_sentencepiece_vocabulary_is_read_as_a_unigram_tokenizer(tmp_path):
    """An XLM-RoBERTa's vocabulary as llama.cpp stores it (``t5``: pieces, scores, control
    tokens): the rebuilt Unigram tokenizer encodes as the one it came from, ``<s> A </s>``
    (spaces collapsed and stripped, as SentencePiece's remove_extra_whitespaces does)."""
    import json

    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    from infer.model.gguf_bert import write_bert_tokenizer

    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=special, unk_token="<unk>",
                                      show_progress=False)  # fmt: skip
    lines = [line for line in _corpus_lines() if line][:2000]
    tok.train_from_iterator(lines, trainer=trainer)
    vocab = tok.get_vocab(with_added_tokens=True)
    pieces = sorted(vocab, key=vocab.get)
    scores = dict(json.loads(tok.to_str())["model"]["vocab"])
    file = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(file), "bert")
    writer.add_tokenizer_model("t5")
    writer.add_add_space_prefix(True)  # (as llama.cpp's converter writes XLM-RoBERTa's)
    writer.add_remove_extra_whitespaces(True)
    writer.add_token_list(pieces)
    writer.add_token_scores([float(scores[p]) for p in pieces])
    control = {"<s>", "<pad>", "</s>", "<mask>"}
    writer.add_token_types([3 if p in control else 2 if p == "<unk>" else 1 for p in pieces])
    for key, text in (("BOS", "<s>"), ("EOS", "</s>"), ("UNK", "<unk>"), ("PAD", "<pad>"),
                      ("MASK", "<mask>")):  # fmt: skip
        writer.add_uint32(getattr(gguf.Keys.Tokenizer, f"{key}_ID"), vocab[text])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "tok"
    out.mkdir()
    write_bert_tokenizer(gguf.GGUFReader(file), "bert", out, file, 128)
    got = AutoTokenizer.from_pretrained(out)
    for text in [*lines[:300], *TEXTS[:3]]:
        want = [vocab["<s>"], *tok.encode(" ".join(text.split())).ids, vocab["</s>"]]
        assert got(text)["input_ids"] == want, text
    assert (got.cls_token, got.sep_token, got.unk_token) == ("<s>", "</s>", "<unk>")


def test_what_infer_cannot_read_is_refused_naming_it(encoder_root, tmp_path):
    """A BPE vocabulary in a bert file (RoBERTa's), causal attention, a missing table."""
    import gguf

    folder = build_encoder("bert", encoder_root, "mean")
    file = write_bert_gguf(folder, tmp_path / "bert.gguf")
    reader = gguf.GGUFReader(file)

    def rewrite(name: str, change) -> object:
        out = tmp_path / name
        writer = gguf.GGUFWriter(str(out), "bert")
        for key, field in reader.fields.items():
            if key.startswith(("GGUF.", "general.architecture")):
                continue
            value = change(key, field.contents())
            if value is None:
                continue
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, kind, sub_type=sub)
        for tensor in reader.tensors:
            if change(tensor.name, tensor) is not None:
                writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return out

    bpe = rewrite("bpe.gguf", lambda k, v: "gpt2" if k == "tokenizer.ggml.model" else v)
    with pytest.raises(ModelLoadError, match="a byte-level BPE vocabulary without its merges"):
        find_model_folder(bpe)
    causal = rewrite("causal.gguf", lambda k, v: True if k == "bert.attention.causal" else v)
    with pytest.raises(ModelLoadError, match="causal attention"):
        find_model_folder(causal)
    no_table = rewrite("nopos.gguf", lambda k, v: None if k == "position_embd.weight" else v)
    with pytest.raises(ModelLoadError, match="position_embd.weight is missing"):
        find_model_folder(no_table)


def test_a_4_bit_jina_code_file_keeps_its_mlp_halves_in_order(encoder_root, make_llm, tmp_path):
    """Jina's code model as Q4_0 in bf16 (the default on a CPU): its gated MLP's rows are
    reordered (up half first in the file), so its 4-bit integers are not kept as the file
    orders them; the vectors stay close to the float32 folder's."""
    from infer.testing.encoders import build_jina

    folder = build_jina(encoder_root, name="jina-code", code=True)
    file = write_bert_gguf(folder, tmp_path / "jina-code-q4.gguf", "Q4_0", pooling="MEAN")
    want = make_llm(str(folder), dtype="float32")
    want_vectors = _vectors(want.embed(TEXTS))
    want.shutdown()
    llm = make_llm(str(file), dtype="bfloat16")
    held = {type(m).__name__ for layer in llm.engine.model.layers for m in (layer.gate_up,)}
    assert "Int4Linear" not in held  # (the MLP's reordered rows: from its float weights)
    cosine = torch.nn.functional.cosine_similarity(_vectors(llm.embed(TEXTS)), want_vectors)
    assert cosine.min() > 0.95, cosine


def test_a_jina_file_infer_cannot_run_is_refused_naming_it(encoder_root, tmp_path):
    """A jina-bert-v2 file whose gated MLP is split in two (``ffn_gate`` beside ``ffn_up``, as
    older llama.cpp converters wrote them), with a q norm but not the code model's other
    norms, or a reranker (jina-reranker: its ``cls`` head)."""
    import gguf

    from infer.testing.encoders import build_jina

    file = write_bert_gguf(build_jina(encoder_root), tmp_path / "jina.gguf")
    reader = gguf.GGUFReader(file)
    for extra, says in (
        ("blk.0.ffn_gate", " file with the gated MLP's halves split"),
        ("blk.0.attn_q_norm", " file with only some of Jina's code model's"),
        ("cls", " reranker file"),
    ):
        out = tmp_path / f"{extra}.gguf"
        writer = gguf.GGUFWriter(str(out), "jina-bert-v2")
        for key, field in reader.fields.items():
            if not key.startswith(("GGUF.", "general.architecture")):
                kind = field.types[0]
                sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), kind, sub_type=sub)
        for tensor in reader.tensors:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        writer.add_tensor(f"{extra}.weight", reader.tensors[0].data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ModelLoadError, match=f"a jina-bert-v2{says}"):
            find_model_folder(out)


@pytest.mark.parametrize("kind", ["roberta", "modernbert"])
def test_a_byte_level_bpe_vocabulary_tokenizes_as_its_folder(kind, encoder_root, tmp_path):
    """A RoBERTa's or ModernBERT's byte-level BPE vocabulary (``gpt2``, with its merges)
    read back from the file: 300 corpus lines, odd spacing and non-ASCII text give the
    folder's tokens, single and in pairs (RoBERTa's ``<s> A </s></s> B </s>``; ModernBERT's
    ``[CLS] A [SEP] B [SEP]``)."""
    import gguf
    from transformers import AutoTokenizer

    from infer.model.gguf_bert import write_bert_tokenizer

    name = "modernbert-mean-bpe" if kind == "modernbert" else None
    folder = build_encoder(kind, encoder_root, name=name, bpe=True)
    file = write_bert_gguf(folder, tmp_path / f"{kind}.gguf")
    out = tmp_path / "tok"
    out.mkdir()
    arch = "modern-bert" if kind == "modernbert" else "bert"
    write_bert_tokenizer(gguf.GGUFReader(file), arch, out, file, 128)
    got, want = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(folder)
    texts = [*_corpus_lines()[:300], *TEXTS, "  two  spaces ", "\ttab\nnewline", "émoji 🚀"]
    for text in texts:
        assert got(text)["input_ids"] == want(text)["input_ids"], text
    assert got(TEXTS[0], TEXTS[2])["input_ids"] == want(TEXTS[0], TEXTS[2])["input_ids"]


@pytest.mark.parametrize("pooling", [None, "RANK"])
def test_a_reranker_file_scores_pairs_as_its_folder(pooling, encoder_root, make_llm, tmp_path):
    """An XLM-RoBERTa cross-encoder (BGE-reranker's shape) as llama.cpp's converter writes it
    (its head as ``cls`` and ``cls.output``, no pooling type: llama-server takes
    ``--reranking``), or saying pooling RANK: each (query, document) pair's score is the
    folder's (the sigmoid of the one label's logit), its label the file's."""
    from infer.testing.encoders import build_cross_encoder

    folder = build_cross_encoder("xlm_roberta", encoder_root)
    file = write_bert_gguf(folder, tmp_path / "rr.gguf", pooling=pooling)
    query, docs = TEXTS[0], [TEXTS[1], TEXTS[2], TEXTS[4]]
    want = make_llm(str(folder))
    want_scores = [o.outputs.score for o in want.score(query, docs)]
    want.shutdown()
    llm = make_llm(str(file))
    assert llm.engine.spec.labels == ("LABEL_0",)
    scores = [o.outputs.score for o in llm.score(query, docs)]
    assert scores == pytest.approx(want_scores, abs=1e-6)
    assert len(set(scores)) == len(scores)


@pytest.mark.parametrize("pooled", ["mean", "cls"])
def test_a_modernbert_reranker_file_scores_pairs_as_its_folder(pooled, encoder_root, make_llm,
                                                               tmp_path):  # fmt: skip
    """A ModernBERT cross-encoder (gte-reranker-modernbert's kind) as llama.cpp's converter
    writes it (``cls`` with its bias, ``cls.norm``, ``cls.output``, ``classifier.pooling_type``
    mean or CLS): each pair's score is the folder's."""
    from infer.testing.encoders import build_cross_encoder

    folder = build_cross_encoder("modernbert", encoder_root, bpe=True, classifier_pooling=pooled,
                                 classifier_bias=True)  # fmt: skip
    file = write_bert_gguf(folder, tmp_path / "rr.gguf")
    query, docs = TEXTS[0], [TEXTS[1], TEXTS[2], TEXTS[4]]
    want = make_llm(str(folder))
    want_scores = [o.outputs.score for o in want.score(query, docs)]
    want.shutdown()
    llm = make_llm(str(file))
    assert llm.engine.runner.pooling_type == pooled.upper()
    scores = [o.outputs.score for o in llm.score(query, docs)]
    assert scores == pytest.approx(want_scores, abs=1e-6)
    assert len(set(scores)) == len(scores)


def test_a_bert_reranker_file_without_its_pooler_is_refused(encoder_root, tmp_path):
    """llama.cpp's converter drops a BERT classifier's pooler (dense + tanh before the
    label's row): such a file's scores are not the model's, and it is refused naming why."""
    from infer.testing.encoders import build_cross_encoder

    folder = build_cross_encoder("bert", encoder_root)
    file = write_bert_gguf(folder, tmp_path / "bert-rr.gguf")
    with pytest.raises(ModelLoadError, match="without both cls.weight and cls.output.weight"):
        find_model_folder(file)


def _embedding_gemma(encoder_root, tiny_checkpoints, dense: bool = True):
    """A tiny EmbeddingGemma in llama.cpp's layer pattern (every 6th layer global, the others
    sliding over 16 positions: 8 either side) with its two bias-free Dense projections (64 ->
    256 -> 64) where ``dense``; pooled by the mean, unnormalized (its folder's files)."""
    from infer.testing.encoders import build_embedding_gemma, with_dense_modules

    folder = build_embedding_gemma(encoder_root, tiny_checkpoints["gemma3"],
                                   name="embedding-gemma-6", num_hidden_layers=6,
                                   sliding_window=16, layer_types=None)  # fmt: skip
    if not dense:
        return folder
    return with_dense_modules(folder, encoder_root / "embedding-gemma-6-dense", [256, 64],
                              plain=True)  # fmt: skip


@pytest.mark.parametrize("dense", [True, False])
def test_an_embedding_gemma_file_embeds_exactly_as_its_folder(dense, encoder_root,
                                                              tiny_checkpoints, make_llm,
                                                              tmp_path):  # fmt: skip
    """llama.cpp's ``gemma-embedding`` file (Gemma 3's metadata and tensors under another
    name, Dense projections as ``dense_2`` / ``dense_3``): the folder's tokens and vectors,
    normalized as llama-server's are, through every sliding layer (inputs past its window)."""
    folder = _embedding_gemma(encoder_root, tiny_checkpoints, dense)
    file = write_gguf(folder, tmp_path / "eg.gguf", pooling="MEAN")
    texts = TEXTS + [PROMPTS[5] * 2]
    want = make_llm(str(folder), dtype="float32")
    want_results = want.embed(texts, PoolingParams(normalize=True))
    want.shutdown()
    llm = make_llm(str(file), dtype="auto")
    assert llm.engine.spec.is_encoder and llm.engine.pooler_config.pooling_type == "MEAN"
    assert len(llm.engine.pooler_config.dense) == (2 if dense else 0)
    results = llm.embed(texts)
    assert [r.prompt_token_ids for r in results] == [r.prompt_token_ids for r in want_results]
    assert max(len(r.prompt_token_ids) for r in results) > 16
    torch.testing.assert_close(_vectors(results), _vectors(want_results), atol=1e-6, rtol=0)


def test_a_quantized_embedding_gemma_file_embeds_close_to_its_folder(encoder_root,
                                                                     tiny_checkpoints,
                                                                     make_llm, tmp_path):  # fmt: skip
    """Q8_0 layers and Dense projections, computed in bf16: cosine over 0.99."""
    folder = _embedding_gemma(encoder_root, tiny_checkpoints)
    file = write_gguf(folder, tmp_path / "eg-q8.gguf", "Q8_0", pooling="MEAN")
    want = make_llm(str(folder), dtype="float32")
    want_vectors = _vectors(want.embed(TEXTS))
    want.shutdown()
    got = _vectors(make_llm(str(file)).embed(TEXTS))
    cosine = torch.nn.functional.cosine_similarity(got, want_vectors)
    assert cosine.min() > 0.99, cosine


def test_an_embedding_gemma_file_without_a_pooling_type_pools_the_mean(encoder_root,
                                                                       tiny_checkpoints,
                                                                       make_llm, tmp_path):  # fmt: skip
    folder = _embedding_gemma(encoder_root, tiny_checkpoints, dense=False)
    file = write_gguf(folder, tmp_path / "eg-none.gguf")
    assert make_llm(str(file)).engine.pooler_config.pooling_type == "MEAN"


def test_an_embedding_gemma_file_whose_projections_do_not_chain_is_refused(encoder_root,
                                                                           tiny_checkpoints,
                                                                           tmp_path):  # fmt: skip
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(_embedding_gemma(encoder_root, tiny_checkpoints), folder)
    second = folder / "3_Dense" / "model.safetensors"
    save_file({"linear.weight": load_file(str(second))["linear.weight"][:, :128].contiguous()},
              str(second))  # fmt: skip
    file = write_gguf(folder, tmp_path / "eg-broken.gguf", pooling="MEAN")
    with pytest.raises(ModelLoadError, match=r"dense_3.weight is \[64, 128\]; it takes 256"):
        find_model_folder(str(file))

"""GGUF files written by llama.cpp's own tools, where a llama.cpp source tree is at hand.

CI has no llama.cpp, so these skip unless ``INFER_LLAMA_CPP`` names a llama.cpp tree (with
``convert_hf_to_gguf.py`` and ``gguf-py/``; ``build/bin/llama-quantize`` for the quantized
files): e.g. ``vendor/llama.cpp`` of the llama-cpp-python sdist (docs/benchmarks.md). They
repeat, with llama.cpp's converter in place of ``infer.testing.gguf_files``, what
``test_gguf.py`` checks: every architecture's F32 file gives its folder's logits, and a
``llama-quantize``'d file transformers' logits in float32.

    INFER_LLAMA_CPP=~/src/llama.cpp python -m pytest tests/integration/test_gguf_llamacpp.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infer.runner.int4 import int4_kernel_available
from infer.testing.gguf_files import build_gemma3_for_gguf, build_sparse_qwen2_moe

from .test_gguf import _run

LLAMA_CPP = Path(os.environ.get("INFER_LLAMA_CPP", "/nonexistent")).expanduser()
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
    reason="INFER_LLAMA_CPP does not name a llama.cpp source tree",
)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))


def convert(folder: Path, out: Path, outtype: str = "f32", *flags: str) -> Path:
    """llama.cpp's converter, run as benchmarks/make_gguf.py runs it (in a child process)."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_gguf.py"), str(LLAMA_CPP),
                    str(folder), str(out), "--outtype", outtype, *flags],
                   check=True, capture_output=True)  # fmt: skip
    return out


@pytest.mark.parametrize(
    "kind", ["llama", "llama3", "qwen2", "qwen3", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"]
)
def test_llama_cpps_f32_file_gives_its_folders_logits(kind, tiny_checkpoints, tmp_path):
    folder = tiny_checkpoints.get(kind)
    if kind == "gemma3":  # (one in llama.cpp's layer pattern)
        folder = build_gemma3_for_gguf(tmp_path / "gemma3", tiny_checkpoints["llama"])
    if kind == "qwen2_moe":  # (llama.cpp's has no dense layers between)
        folder = build_sparse_qwen2_moe(tmp_path / "qwen2_moe", tiny_checkpoints["qwen2_moe"])
    file = convert(folder, tmp_path / f"{kind}.gguf")
    prompts = [list(range(5, 140)), [7, 8, 9]]  # past the windows and original contexts
    want_lps, want_tokens, _ = _run(folder, prompts=prompts)
    got_lps, got_tokens, _ = _run(file, prompts=prompts)
    torch.testing.assert_close(got_lps, want_lps, rtol=0, atol=1e-5)
    assert got_tokens == want_tokens


# The widths the engine holds each file's layers at in bf16 (int8 activations, the default;
# the Q6_K layers of Q4_K_M and Q5_K_M at 6 bits, a q/k/v fusing a Q6_K v with Q4_K / Q5_K
# q, k in int8 per channel, or bf16 where the CPU has no int8 kernel).
HELD_BITS = {"Q8_0": set(), "Q4_0": {4}, "Q4_1": {4}, "Q4_K_M": {4, 6}, "Q5_K_M": {5, 6},
             "Q6_K": {6}}  # fmt: skip


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K"])
def test_llama_quantized_files_give_transformers_logits(kind, tmp_path):
    """float32: transformers' logits (1e-4). bf16 (the kernels, int8 activations): the 4-, 5-
    and 6-bit layers held at their widths, logprobs within 0.05 of float32's on average."""
    from transformers import AutoModelForCausalLM

    from infer.testing.checkpoints import build_all
    from infer.testing.gguf_files import build_wide_llama

    quantize = LLAMA_CPP / "build" / "bin" / "llama-quantize"
    if not quantize.is_file():
        pytest.skip("no build/bin/llama-quantize in INFER_LLAMA_CPP")
    wide = build_wide_llama(tmp_path / "wide", build_all()["llama"])
    f16 = convert(wide, tmp_path / "wide-f16.gguf", "f16")
    file = tmp_path / f"wide-{kind}.gguf"
    subprocess.run([str(quantize), str(f16), str(file), kind], check=True, capture_output=True)
    prompts = [list(range(5, 40)), [7, 8, 9]]
    lps, tokens, _ = _run(file, prompts=prompts)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name,
                                                 dtype=torch.float32).eval()  # fmt: skip
    want = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            want += [logits[i, t].item() for i, t in enumerate(ids[1:])]
    torch.testing.assert_close(lps, torch.tensor(want), rtol=0, atol=1e-4)
    if not int4_kernel_available(torch.device("cpu"), int8_activations=True):
        return  # (the widths below are the w4a8 kernel's)
    held, _, layers = _run(file, "bfloat16", prompts=prompts)
    assert {m.bits for m in layers} == HELD_BITS[kind]
    assert (held - lps).abs().mean() < 0.05


def _llama_server(file: Path, *flags: str):
    """llama-server on ``file`` (a context manager yielding its URL), None where it is not
    built."""
    import contextlib
    import time
    import urllib.request

    from tests.server.conftest import free_port

    server = LLAMA_CPP / "build" / "bin" / "llama-server"
    if not server.is_file():
        return None

    @contextlib.contextmanager
    def running():
        port = free_port()
        proc = subprocess.Popen([str(server), "-m", str(file), "--host", "127.0.0.1", "--port",
                                 str(port), "-t", "2", *flags],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(120):
                try:
                    if urllib.request.urlopen(url + "/health").status == 200:
                        break
                except OSError:
                    time.sleep(0.5)
            else:
                pytest.fail(f"llama-server did not come up on {file}")
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    return running()


def _llama_server_embeds_as(file: Path, texts: list[str], vectors: torch.Tensor) -> bool:
    """llama-server's ``/v1/embeddings`` of ``texts`` on ``file`` are ``vectors`` within 1e-3
    (its GELU is tanh's approximation); False where it is not built."""
    server = _llama_server(file, "--embedding")
    if server is None:
        return False
    with server as url:
        data = _post(url + "/v1/embeddings", {"input": texts})["data"]
    theirs = torch.tensor([d["embedding"] for d in sorted(data, key=lambda d: d["index"])])
    torch.testing.assert_close(theirs, vectors, atol=1e-3, rtol=0)
    return True


def _embeds_as_its_folder(folder: Path, file: Path, llama_server: bool = True) -> None:
    """``file`` gives ``folder``'s tokens and vectors (float32, 1e-6; normalized, as
    llama-server's are), and (``llama_server``) llama-server's within 1e-3 where it is
    built."""
    from infer import LLM
    from infer.core.pooling_params import PoolingParams

    texts = ["The quick brown fox", "Hello, World! naïve café", "x", "def f(a, b): return a"]
    texts.append(texts[-1] * 4)  # (past a sliding window)
    vectors, tokens = [], []
    for model in (folder, file):
        with LLM(str(model), dtype="float32") as llm:
            results = llm.embed(texts, PoolingParams(normalize=True))
        vectors.append(torch.tensor([r.outputs.embedding for r in results]))
        tokens.append([r.prompt_token_ids for r in results])
    assert tokens[1] == tokens[0]
    torch.testing.assert_close(vectors[1], vectors[0], atol=1e-6, rtol=0)
    if llama_server:
        _llama_server_embeds_as(file, texts, vectors[1])


def _post(url: str, body: dict) -> dict:
    import json
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    return json.loads(urllib.request.urlopen(request).read())


def test_llama_cpps_qwen3_reranker_file_scores_as_transformers_and_llama_server(
    tiny_checkpoints, tmp_path
):
    """A tiny Qwen3 with "yes" / "no" tokens, in a folder named as Qwen3-Reranker: llama.cpp's
    converter writes it as a reranker (pooling RANK, cls.output.weight, a ``rerank`` chat
    template). infer's score of each pair is transformers' softmax probability of "yes" over
    the template (1e-5), and llama-server's ``/v1/rerank`` answer where it is built (its own
    float32 kernels: within 1e-3)."""

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infer import LLM

    folder = tmp_path / "qwen3-reranker"  # (the name llama.cpp's converter recognizes)
    tok = AutoTokenizer.from_pretrained(tiny_checkpoints["qwen3"])
    tok.add_tokens(["yes", "no"])
    causal = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen3"], dtype=torch.float32)
    causal.resize_token_embeddings(len(tok), mean_resizing=False)
    with torch.no_grad():
        for w in (causal.get_input_embeddings().weight, causal.get_output_embeddings().weight):
            w[-2:] = 0.2 * torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(0))
    causal.save_pretrained(folder)
    tok.save_pretrained(folder)
    file = convert(folder, tmp_path / "rr.gguf")
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    query, docs = "a list in Python", ["The quick brown fox", "a list is a sequence", "x"]
    with LLM(str(file), dtype="float32") as llm:
        template = llm.engine.spec.rerank_template
        got = [r.outputs.score for r in llm.score(query, docs)]
    for score, doc in zip(got, docs, strict=True):
        text = template.replace("{query}", query).replace("{document}", doc)
        with torch.no_grad():
            logits = causal.eval()(torch.tensor([tok.encode(text, add_special_tokens=False)]))
        want = torch.softmax(logits.logits[0, -1, [yes, no]].double(), 0)[0]
        assert score == pytest.approx(float(want), abs=1e-5)
    server = _llama_server(file, "--reranking", "-c", "2048")
    if server is None:
        return
    with server as url:
        body = {"query": query, "documents": docs}
        results = _post(url + "/v1/rerank", body)["results"]
    theirs = {r["index"]: r["relevance_score"] for r in results}
    assert [theirs[i] for i in range(len(docs))] == pytest.approx(got, abs=1e-3)


def test_llama_cpps_xlm_roberta_files_embed_and_rerank_as_their_folders(tmp_path):
    """XLM-RoBERTa with its own kind of tokenizer (SentencePiece Unigram, NFKC's precompiled
    charsmap: what BGE-M3 and multilingual-E5 files hold) through llama.cpp's converter: the
    rebuilt tokenizer gives the folder's ids for every corpus line and NFKC's cases, the
    embedding file the folder's vectors (1e-6) and llama-server's (1e-3), the reranker file
    (pooling RANK) the folder's cross-encoder scores (1e-6) and the sigmoid of llama-server's
    ``/v1/rerank`` scores (1e-3). Needs ``sentencepiece`` (the converter reads the model)."""
    pytest.importorskip("sentencepiece")
    from transformers import AutoTokenizer

    from infer import LLM
    from infer.model.folders import find_model_folder
    from infer.testing.encoders import build_encoder

    folder = build_encoder("xlm_roberta", tmp_path, "mean", sentencepiece=True)
    reranker = build_encoder("xlm_roberta", tmp_path, name="rr", labels=1, sentencepiece=True)
    file, rr_file = convert(folder, tmp_path / "e.gguf"), convert(reranker, tmp_path / "rr.gguf")
    want_tok = AutoTokenizer.from_pretrained(folder)
    got_tok = AutoTokenizer.from_pretrained(find_model_folder(file))
    texts = ["  leading and   multiple   spaces  ", "ﬁnancial ① Ｆｕｌｌ　ｗｉｄｔｈ café",
             "tab\there\nnewline", "x\u00a0y 東京 ½ Ångström", "a", "<s> literal </s>"]  # fmt: skip
    from infer.data.corpus import load_corpus

    lines = [line for doc in load_corpus(include_docstrings=False) for line in doc.splitlines()]
    for text in texts + lines[:300]:
        assert got_tok(text)["input_ids"] == want_tok(text)["input_ids"], text
    vectors, scores = [], []
    query, docs = texts[1], [texts[0], texts[3], lines[5]]
    for model, rr in ((folder, reranker), (file, rr_file)):
        with LLM(str(model), dtype="float32") as llm:
            vectors.append(torch.tensor([r.outputs.embedding for r in llm.embed(texts)]))
        with LLM(str(rr), dtype="float32") as llm:
            scores.append([r.outputs.score for r in llm.score(query, docs)])
    torch.testing.assert_close(vectors[1], vectors[0], atol=1e-6, rtol=0)
    assert scores[1] == pytest.approx(scores[0], abs=1e-6)
    if not _llama_server_embeds_as(file, texts, vectors[1]):
        return
    with _llama_server(rr_file, "--reranking") as url:
        results = _post(url + "/v1/rerank", {"query": query, "documents": docs})["results"]
    logits = torch.tensor([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])])
    assert torch.sigmoid(logits).tolist() == pytest.approx(scores[1], abs=1e-3)


def test_llama_cpps_bert_file_embeds_as_its_folder_and_llama_server(tmp_path):
    """A tiny BERT (WordPiece vocabulary, MEAN pooling) through llama.cpp's converter: the
    same tokens and vectors as its folder (float32, 1e-6), and llama-server's
    ``/v1/embeddings`` where it is built (its GELU is tanh's approximation: within 1e-3)."""
    from infer import LLM
    from infer.testing.encoders import build_encoder, default_encoder_root

    folder = build_encoder("bert", default_encoder_root(), "mean")
    file = convert(folder, tmp_path / "bert.gguf")
    texts = ["The quick brown fox", "Hello, World! naïve café", "x", "def f(a, b): return a"]
    vectors = []
    for model in (folder, file):
        with LLM(str(model), dtype="float32") as llm:
            results = llm.embed(texts)
        vectors.append(torch.tensor([r.outputs.embedding for r in results]))
        tokens = [r.prompt_token_ids for r in results]
        if model == folder:
            want_tokens = tokens
    assert tokens == want_tokens
    torch.testing.assert_close(vectors[1], vectors[0], atol=1e-6, rtol=0)
    _llama_server_embeds_as(file, texts, vectors[1])


def test_llama_cpps_nomic_bert_file_embeds_as_its_folder_and_llama_server(tmp_path):
    """A tiny Nomic BERT, config.json as Nomic publishes nomic-embed-text (what llama.cpp's
    converter reads), through the converter (``nomic-bert``: fused q/k/v, rope base in the
    metadata): the folder's tokens and vectors (1e-6), llama-server's (1e-3)."""
    from infer.testing.encoders import build_encoder, default_encoder_root, nomic_published

    folder = build_encoder("nomic_bert", default_encoder_root(), "mean")
    published = nomic_published(folder, tmp_path / "nomic")
    file = convert(published, tmp_path / "nomic.gguf")
    _embeds_as_its_folder(published, file)


def test_llama_cpps_jina_bert_file_embeds_as_its_folder_and_llama_server(tmp_path):
    """A tiny Jina BERT v2 (``JinaBertForMaskedLM``, ALiBi over 6 heads, a GELU gated MLP)
    through llama.cpp's converter (``jina-bert-v2``): the folder's tokens and vectors (1e-6),
    llama-server's (1e-3)."""
    from infer.testing.encoders import build_jina, default_encoder_root

    folder = build_jina(default_encoder_root())
    file = convert(folder, tmp_path / "jina.gguf")
    _embeds_as_its_folder(folder, file)


def test_llama_cpps_jina_code_file_embeds_as_its_folder(tmp_path):
    """Jina's code model (q / k norms, a second residual norm, ``up_gated_layer`` with its up
    half first) through llama.cpp's converter: the folder's tokens and vectors (1e-6). Not
    llama-server's: its runtime applies GELU to the first half of the fused ``ffn_up`` (the up
    half here), where Jina's code applies it to the second; llama-server's vectors are this
    folder's with the two halves swapped."""
    from infer.testing.encoders import build_jina, default_encoder_root

    folder = build_jina(default_encoder_root(), name="jina-code", code=True)
    file = convert(folder, tmp_path / "jina-code.gguf")
    _embeds_as_its_folder(folder, file, llama_server=False)


def test_llama_cpps_embedding_gemma_file_embeds_as_its_folder_and_llama_server(
    tiny_checkpoints, tmp_path
):
    """A tiny EmbeddingGemma (6 layers in llama.cpp's pattern, windows of 16, two bias-free
    Dense projections) through llama.cpp's converter with ``--sentence-transformers-dense-
    modules`` (``gemma-embedding``, ``dense_2`` / ``dense_3``): the folder's tokens and
    vectors (1e-6), llama-server's (1e-3)."""
    from infer.testing.encoders import (
        build_embedding_gemma,
        default_encoder_root,
        with_dense_modules,
    )

    root = default_encoder_root()
    folder = build_embedding_gemma(root, tiny_checkpoints["gemma3"], name="embedding-gemma-6",
                                   num_hidden_layers=6, sliding_window=16, layer_types=None)  # fmt: skip
    folder = with_dense_modules(folder, root / "embedding-gemma-6-dense", [256, 64], plain=True)
    file = convert(folder, tmp_path / "eg.gguf", "f32", "--dense-modules")
    _embeds_as_its_folder(folder, file)


def test_llama_cpps_embedding_gemma_file_with_gemmas_sentencepiece_vocabulary(
    tiny_checkpoints, tmp_path
):
    """EmbeddingGemma's own kind of vocabulary (a SentencePiece BPE model with byte fallback,
    Gemma's special ids, no prefix space; trained here on the corpus, 1,000 pieces) through
    llama.cpp's converter (``llama`` tokenizer, bos and eos added): the file tokenizes every
    text as the folder's Gemma tokenizer and as llama-server's ``/tokenize`` (double spaces,
    newlines, non-ASCII), and embeds as the folder (1e-6) and llama-server (1e-3)."""
    import json
    import shutil

    spm = pytest.importorskip("sentencepiece")
    from transformers import AutoTokenizer

    from infer.data.corpus import load_corpus
    from infer.testing.encoders import (
        build_embedding_gemma,
        default_encoder_root,
        with_dense_modules,
    )

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(load_corpus(include_docstrings=False))[:2_000_000])
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "gemma"), vocab_size=1000,
        model_type="bpe", byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    tokdir = tmp_path / "tok"
    tokdir.mkdir()
    shutil.copy(tmp_path / "gemma.model", tokdir / "tokenizer.model")
    (tokdir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True,
        "add_eos_token": True}))  # fmt: skip
    root = default_encoder_root()
    base = build_embedding_gemma(root, tiny_checkpoints["gemma3"], name="embedding-gemma-6",
                                 num_hidden_layers=6, sliding_window=16, layer_types=None)  # fmt: skip
    dense = with_dense_modules(base, root / "embedding-gemma-6-dense", [256, 64], plain=True)
    folder = tmp_path / "eg-spm"
    shutil.copytree(dense, folder, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    AutoTokenizer.from_pretrained(tokdir).save_pretrained(folder)
    shutil.copy(tmp_path / "gemma.model", folder / "tokenizer.model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"bos_token_id": 2,
                                                             "eos_token_id": 1, "pad_token_id": 0}))  # fmt: skip
    file = convert(folder, tmp_path / "eg-spm.gguf", "f32", "--dense-modules")
    _embeds_as_its_folder(folder, file)
    texts = ["Hello world  two  spaces é 東", "def f(a, b):\n    return a  + b\n", " leading"]
    want = AutoTokenizer.from_pretrained(folder)
    from infer import LLM

    with LLM(str(file), dtype="float32") as llm:
        got = [r.prompt_token_ids for r in llm.embed(texts)]
    assert got == [want(t)["input_ids"] for t in texts]
    server = _llama_server(file, "--embedding")
    if server is not None:
        with server as url:
            theirs = [_post(url + "/tokenize", {"content": t, "add_special": True})["tokens"]
                      for t in texts]  # fmt: skip
        assert theirs == got


@pytest.mark.parametrize("kind", ["roberta", "modernbert"])
def test_llama_cpps_byte_level_bpe_files_embed_as_their_folders_and_llama_server(kind, tmp_path):
    """A tiny RoBERTa (``bert``, its byte-level BPE vocabulary as ``gpt2`` with merges) and a
    tiny ModernBERT (``modern-bert``: two rope bases, a local window; ``layer_norm_eps`` beside
    its ``norm_eps``, which this converter writes as an RMS norm's epsilon that llama.cpp's
    runtime does not read) through llama.cpp's converter: the folder's tokens and vectors
    (1e-6), llama-server's (1e-3)."""
    import json
    import shutil

    from infer.testing.encoders import build_encoder, default_encoder_root

    root = default_encoder_root()
    if kind == "modernbert":
        folder = build_encoder(kind, root, name="modernbert-mean-bpe", bpe=True)
        published = tmp_path / "published"
        shutil.copytree(folder, published)
        config = json.loads((published / "config.json").read_text())
        (published / "config.json").write_text(json.dumps(config | {"layer_norm_eps":
                                                                   config["norm_eps"]}))  # fmt: skip
        folder = published
    else:
        folder = build_encoder(kind, root)
    file = convert(folder, tmp_path / f"{kind}.gguf")
    _embeds_as_its_folder(folder, file)


def test_llama_cpps_modernbert_reranker_file_scores_as_its_folder_and_llama_server(tmp_path):
    """A tiny ModernBERT cross-encoder (gte-reranker-modernbert's kind: mean pooling, a head of
    dense, GELU and norm, then the classifier; no dense bias, which llama.cpp's loader does not
    take) through llama.cpp's converter (``cls``, ``cls.norm``, ``cls.output``,
    ``classifier.pooling_type``): the folder's scores (1e-6) and the sigmoid of llama-server's
    ``/v1/rerank`` (1e-3)."""
    import json
    import shutil

    from infer import LLM
    from infer.testing.encoders import build_cross_encoder, default_encoder_root

    folder = build_cross_encoder("modernbert", default_encoder_root(), bpe=True,
                                 classifier_pooling="mean")  # fmt: skip
    published = tmp_path / "published"  # (layer_norm_eps: see the test above)
    shutil.copytree(folder, published)
    config = json.loads((published / "config.json").read_text())
    (published / "config.json").write_text(json.dumps(config | {"layer_norm_eps":
                                                               config["norm_eps"]}))  # fmt: skip
    file = convert(published, tmp_path / "rr.gguf")
    query = "what is a tuple"
    docs = ["a tuple is an immutable sequence", "x", "Hello, World! naïve café"]
    scores = []
    for model in (published, file):
        with LLM(str(model), dtype="float32") as llm:
            scores.append([r.outputs.score for r in llm.score(query, docs)])
    assert scores[1] == pytest.approx(scores[0], abs=1e-6)
    server = _llama_server(file, "--reranking")
    if server is None:
        return
    with server as url:
        results = _post(url + "/v1/rerank", {"query": query, "documents": docs})["results"]
    logits = torch.tensor([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])])
    assert torch.sigmoid(logits).tolist() == pytest.approx(scores[1], abs=1e-3)

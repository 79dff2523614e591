"""Token classification (``task: token_classify``): a ``*ForTokenClassification`` encoder (an
NER or part-of-speech tagger) gives every input token's label probabilities, transformers'
logits through a softmax (a sigmoid for one label), or the raw logits; BGE-M3's
``sparse_linear.pt`` gives each token's lexical weight as FlagEmbedding computes it. Inputs of
different lengths share a step, beside other pooling tasks; what a model cannot give is refused
naming it; every KV block comes back (``make_llm``)."""

from __future__ import annotations

import shutil

import pytest
import torch

from infer.core.pooling_params import PoolingParams
from infer.core.sampling_params import InvalidRequestError
from infer.testing.encoders import (
    NER_LABELS,
    build_encoder,
    build_token_classifier,
    default_encoder_root,
)

from .conftest import PROMPTS

TEXTS = [PROMPTS[0], PROMPTS[5], "a", PROMPTS[2]]
KINDS = ["bert", "xlm_roberta", "roberta", "distilbert", "mpnet", "modernbert"]


@pytest.fixture(scope="module")
def encoder_root():
    return default_encoder_root()


def _logits(folder, texts: list[str]) -> list[torch.Tensor]:
    """transformers' token classifier's logits ``[tokens, labels]`` for each text alone."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(**tok(text, return_tensors="pt")).logits[0] for text in texts]


@pytest.mark.parametrize("kind", KINDS)
def test_token_classifications_are_transformers_probabilities(kind, encoder_root, make_llm):
    """Each input token's label probabilities are the softmax of transformers' logits (the raw
    logits with ``use_activation=False``), inputs of 3 to 40 tokens side by side in a step; the
    labels are the model's ``id2label``."""
    folder = build_token_classifier(kind, encoder_root)
    want = _logits(folder, TEXTS)
    llm = make_llm(str(folder))
    assert llm.engine.token_classes == NER_LABELS
    probs = llm.encode(TEXTS, pooling_task="token_classify")
    raw = llm.encode(TEXTS, PoolingParams(use_activation=False), pooling_task="token_classify")
    for p, r, w in zip(probs, raw, want, strict=True):
        assert p.outputs.data.shape == (len(p.prompt_token_ids), len(NER_LABELS))
        torch.testing.assert_close(r.outputs.data, w, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(p.outputs.data, w.softmax(dim=1), atol=1e-6, rtol=1e-5)
    # (the logits move with the input: not one answer for every token)
    assert not torch.allclose(raw[0].outputs.data[1], raw[0].outputs.data[2])


def test_a_one_label_token_classifier_gives_sigmoids(encoder_root, make_llm):
    folder = build_token_classifier("bert", encoder_root, labels=("keep",))
    want = _logits(folder, TEXTS[:2])
    got = make_llm(str(folder)).encode(TEXTS[:2], pooling_task="token_classify")
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.outputs.data, w.sigmoid(), atol=1e-6, rtol=1e-5)


def test_what_a_token_classifier_cannot_give_is_refused(encoder_root, make_llm, tmp_path):
    """A tagger gives token classifications only: embeddings, token embeddings, a
    classification and generation are refused naming what it gives; so are ``dimensions``,
    ``normalize`` (logits are neither cut nor normalized) and ``attended_tokens``. A plain
    embedding model refuses ``token_classify`` naming the heads that give it, and so does a
    cross-encoder with a ``sparse_linear.pt`` beside it (its head is its own). The engine
    serves on after each."""
    tagger = make_llm(str(build_token_classifier("bert", encoder_root)))
    for call in (lambda: tagger.embed(TEXTS[0]), lambda: tagger.encode(TEXTS[0]),
                 lambda: tagger.classify(TEXTS[0])):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="is a token classifier"):
            call()
    for params, field in ((PoolingParams(dimensions=2), "dimensions"),
                          (PoolingParams(normalize=True), "normalize")):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="neither dimensions nor normalize") as e:
            tagger.encode(TEXTS[0], params, pooling_task="token_classify")
        assert e.value.param == field
    with pytest.raises(InvalidRequestError, match="attended_tokens is for token embeddings"):
        tagger.encode(TEXTS[0], PoolingParams(attended_tokens=1), pooling_task="token_classify")
    with pytest.raises(InvalidRequestError, match="is a token classifier: it labels every"):
        tagger.generate(TEXTS[0])
    assert len(tagger.encode(TEXTS[0], pooling_task="token_classify")) == 1
    embedder = make_llm(str(build_encoder("bert", encoder_root, "cls")))
    with pytest.raises(InvalidRequestError, match="no token classification head.*sparse_linear"):
        embedder.encode(TEXTS[0], pooling_task="token_classify")
    folder = tmp_path / "reranker"
    shutil.copytree(build_encoder("xlm_roberta", encoder_root, name="xlmr-rr", labels=1), folder)
    torch.save({"weight": torch.zeros(1, 64), "bias": torch.zeros(1)}, folder / "sparse_linear.pt")
    with pytest.raises(InvalidRequestError, match="no token classification head"):
        make_llm(str(folder)).encode(TEXTS[0], pooling_task="token_classify")
    with pytest.raises(InvalidRequestError, match="use_activation must be true or false"):
        PoolingParams(task="token_classify", use_activation="yes")  # type: ignore[arg-type]


def _bge_m3(encoder_root, folder, sparse: dict[str, torch.Tensor]):
    shutil.copytree(build_encoder("xlm_roberta", encoder_root, "cls"), folder)
    gen = torch.Generator().manual_seed(3)
    colbert = {"weight": 0.2 * torch.randn(32, 64, generator=gen),
               "bias": 0.1 * torch.randn(32, generator=gen)}  # fmt: skip
    torch.save(colbert, folder / "colbert_linear.pt")
    torch.save(sparse, folder / "sparse_linear.pt")
    return folder


def test_bge_m3_sparse_weights_are_flagembeddings(encoder_root, make_llm, tmp_path):
    """A BGE-M3 folder's ``sparse_linear.pt``: each token's weight is ``relu(linear(h))`` of
    transformers' final state, for every token but ``<s>`` and ``</s>`` (FlagEmbedding leaves
    theirs out); raw with ``use_activation=False``; an input without them (token ids as given)
    keeps every row; one step serves its embedding, its token vectors and its sparse weights;
    FlagEmbedding's lexical weights (each token id's largest weight) follow from them."""
    from transformers import AutoModel, AutoTokenizer

    gen = torch.Generator().manual_seed(4)
    sparse = {"weight": 0.3 * torch.randn(1, 64, generator=gen), "bias": torch.tensor([0.05])}
    folder = _bge_m3(encoder_root, tmp_path / "bge-m3", sparse)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    llm = make_llm(str(folder))
    assert llm.engine.token_classes == ("weight",)
    got = llm.encode(TEXTS, pooling_task="token_classify")
    raw = llm.encode(TEXTS, PoolingParams(use_activation=False), pooling_task="token_classify")
    for text, g, r in zip(TEXTS, got, raw, strict=True):
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        logits = hidden @ sparse["weight"].T + sparse["bias"]
        assert g.prompt_token_ids == ids and g.outputs.data.shape == (len(ids) - 2, 1)
        torch.testing.assert_close(r.outputs.data, logits[1:-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g.outputs.data, logits[1:-1].relu(), atol=1e-5, rtol=1e-5)
    assert (raw[0].outputs.data < 0).any() and (got[0].outputs.data == 0).any()
    # FlagEmbedding's lexical weights: each token id's largest positive weight
    lexical: dict[int, float] = {}
    for token, w in zip(got[0].prompt_token_ids[1:-1], got[0].outputs.data[:, 0].tolist(),
                        strict=True):  # fmt: skip
        if w > 0:
            lexical[token] = max(w, lexical.get(token, 0.0))
    assert lexical and all(w > 0 for w in lexical.values())
    bare = tok(TEXTS[0], add_special_tokens=False)["input_ids"]
    [whole] = llm.encode([bare], pooling_task="token_classify")
    assert whole.outputs.data.shape == (len(bare), 1)
    engine = llm.engine
    ids = tok(TEXTS[1])["input_ids"]
    engine.add_request("c", ids, PoolingParams(task="token_classify"))
    engine.add_request("e", ids, PoolingParams())
    engine.add_request("t", ids, PoolingParams(task="token_embed"))
    outputs = {o.request_id: o for o in engine.step()}
    assert len(outputs["e"].embedding) == 64
    assert [len(outputs[k].embedding) for k in "tc"] == [len(ids) - 1, len(ids) - 2]
    torch.testing.assert_close(torch.tensor(outputs["c"].embedding), got[1].outputs.data,
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_an_unreadable_sparse_layer_is_refused_naming_it(encoder_root, make_llm, tmp_path):
    """A ``sparse_linear.pt`` that is not a layer to one value: the model loads and serves its
    embeddings; ``token_classify`` is refused naming the file."""
    bad = {"weight": torch.zeros(3, 64), "bias": torch.zeros(3)}
    llm = make_llm(str(_bge_m3(encoder_root, tmp_path / "bad", bad)))
    with pytest.raises(InvalidRequestError, match=r"sparse_linear.pt: a Linear layer to 3"):
        llm.encode(TEXTS[0], pooling_task="token_classify")
    assert len(llm.embed(TEXTS[0])[0].outputs.embedding) == 64

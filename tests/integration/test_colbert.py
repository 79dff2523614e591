"""ColBERT models (late interaction) as PyLate saves them: every token's vector, and MaxSim
scores of queries against documents, equal to the design written out here with transformers
(queries prefixed and padded with [MASK] tokens that attend but are not attended to,
documents prefixed, their punctuation's vectors left out). The folders are
``infer.testing.encoders.build_colbert``'s; PyLate itself (not installed in CI) gave the same
scores on them to 1e-6 when checked by hand."""

from __future__ import annotations

import string

import pytest
import torch

from infer.core.pooling_params import PoolingParams
from infer.core.sampling_params import InvalidRequestError
from infer.testing.encoders import build_colbert, default_encoder_root

QUERIES = ["what is a list in python", "tuples", "word " * 30]
DOCS = ["A list is a sequence. Lists, tuples!", "x", "The quick brown fox jumps over the lazy dog, "
        "again and again and again (and again); it never stops."]  # fmt: skip


@pytest.fixture(scope="module")
def encoder_root():
    return default_encoder_root()


def _reference(folder, settings: dict):
    """The design, written out: ``(query vectors, document vectors)`` functions of a text."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    stanford = (folder / "artifact.metadata").is_file()  # (Stanford's: linear.weight beside)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    weight = load_file(str(folder / ("" if stanford else "1_Dense") / "model.safetensors"))
    weight = weight["linear.weight"]
    q_id, d_id = tok.convert_tokens_to_ids(["[unused0]", "[unused1]"] if stanford else
                                           ["[Q] ", "[D] "])  # fmt: skip
    skip = set(tok.convert_tokens_to_ids(list(string.punctuation)))

    def vectors(ids: list[int], attended: int) -> torch.Tensor:
        mask = torch.tensor([[1] * attended + [0] * (len(ids) - attended)])
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids]), attention_mask=mask).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden @ weight.T, dim=1)

    def encode(text: str, prefix: int, length: int) -> list[int]:
        ids = tok(text, truncation=True, max_length=length - 1)["input_ids"]
        return ids[:1] + [prefix] + ids[1:]

    def query(text: str) -> torch.Tensor:
        length = settings.get("query_maxlen" if stanford else "query_length", 16)
        ids = encode(text, q_id, length)
        real = len(ids)
        if settings.get("do_query_expansion", True):
            ids += [tok.mask_token_id] * (length - real)
        attend = settings.get("attend_to_mask_tokens" if stanford else "attend_to_expansion_tokens")
        return vectors(ids, len(ids) if attend else real)

    def document(text: str) -> torch.Tensor:
        ids = encode(text, d_id, settings.get("doc_maxlen" if stanford else "document_length", 24))
        return vectors(ids, len(ids))[[i for i, t in enumerate(ids) if t not in skip]]

    return query, document


def _maxsim(q: torch.Tensor, d: torch.Tensor) -> float:
    return float((q.double() @ d.double().T).max(dim=1).values.sum())


VARIANTS = [
    ("bert", {}),
    ("bert", {"attend_to_expansion_tokens": True}),
    ("bert", {"do_query_expansion": False, "query_length": 8}),
    # (ModernBERT: [MASK]s within its 4-token local window of a query token)
    ("modernbert", {"query_length": 10}),
    ("stanford", {"query_maxlen": 12, "doc_maxlen": 20}),
    ("stanford", {"attend_to_mask_tokens": True}),
]


@pytest.mark.parametrize("kind,settings", VARIANTS)
def test_scores_are_the_maxsim_of_query_and_document_vectors(kind, settings, encoder_root,
                                                             make_llm):  # fmt: skip
    """``LLM.score(queries, documents)``: each query's vectors (prefixed, cut, padded with
    [MASK]s attended to or not) against each document's (prefixed, cut, punctuation's left out),
    summed best dot products, as the reference computes them (float32, 1e-4); inputs past
    the query and document lengths are cut, not refused. PyLate's folders (BERT, ModernBERT)
    and Stanford's (``HF_ColBERT``: its projection in its checkpoint, ``artifact.metadata``)."""
    name = "colbert-" + kind + "".join(f"-{k}={v}" for k, v in sorted(settings.items()))
    stanford = kind == "stanford"
    folder = build_colbert("bert" if stanford else kind, encoder_root, name=name,
                           stanford=stanford, **settings)  # fmt: skip
    query, document = _reference(folder, settings)
    llm = make_llm(str(folder), dtype="float32")
    assert llm.engine.late_interaction is not None
    for q in QUERIES:
        got = [r.outputs.score for r in llm.score(q, DOCS)]
        want = [_maxsim(query(q), document(d)) for d in DOCS]
        assert got == pytest.approx(want, abs=1e-4, rel=1e-5)


def test_queries_and_documents_encoded_for_an_index(encoder_root, make_llm, engine_device):
    """``LLM.encode(texts, input_type=...)``: each text's vectors as a query or a document (what
    an index of documents stores, and what a search sends), equal to the reference's; their
    MaxSim is ``LLM.score``'s; ``input_type`` on another model is refused naming it."""
    folder = build_colbert("bert", encoder_root)
    query, document = _reference(folder, {})
    llm = make_llm(str(folder), dtype="float32")
    docs = llm.encode(DOCS, input_type="document")
    queries = llm.encode(QUERIES, input_type="query")
    for got, text in zip(docs, DOCS, strict=True):
        torch.testing.assert_close(got.outputs.data, document(text), atol=1e-5, rtol=1e-5)
    for got, text in zip(queries, QUERIES, strict=True):
        torch.testing.assert_close(got.outputs.data, query(text), atol=1e-5, rtol=1e-5)
        assert len(got.prompt_token_ids) == 16  # ([CLS] [Q] ... [SEP] [MASK]...)
    scores = [r.outputs.score for r in llm.score(QUERIES[0], DOCS)]
    # (score encodes the texts again, in another batch: the same vectors on a CPU, whose
    # kernels do not depend on the batch; float32 round-off apart on a GPU, whose do)
    assert scores == pytest.approx([_maxsim(queries[0].outputs.data, d.outputs.data)
                                    for d in docs], abs=1e-9 if engine_device == "cpu" else 1e-5)  # fmt: skip
    with pytest.raises(InvalidRequestError, match="input_type"):
        llm.encode(DOCS[0], input_type="passage")
    llm.shutdown()
    plain = make_llm(str(build_colbert("bert", encoder_root).parent / "bert-cls"))
    with pytest.raises(InvalidRequestError, match="is for a ColBERT model"):
        plain.encode(DOCS[0], input_type="document")


def test_token_vectors_and_what_a_colbert_model_refuses(encoder_root, make_llm):
    """``LLM.encode`` gives every token's projected, normalized vector of the input as given;
    a one-vector embedding is refused naming the model's kind; pairs score the same in bf16
    within bf16's reach."""
    from transformers import AutoModel, AutoTokenizer

    folder = build_colbert("bert", encoder_root)
    llm = make_llm(str(folder), dtype="float32")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    from safetensors.torch import load_file

    weight = load_file(str(folder / "1_Dense" / "model.safetensors"))["linear.weight"]
    data = llm.encode(DOCS[0])[0].outputs.data
    with torch.no_grad():
        hidden = model(**tok(DOCS[0], return_tensors="pt")).last_hidden_state[0]
    torch.testing.assert_close(data, torch.nn.functional.normalize(hidden @ weight.T, dim=1),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    with pytest.raises(InvalidRequestError, match="this is a ColBERT model"):
        llm.embed(DOCS[0])
    with pytest.raises(InvalidRequestError, match="this is a ColBERT model"):
        llm.encode(DOCS[0], pooling_task="embed")
    exact = [r.outputs.score for r in llm.score(QUERIES[0], DOCS)]
    llm.shutdown()
    bf16 = make_llm(str(folder), dtype="bfloat16")
    got = [r.outputs.score for r in bf16.score(QUERIES[0], DOCS)]
    assert got == pytest.approx(exact, rel=0.02)
    assert bf16.encode(DOCS[0], PoolingParams(dimensions=8))[0].outputs.data.shape[1] == 8


def test_a_pylate_dense_module_that_adds_its_input_is_refused(encoder_root, make_llm,
                                                              tmp_path):  # fmt: skip
    import json
    import shutil

    folder = tmp_path / "residual"
    shutil.copytree(build_colbert("bert", encoder_root), folder)
    config = json.loads((folder / "1_Dense" / "config.json").read_text())
    (folder / "1_Dense" / "config.json").write_text(json.dumps(config | {"use_residual": True}))
    llm = make_llm(str(folder))
    with pytest.raises(InvalidRequestError, match="use_residual"):
        llm.encode(DOCS[0])
    llm.shutdown()
    # (a pooling override sets a refused projection aside for pooled vectors, never for a
    # ColBERT's: its vectors are the projection's)
    llm = make_llm(str(folder), pooler_config={"pooling_type": "CLS"})
    with pytest.raises(InvalidRequestError, match="use_residual"):
        llm.score(QUERIES[0], DOCS[0])


def test_stanford_settings_infer_cannot_use_are_refused(encoder_root, tmp_path):
    import json
    import shutil

    from infer import LLM
    from infer.model.folders import ModelLoadError

    folder = tmp_path / "short"
    shutil.copytree(build_colbert("bert", encoder_root, name="colbert-stanford", stanford=True),
                    folder)  # fmt: skip
    meta = json.loads((folder / "artifact.metadata").read_text())
    (folder / "artifact.metadata").write_text(json.dumps(meta | {"query_maxlen": 1}))
    with pytest.raises(ModelLoadError, match="query_maxlen 1 is not an integer of 2 or more"):
        LLM(str(folder), dtype="float32")

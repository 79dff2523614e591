"""``infer serve`` on a BERT embedding model (sentence-transformers' mean pooling, normalized):
``POST /v1/embeddings`` with the ``openai`` SDK gives transformers' vectors for inputs sent
together and concurrently; generation endpoints answer 400 naming why; every KV block comes
back."""

from __future__ import annotations

import pytest
import torch
from tests.server.conftest import concurrently, start_server

from infer.testing.encoders import build_encoder, default_encoder_root

TEXTS = [
    "The quick brown fox",
    "x",
    "In Python, a list is a mutable sequence; a tuple is an immutable one. Both hold any objects.",
]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return build_encoder("bert", default_encoder_root(), "mean")


@pytest.fixture(scope="module")
def server(bert, server_logs):
    yield from start_server(bert, server_logs, "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def reference(bert):
    """sentence-transformers' vector of a text: transformers' hidden states, averaged over every
    token, normalized."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bert)
    model = AutoModel.from_pretrained(bert, dtype=torch.float32).eval()

    def vector(text: str) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)

    return tok, vector


def test_the_openai_sdk_gets_sentence_transformers_vectors(server, reference):
    from openai import OpenAI

    tok, vector = reference
    client = OpenAI(base_url=server.base_url, api_key="none")
    resp = client.embeddings.create(model="tiny", input=TEXTS)
    assert [d.index for d in resp.data] == [0, 1, 2]
    for d, text in zip(resp.data, TEXTS, strict=True):
        torch.testing.assert_close(torch.tensor(d.embedding), vector(text), atol=1e-5, rtol=1e-5)
    assert resp.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS)
    # many clients at once: each gets its own text's vector
    results = concurrently(
        lambda text: client.embeddings.create(model="tiny", input=text).data[0].embedding,
        TEXTS * 4,
    )
    for text, got in zip(TEXTS * 4, results, strict=True):
        torch.testing.assert_close(torch.tensor(got), vector(text), atol=1e-5, rtol=1e-5)
    assert "an encoder (BertModel): it embeds" in server.log()
    assert "MEAN pooling, normalized" in server.log()
    assert "prefix caching off (an encoder's every token sees its whole input" in server.log()
    server.wait_idle()


def test_truncation_keeps_cls_and_sep_as_the_tokenizer_does(server, bert):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bert)
    model = AutoModel.from_pretrained(bert, dtype=torch.float32).eval()
    text = TEXTS[2]
    enc = tok(text, truncation=True, max_length=6, return_tensors="pt")
    assert (
        enc["input_ids"][0, 0] == tok.cls_token_id and enc["input_ids"][0, -1] == tok.sep_token_id
    )
    with torch.no_grad():
        want = model(**enc).last_hidden_state[0].mean(dim=0)
    with server.client() as c:
        r = c.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 6,
                                           "normalize": False})  # fmt: skip
    assert r.status_code == 200, r.text
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), want, atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    server.wait_idle()


def test_generation_is_refused_naming_the_encoder(server):
    with server.client() as c:
        for path, body in (
            ("/v1/completions", {"prompt": "hello", "max_tokens": 4}),
            ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        ):  # fmt: skip
            r = c.post(path, json={"model": "tiny", **body})
            assert r.status_code == 400, r.text
            assert "is an encoder: it embeds" in r.json()["error"]["message"]
        r = c.post("/v1/embeddings", json={"input": "word " * 200})
        assert r.status_code == 400 and "128" in r.json()["error"]["message"]
        # truncated as its tokenizer truncates: the first tokens and the final [SEP]
        r = c.post("/v1/embeddings", json={"input": "word " * 200, "truncate_prompt_tokens": 6,
                                           "normalize": False})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 6
        assert c.post("/v1/embeddings", json={"input": TEXTS[0]}).status_code == 200
    server.wait_idle()  # (every KV block free)


def test_pooling_gives_every_tokens_vector(server, bert):
    """``POST /pooling`` with ``task: token_embed``: each input's every token's final hidden
    state (transformers', normalized per token unless asked not), as floats or base64; sent
    beside ``/v1/embeddings`` requests in the same steps, each gets its own; every KV block
    back."""
    import base64
    import struct

    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bert)
    model = AutoModel.from_pretrained(bert, dtype=torch.float32).eval()

    def states(text: str) -> torch.Tensor:
        with torch.no_grad():
            return model(**tok(text, return_tensors="pt")).last_hidden_state[0]

    with server.client() as c:
        r = c.post("/pooling", json={"input": TEXTS, "task": "token_embed", "normalize": False})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["pooling"] * 3
        for d, text in zip(body["data"], TEXTS, strict=True):
            torch.testing.assert_close(torch.tensor(d["data"]), states(text), atol=1e-5,
                                       rtol=1e-5)  # fmt: skip
        assert body["usage"]["prompt_tokens"] == sum(len(tok(t)["input_ids"]) for t in TEXTS)
        r = c.post("/pooling", json={"input": TEXTS[0], "task": "token_embed",
                                     "encoding_format": "base64", "dimensions": 8})  # fmt: skip
        raw = base64.b64decode(r.json()["data"][0]["data"])
        got = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)).view(-1, 8)
        want = torch.nn.functional.normalize(states(TEXTS[0])[:, :8], dim=1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # (no task: an embedding model's embedding, as /v1/embeddings gives it)
        r = c.post("/pooling", json={"input": TEXTS[1]})
        vector = c.post("/v1/embeddings", json={"input": TEXTS[1]}).json()["data"][0]
        assert r.json()["data"][0]["data"] == vector["embedding"]
        r = c.post("/pooling", json={"input": TEXTS[1], "task": "classify"})
        assert r.status_code == 400 and "no classification head" in r.text

    def either(k: int):
        text = TEXTS[k % 3]
        if k % 2:
            body = {"input": text, "task": "token_embed", "normalize": False}
            return server.client().post("/pooling", json=body).json()["data"][0]["data"]
        return server.client().post("/v1/embeddings", json={"input": text}).json()["data"][0]

    for k, got in enumerate(concurrently(either, range(12))):
        text = TEXTS[k % 3]
        if k % 2:
            torch.testing.assert_close(torch.tensor(got), states(text), atol=1e-5, rtol=1e-5)
        else:
            want = torch.nn.functional.normalize(states(text).mean(0), dim=0)
            torch.testing.assert_close(torch.tensor(got["embedding"]), want, atol=1e-5,
                                       rtol=1e-5)  # fmt: skip
    server.wait_idle()


@pytest.fixture(scope="module")
def reranker_server(server_logs):
    from infer.testing.encoders import build_cross_encoder

    folder = build_cross_encoder("bert", default_encoder_root())
    for server in start_server(folder, server_logs, "--served-model-name", "rr"):
        yield server, folder


def test_a_bert_cross_encoder_reranks_over_http(reranker_server):
    """``/rerank`` with a BERT cross-encoder: each document's relevance is transformers'
    classifier on the tokenizer's pair encoding (its token types), sigmoid, best first."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    server, folder = reranker_server
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    query, docs = TEXTS[0], TEXTS[1:] + ["brown foxes jump"]
    with torch.no_grad():
        scores = [float(torch.sigmoid(model.eval()(**tok(query, d, return_tensors="pt")).logits[0, 0]))
                  for d in docs]  # fmt: skip
    order = sorted(range(len(docs)), key=lambda j: -scores[j])
    with server.client() as c:
        r = c.post("/rerank", json={"model": "rr", "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        assert [x["relevance_score"] for x in results] == pytest.approx(
            [scores[j] for j in order], abs=1e-5
        )
        r = c.post("/v1/embeddings", json={"model": "rr", "input": query})
        assert r.status_code == 400 and "classif" in r.json()["error"]["message"]
        # /pooling: the classifier's probability (vLLM's default), or its logit if asked
        with torch.no_grad():
            logit = float(model(**tok(query, return_tensors="pt")).logits[0, 0])
        for body, want in (({}, torch.sigmoid(torch.tensor(logit)).item()),
                           ({"use_activation": False}, logit)):  # fmt: skip
            r = c.post("/pooling", json={"model": "rr", "input": query} | body)
            assert r.json()["data"][0]["data"] == pytest.approx([want], abs=1e-5)
    server.wait_idle()


def test_a_token_classifier_tags_every_token_over_http(server_logs):
    """A ``BertForTokenClassification`` (an NER tagger): ``/pooling`` with no task gives each
    input token's label probabilities, transformers' softmax (the logits with
    ``use_activation: false``; base64 of them in order); the schema lists ``token_classify``
    as its one task; embeddings, another task and ``dimensions`` answer 400 naming why;
    every KV block back."""
    import base64
    import struct

    import httpx
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from infer.testing.encoders import NER_LABELS, build_token_classifier

    folder = build_token_classifier("bert", default_encoder_root())
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [model(**tok(t, return_tensors="pt")).logits[0] for t in TEXTS]
    for server in start_server(folder, server_logs):
        with server.client() as c:
            r = c.post("/pooling", json={"input": TEXTS})
            assert r.status_code == 200, r.text
            for d, want in zip(r.json()["data"], logits, strict=True):
                torch.testing.assert_close(torch.tensor(d["data"]), want.softmax(1), atol=1e-5,
                                           rtol=1e-5)  # fmt: skip
            r = c.post(
                "/pooling",
                json={
                    "input": TEXTS[2],
                    "task": "token_classify",
                    "use_activation": False,
                    "encoding_format": "base64",
                },
            )
            raw = base64.b64decode(r.json()["data"][0]["data"])
            got = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
            torch.testing.assert_close(got.view(-1, len(NER_LABELS)), logits[2], atol=1e-5,
                                       rtol=1e-5)  # fmt: skip
            for path, body, words in (
                ("/v1/embeddings", {"input": "x"}, "is a token classifier"),
                ("/pooling", {"input": "x", "task": "embed"}, "is a token classifier"),
                ("/pooling", {"input": "x", "dimensions": 2}, "neither dimensions nor normalize"),
            ):
                r = c.post(path, json=body)
                assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        schema = httpx.get(server.url + "/openapi.json", headers=server.headers).json()
        task = schema["components"]["schemas"]["PoolingRequest"]["properties"]["task"]
        assert [o["enum"] for o in task["anyOf"] if "enum" in o] == [["token_classify"]]
        assert "/v1/embeddings" not in schema["paths"] and "/rerank" not in schema["paths"]
        server.wait_idle()


def test_a_gguf_embedding_file_is_served_as_its_folder(bert, reference, server_logs, tmp_path):
    """``infer serve --model FILE.gguf`` on llama.cpp's layout of the same BERT (F32, MEAN
    pooling in its metadata): the openai SDK gets the folder's sentence-transformers vectors."""
    from openai import OpenAI

    from infer.testing.gguf_files import write_bert_gguf

    file = write_bert_gguf(bert, tmp_path / "bert-mean.gguf", pooling="MEAN")
    _, vector = reference
    env = {"INFER_CACHE_DIR": str(tmp_path / "cache")}
    for server in start_server(file, server_logs, env=env):
        client = OpenAI(base_url=server.base_url, api_key="none")
        resp = client.embeddings.create(model="tiny", input=TEXTS)
        for d, text in zip(resp.data, TEXTS, strict=True):
            got = torch.tensor(d.embedding)
            torch.testing.assert_close(got, vector(text), atol=1e-5, rtol=1e-5)
        assert "MEAN pooling, normalized" in server.log()
        server.wait_idle()


def test_a_dense_projected_model_over_http(server_logs):
    """A model whose sentence-transformers pipeline ends in Dense modules (64 -> 48 -> 32): the
    openai SDK gets 32 values, the schema bounds ``dimensions`` by 32, and 33 answers 400
    naming it."""
    import httpx
    from openai import BadRequestError, OpenAI

    from infer.testing.encoders import with_dense_modules

    root = default_encoder_root()
    folder = with_dense_modules(build_encoder("bert", root, "cls"), root / "bert-cls-dense",
                                [48, 32])  # fmt: skip
    for server in start_server(folder, server_logs):
        client = OpenAI(base_url=server.base_url, api_key="none")
        resp = client.embeddings.create(model="tiny", input=TEXTS)
        assert [len(d.embedding) for d in resp.data] == [32] * len(TEXTS)
        assert abs(sum(v * v for v in resp.data[0].embedding) - 1) < 1e-5
        schema = httpx.get(server.url + "/openapi.json", headers=server.headers).json()
        dims = schema["components"]["schemas"]["EmbeddingRequest"]["properties"]["dimensions"]
        assert 32 in [o.get("maximum") for o in dims.get("anyOf", [dims])]
        with pytest.raises(BadRequestError) as e:
            client.embeddings.create(model="tiny", input="x", dimensions=33)
        assert "embedding size (32)" in e.value.message
        server.wait_idle()


def test_a_colbert_model_reranks_by_late_interaction_over_http(server_logs):
    """A ColBERT model (PyLate's folder): ``/rerank`` and ``/score`` give the MaxSim scores of
    the design (tests/integration/test_colbert.py's reference), best first, with the default
    ``--engine-process``; ``/pooling`` gives every token's vector with no task named;
    ``/v1/embeddings`` answers 400 naming what the model gives instead; every KV block back."""
    from tests.integration.test_colbert import DOCS, QUERIES, _maxsim, _reference

    from infer.testing.encoders import build_colbert

    folder = build_colbert("bert", default_encoder_root())
    query, document = _reference(folder, {})
    want = [_maxsim(query(QUERIES[0]), document(d)) for d in DOCS]
    for server in start_server(folder, server_logs):
        with server.client() as c:
            r = c.post("/rerank", json={"query": QUERIES[0], "documents": DOCS})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["index"] for x in results] == sorted(range(3), key=lambda j: -want[j])
            for x in results:
                assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-4)
            r = c.post("/score", json={"text_1": QUERIES[0], "text_2": DOCS})
            assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-4)
            r = c.post("/pooling", json={"input": DOCS[1]})
            assert r.status_code == 200 and len(r.json()["data"][0]["data"][0]) == 32
            r = c.post("/pooling", json={"input": DOCS, "input_type": "document"})
            for d, text in zip(r.json()["data"], DOCS, strict=True):
                torch.testing.assert_close(torch.tensor(d["data"]), document(text), atol=1e-5,
                                           rtol=1e-5)  # fmt: skip
            r = c.post("/pooling", json={"input": QUERIES[1], "input_type": "query"})
            torch.testing.assert_close(torch.tensor(r.json()["data"][0]["data"]),
                                       query(QUERIES[1]), atol=1e-5, rtol=1e-5)  # fmt: skip
            r = c.post("/pooling", json={"input": DOCS[0], "input_type": "query",
                                         "task": "embed"})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["param"] == "input_type"
            r = c.post("/v1/embeddings", json={"input": DOCS[1]})
            assert r.status_code == 400 and "this is a ColBERT model" in r.text
            schema = c.get("/openapi.json").json()["components"]["schemas"]["PoolingRequest"]
            assert schema["properties"]["task"]["anyOf"][0]["enum"] == ["token_embed"]
        assert "a ColBERT model: every token's vector" in server.log()
        server.wait_idle()

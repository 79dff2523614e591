"""``POST /v1/embeddings`` over HTTP with the ``openai`` SDK: each input's vector is the final
hidden state of its last token, as transformers' base model computes it, normalized because the
model's sentence-transformers files say so; the engine goes on generating for everyone else and
every KV block comes back."""

from __future__ import annotations

import base64
import shutil
import struct

import pytest
import torch
from tests.server.conftest import concurrently, start_server

from infer.model.pooling import write_pooling_files

TEXTS = [
    "The quick brown fox",
    "x",
    "In Python, a list is a mutable sequence; a tuple is an immutable one. Both hold any objects, "
    "and both can be indexed, sliced and iterated over in a for loop.",
]


@pytest.fixture(scope="module")
def embedding_model(tiny_checkpoints, tmp_path_factory):
    """The tiny Qwen3 checkpoint as a sentence-transformers embedding model publishes it:
    last-token pooling, then a Normalize module."""
    folder = tmp_path_factory.mktemp("embed") / "model"
    shutil.copytree(tiny_checkpoints["qwen3"], folder)
    write_pooling_files(folder, "LAST", normalize=True)
    return folder


@pytest.fixture(scope="module")
def server(embedding_model, server_logs):
    # A small token budget: the long input's prompt runs in several chunks.
    yield from start_server(embedding_model, server_logs, "--max-num-batched-tokens", "16",
                            "--max-num-seqs", "8")  # fmt: skip


@pytest.fixture(scope="module")
def reference(embedding_model):
    """transformers' last hidden state at each text's last token (its ids with the tokenizer's
    special tokens, as the server encodes an input)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedding_model)
    model = AutoModel.from_pretrained(embedding_model, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0, -1]

    return tok, hidden


def unit(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, dim=0)


def test_the_openai_sdk_gets_each_inputs_last_token_state_normalized(server, reference):
    from openai import OpenAI

    tok, hidden = reference
    client = OpenAI(base_url=server.base_url, api_key="none")
    # (the SDK asks for base64 and decodes it)
    resp = client.embeddings.create(model="tiny", input=TEXTS)
    assert [d.index for d in resp.data] == [0, 1, 2]
    ids = [tok.encode(t) for t in TEXTS]
    assert len(ids[2]) > 16  # prefilled in chunks
    for d, token_ids in zip(resp.data, ids, strict=True):
        got = torch.tensor(d.embedding)
        assert got.shape == (64,)
        torch.testing.assert_close(got, unit(hidden(token_ids)), atol=2e-5, rtol=1e-4)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, ids))
    assert resp.model == "tiny"
    assert "LAST pooling, normalized (" in server.log()  # what it read from modules.json
    server.wait_idle()


def test_float_and_base64_encodings_carry_the_same_vector(server):
    with server.client() as c:
        as_float = c.post("/v1/embeddings", json={"input": TEXTS[0]}).json()
        as_b64 = c.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    vector = as_float["data"][0]["embedding"]
    assert as_float["object"] == "list" and as_float["data"][0]["object"] == "embedding"
    raw = base64.b64decode(as_b64.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == vector
    assert as_float["id"].startswith("embd-")


def test_token_ids_dimensions_and_normalize(server, reference):
    tok, hidden = reference
    ids = tok.encode(TEXTS[2])
    with server.client() as c:

        def embed(**fields) -> list[list[float]]:
            r = c.post("/v1/embeddings", json={"model": "tiny", **fields})
            assert r.status_code == 200, r.text
            return [d["embedding"] for d in r.json()["data"]]

        full = hidden(ids)
        torch.testing.assert_close(torch.tensor(embed(input=ids)[0]), unit(full), atol=2e-5,
                                   rtol=1e-4)  # fmt: skip
        two = embed(input=[ids, ids[:5]])
        torch.testing.assert_close(torch.tensor(two[1]), unit(hidden(ids[:5])), atol=2e-5,
                                   rtol=1e-4)  # fmt: skip
        # Matryoshka: the first 8 values, normalized after the cut
        cut = torch.tensor(embed(input=ids, dimensions=8)[0])
        torch.testing.assert_close(cut, unit(full[:8]), atol=2e-5, rtol=1e-4)
        raw = torch.tensor(embed(input=ids, normalize=False)[0])
        torch.testing.assert_close(raw, full, atol=1e-4, rtol=1e-4)
        # the last 4 tokens only
        last4 = torch.tensor(embed(input=ids, truncate_prompt_tokens=4)[0])
        torch.testing.assert_close(last4, unit(hidden(ids[-4:])), atol=2e-5, rtol=1e-4)
    server.wait_idle()


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ({"input": ""}, 400, "input", ""),
        ({"input": []}, 400, "input", ""),
        ({"input": "hi", "dimensions": 65}, 400, "dimensions", "embedding size (64)"),
        ({"input": "hi", "dimensions": 0}, 400, "dimensions", ""),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", ""),
        ({"input": [[1, 2], []]}, 400, "input", ""),
        ({"input": [5, 10**6]}, 400, "input", "outside the vocabulary"),
        ({"input": "hi", "model": "other"}, 404, "model", "does not exist"),
    ],
)
def test_bad_input_is_refused_naming_the_field(server, body, status, param, says):
    with server.client() as c:
        r = c.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"] or "").startswith(param), error
    assert says in error["message"]


def test_an_input_longer_than_the_context_is_refused(server):
    with server.client() as c:
        max_len = c.get("/v1/models").json()["data"][0]["max_model_len"]
        r = c.post("/v1/embeddings", json={"input": [7] * (max_len + 1)})
        assert r.status_code == 400, r.text
        assert "context length" in r.json()["error"]["message"]
        # exactly the context fits: an embedding generates nothing
        assert c.post("/v1/embeddings", json={"input": [7] * max_len}).status_code == 200
    server.wait_idle()


def test_generation_is_unchanged_beside_embeddings(server):
    prompt = {"model": "tiny", "prompt": "The sea", "max_tokens": 12, "temperature": 0,
              "ignore_eos": True}  # fmt: skip
    with server.client() as c:
        alone = c.post("/v1/completions", json=prompt).json()["choices"][0]["text"]

        def one(i: int):
            if i % 2:
                return c.post("/v1/completions", json=prompt).json()["choices"][0]["text"]
            r = c.post("/v1/embeddings", json={"input": TEXTS[i % 3] * (1 + i % 4)})
            return len(r.json()["data"][0]["embedding"])

        results = concurrently(one, range(12))
    assert results[1::2] == [alone] * 6
    assert results[0::2] == [64] * 6
    stats = server.wait_idle()
    assert stats["finished_total"]["stop"] >= 6


def test_the_schema_bounds_dimensions_by_the_hidden_size(server):
    with server.client() as c:
        schema = c.get("/openapi.json").json()
    dims = schema["components"]["schemas"]["EmbeddingRequest"]["properties"]["dimensions"]
    assert {"type": "integer", "minimum": 1, "maximum": 64}.items() <= dims["anyOf"][0].items()
    assert "/v1/embeddings" in schema["paths"]


def test_score_is_the_cosine_of_the_embeddings(server, reference):
    tok, hidden = reference

    def cos(a: str, b: str) -> float:
        return float(unit(hidden(tok.encode(a))) @ unit(hidden(tok.encode(b))))

    with server.client() as c:
        r = c.post("/score", json={"model": "tiny", "text_1": TEXTS[0], "text_2": TEXTS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert [d["object"] for d in body["data"]] == ["score"] * 3
        want = [cos(TEXTS[0], t) for t in TEXTS]
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-4)
        assert body["data"][0]["score"] == 1.0  # a text and itself, exactly
        # the query once, each other text once
        assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in TEXTS)
        pairwise = c.post("/v1/score", json={"text_1": TEXTS[1:], "text_2": TEXTS[:2]}).json()
        assert [d["score"] for d in pairwise["data"]] == pytest.approx(
            [cos(TEXTS[1], TEXTS[0]), cos(TEXTS[2], TEXTS[1])], abs=1e-4
        )
        bad = c.post("/score", json={"text_1": TEXTS, "text_2": TEXTS[:2]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
        bad = c.post("/score", json={"text_1": "a", "text_2": ["b", ""]})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("text_2")
        # fields are checked, not read from the extras unchecked (a string here was a 500)
        bad = c.post("/score", json={"text_1": "a", "text_2": "b", "add_special_tokens": "no"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"
        bad = c.post("/score", json={"text_1": "a", "text_2": "b", "cache_salt": {"x": 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
        # at most 1,024 texts a list (1.2M copies of one text stalled the server for seconds)
        bad = c.post("/score", json={"text_1": "a", "text_2": ["b"] * 1025})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
        bad = c.post("/v1/embeddings", json={"input": ["b"] * 1025})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
    server.wait_idle()


def test_rerank_orders_the_documents_by_similarity_to_the_query(server, reference):
    tok, hidden = reference
    query = "a list in Python"
    docs = [TEXTS[1], TEXTS[2], "lists and tuples in Python", TEXTS[0]]
    q = unit(hidden(tok.encode(query)))
    scores = [float(q @ unit(hidden(tok.encode(d)))) for d in docs]
    order = sorted(range(len(docs)), key=lambda j: -scores[j])
    with server.client() as c:
        r = c.post("/rerank", json={"model": "tiny", "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        assert [x["relevance_score"] for x in results] == pytest.approx(
            [scores[j] for j in order], abs=1e-4
        )
        assert [x["document"]["text"] for x in results] == [docs[j] for j in order]
        # Cohere's shape: documents as objects, the best n, no texts back
        body = {"query": query, "documents": [{"text": d} for d in docs], "top_n": 2,
                "return_documents": False}  # fmt: skip
        top = c.post("/v2/rerank", json=body).json()["results"]
        assert [x["index"] for x in top] == order[:2] and top[0]["document"] is None
        assert c.post("/v1/rerank", json={"query": query, "documents": []}).status_code == 400
        # a document past the context is refused naming it
        long = {"query": query, "documents": ["word " * 5000]}
        bad = c.post("/rerank", json=long)
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"].startswith("documents")
    server.wait_idle()


def test_messages_embed_the_conversation_as_the_chat_template_writes_it(server, reference):
    tok, hidden = reference
    messages = [{"role": "user", "content": "What is a list?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ids = tok.encode(text, add_special_tokens=False)
    with server.client() as c:
        r = c.post("/v1/embeddings", json={"model": "tiny", "messages": messages})
        assert r.status_code == 200, r.text
        got = torch.tensor(r.json()["data"][0]["embedding"])
        torch.testing.assert_close(got, unit(hidden(ids)), atol=2e-5, rtol=1e-4)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        both = c.post("/v1/embeddings", json={"input": "x", "messages": messages})
        assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
        neither = c.post("/v1/embeddings", json={"model": "tiny"})
        assert neither.status_code == 400
    server.wait_idle()


def test_use_activation_on_a_bi_encoders_score_changes_nothing(server):
    """A cosine has no activation to switch off (and every schema-valid request is answered)."""
    with server.client() as c:
        plain = c.post("/score", json={"text_1": "a", "text_2": "b"}).json()["data"][0]["score"]
        for field in ("use_activation", "activation", "softmax"):
            r = c.post("/score", json={"text_1": "a", "text_2": "b", field: False})
            assert r.status_code == 200, r.text
            assert r.json()["data"][0]["score"] == pytest.approx(plain, abs=1e-5)

"""``infer serve`` on a BERT embedding model (sentence-transformers' mean pooling, normalized):
``POST /v1/embeddings`` with the ``openai`` SDK gives transformers' vectors for inputs sent
together and concurrently; generation endpoints answer 400 naming why; every KV block comes
back."""

from __future__ import annotations

import pytest
import torch
from tests.server.conftest import concurrently, start_server

from infer.testing.checkpoints import default_root
from infer.testing.encoders import build_encoder

TEXTS = [
    "The quick brown fox",
    "x",
    "In Python, a list is a mutable sequence; a tuple is an immutable one. Both hold any objects.",
]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return build_encoder("bert", default_root().parent / "encoders-v1", "mean")


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
        assert c.post("/v1/embeddings", json={"input": TEXTS[0]}).status_code == 200
    server.wait_idle()  # (every KV block free)

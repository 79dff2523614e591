"""A sequence classifier served over HTTP: ``/classify`` gives each input's label
probabilities, ``/score`` and ``/rerank`` score pairs with a one-label model (a cross-encoder)
as transformers' ``*ForSequenceClassification`` does over the tokenizer's pair encoding;
generation and embedding routes are refused naming why; the engine keeps serving and every KV
block comes back."""

from __future__ import annotations

import pytest
import torch
from tests.server.conftest import SHARED_KEY, concurrently, start_server

from infer.testing.checkpoints import build_classifier

QUERY = "a list in Python"
DOCS = [
    "The quick brown fox",
    "In Python, a list is a mutable sequence; a tuple is an immutable one. Both hold any objects, "
    "and both can be indexed, sliced and iterated over in a for loop.",
    "lists and tuples in Python",
    "x",
]


@pytest.fixture(scope="module")
def reranker(tiny_checkpoints):
    """The tiny Qwen3 as a one-label sequence classifier: a cross-encoder reranker."""
    return build_classifier("qwen3", tiny_checkpoints["qwen3"].parent, 1)


@pytest.fixture(scope="module")
def server(reranker, server_logs):
    # A small token budget: the long document's pair runs in several chunks.
    yield from start_server(reranker, server_logs, "--max-num-batched-tokens", "16",
                            "--max-num-seqs", "8", "--served-model-name", "rr")  # fmt: skip


@pytest.fixture(scope="module")
def reference(reranker):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reranker)
    model = AutoModelForSequenceClassification.from_pretrained(reranker, dtype=torch.float32)

    def logit(a: str, b: str | None = None) -> float:
        encoded = tok(a, text_pair=b, return_tensors="pt")
        with torch.no_grad():
            return float(model.eval()(**encoded).logits[0, 0])

    return tok, logit


def sigmoid(x: float) -> float:
    return float(torch.sigmoid(torch.tensor(x, dtype=torch.float64)))


def test_classify_gives_each_inputs_label_probability(server, reference):
    tok, logit = reference
    with server.client() as c:
        r = c.post("/classify", json={"model": "rr", "input": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("classify-") and body["object"] == "list"
        assert body["model"] == "rr"
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        for d, doc in zip(body["data"], DOCS, strict=True):
            assert d["num_classes"] == 1 and d["label"] == "label_a"
            assert d["probs"] == pytest.approx([sigmoid(logit(doc))], abs=1e-5)
        assert "a sequence classifier (Qwen3ForSequenceClassification), labels label_a" in (
            server.log()
        )
        assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(d)) for d in DOCS)
        ids = tok.encode(DOCS[0])
        one = c.post("/v1/classify", json={"input": ids}).json()["data"]
        assert one[0]["probs"] == pytest.approx(body["data"][0]["probs"], abs=1e-6)
    server.wait_idle()


def test_score_is_the_cross_encoders_relevance_of_each_pair(server, reference):
    tok, logit = reference
    with server.client() as c:
        r = c.post("/score", json={"model": "rr", "text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        want = [sigmoid(logit(QUERY, d)) for d in DOCS]
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
        # each pair is one input: the query counted with every document
        pairs = [len(tok(QUERY, text_pair=d)["input_ids"]) for d in DOCS]
        assert body["usage"]["prompt_tokens"] == sum(pairs)
        pairwise = c.post("/v1/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
        assert [d["score"] for d in pairwise["data"]] == pytest.approx(
            [sigmoid(logit(DOCS[0], DOCS[2])), sigmoid(logit(DOCS[1], DOCS[3]))], abs=1e-5
        )
        bad = c.post("/score", json={"text_1": DOCS, "text_2": DOCS[:2]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    server.wait_idle()


def test_rerank_orders_documents_by_the_cross_encoder(server, reference, reranker):
    from transformers import AutoModelForSequenceClassification

    tok, logit = reference
    model = AutoModelForSequenceClassification.from_pretrained(reranker, dtype=torch.float32)
    scores = [sigmoid(logit(QUERY, d)) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda j: -scores[j])
    with server.client() as c:
        r = c.post("/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        assert [x["relevance_score"] for x in results] == pytest.approx(
            [scores[j] for j in order], abs=1e-5
        )
        assert [x["document"]["text"] for x in results] == [DOCS[j] for j in order]
        body = {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                "return_documents": False}  # fmt: skip
        top = c.post("/v2/rerank", json=body).json()["results"]
        assert [x["index"] for x in top] == order[:2] and top[0]["document"] is None
        # truncate_prompt_tokens cuts the longer text of a pair (the document), never the query
        cut = c.post("/rerank", json={"query": QUERY, "documents": [DOCS[1]],
                                      "truncate_prompt_tokens": 12}).json()  # fmt: skip
        ids = tok(QUERY, text_pair=DOCS[1], truncation="longest_first", max_length=12)
        assert cut["usage"]["prompt_tokens"] == 12 == len(ids["input_ids"])
        assert ids["input_ids"][: len(tok.encode(QUERY))] == tok.encode(QUERY)
        with torch.no_grad():
            want = sigmoid(float(model(input_ids=torch.tensor([ids["input_ids"]])).logits[0, 0]))
        assert cut["results"][0]["relevance_score"] == pytest.approx(want, abs=1e-5)
        # a pair past the context is refused naming its document
        bad = c.post("/rerank", json={"query": QUERY, "documents": ["x", "word " * 5000]})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "documents[1]"
    server.wait_idle()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/embeddings", {"input": "hello"}),
    ],
)
def test_generation_and_embeddings_are_refused_naming_why(server, path, body):
    with server.client() as c:
        r = c.post(path, json={"model": "rr", **body})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "Qwen3ForSequenceClassification" in message
    assert "sequence classifier with 1 label" in message and "/classify" in message
    server.wait_idle()


def test_it_keeps_classifying_under_concurrent_load(server, reference):
    _, logit = reference
    want = [sigmoid(logit(d)) for d in DOCS]
    with server.client() as c:

        def one(i: int) -> float:
            r = c.post("/classify", json={"input": DOCS[i % 4]})
            assert r.status_code == 200, r.text
            return r.json()["data"][0]["probs"][0]

        got = concurrently(one, range(16))
    assert got == pytest.approx([want[i % 4] for i in range(16)], abs=1e-5)
    stats = server.wait_idle()
    assert stats["in_flight"] == 0


def test_a_language_model_answers_classify_with_404_naming_why(shared_server, server):
    with shared_server.client() as c:
        r = c.post("/v1/classify", json={"input": "hello"},
                   headers={"Authorization": f"Bearer {SHARED_KEY}"})  # fmt: skip
        assert r.status_code == 404, r.text
        assert "(LlamaForCausalLM) has no classification head" in r.json()["error"]["message"]
        # in the schema only where it is served
        assert "/classify" not in c.get("/openapi.json").json()["paths"]
    with server.client() as c:
        assert {"/classify", "/v1/classify"} <= set(c.get("/openapi.json").json()["paths"])


def test_vllms_qwen3_reranker_command_serves_a_causal_reranker(tiny_checkpoints, server_logs,
                                                                tmp_path):  # fmt: skip
    """``--hf-overrides`` as vLLM's Qwen3-Reranker recipe writes it: the causal model's "yes"
    probability over "no" / "yes" after the pair is each document's relevance."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoints["qwen3"]
    tok = AutoTokenizer.from_pretrained(path)
    causal = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = [300, 301]  # (two tokens of the tiny tokenizer stand in for "no" and "yes")
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": tok.convert_ids_to_tokens(ids),
                 "is_original_qwen3_reranker": True}  # fmt: skip

    def p_yes(doc: str) -> float:
        with torch.no_grad():
            logits = causal(**tok(QUERY, text_pair=doc, return_tensors="pt")).logits[0, -1]
        return float(torch.softmax(logits[ids], 0)[1])

    for server in start_server(path, server_logs, "--hf-overrides", json.dumps(overrides),
                               env={"INFER_CACHE_DIR": str(tmp_path)}):  # fmt: skip
        with server.client() as c:
            r = c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            want = [p_yes(d) for d in DOCS]
            assert [x["index"] for x in results] == sorted(range(4), key=lambda j: -want[j])
            for x in results:
                assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
            refused = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 400
        server.wait_idle()


def test_use_activation_false_answers_the_raw_logits(server, reference):
    _, logit = reference
    with server.client() as c:
        body = c.post("/classify", json={"input": DOCS[:2], "use_activation": False}).json()
        assert [p for d in body["data"] for p in d["probs"]] == pytest.approx(
            [logit(DOCS[0]), logit(DOCS[1])], abs=1e-5
        )
        older = c.post("/classify", json={"input": DOCS[0], "activation": False}).json()
        assert older["data"][0]["probs"] == pytest.approx([logit(DOCS[0])], abs=1e-5)
        scores = c.post("/score", json={"text_1": QUERY, "text_2": DOCS[:2],
                                        "use_activation": False}).json()  # fmt: skip
        assert [d["score"] for d in scores["data"]] == pytest.approx(
            [logit(QUERY, DOCS[0]), logit(QUERY, DOCS[1])], abs=1e-5
        )
    server.wait_idle()


def test_a_conversation_is_classified_as_the_chat_template_writes_it(server, reranker):
    """A reward model's input: ``messages`` in place of ``input``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reranker)
    model = AutoModelForSequenceClassification.from_pretrained(reranker, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is a list?"},
                {"role": "assistant", "content": "A mutable sequence."}]  # fmt: skip
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ids = tok.encode(text, add_special_tokens=False)
    with torch.no_grad():
        want = sigmoid(float(model.eval()(input_ids=torch.tensor([ids])).logits[0, 0]))
    with server.client() as c:
        r = c.post("/classify", json={"messages": messages})
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["probs"] == pytest.approx([want], abs=1e-5)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        both = c.post("/classify", json={"messages": messages, "input": "x"})
        assert both.status_code == 400 and "exactly one of" in both.json()["error"]["message"]
    server.wait_idle()


def test_a_llama_cpp_reranker_gguf_answers_rerank_as_llama_server(tiny_checkpoints, server_logs,
                                                                  tmp_path):  # fmt: skip
    """``infer serve rr.gguf`` with no flag: each (query, document) is the file's ``rerank``
    template with the two written in, scored by the softmax probability of "yes"."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infer.testing.gguf_files import write_gguf

    folder = tiny_checkpoints["qwen3"]
    template = "<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    yes, no = 301, 300
    file = write_gguf(folder, tmp_path / "rr.gguf", reranker=(yes, no, template))
    tok = AutoTokenizer.from_pretrained(folder)
    causal = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def p_yes(doc: str) -> float:
        text = template.replace("{query}", QUERY).replace("{document}", doc)
        with torch.no_grad():
            ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
            logits = causal(ids).logits[0, -1]
        return float(torch.softmax(logits[[yes, no]], 0)[0])

    for server in start_server(file, server_logs, env={"INFER_CACHE_DIR": str(tmp_path / "c")}):
        with server.client() as c:
            r = c.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
            assert r.status_code == 200, r.text
            for x in r.json()["results"]:
                assert x["relevance_score"] == pytest.approx(p_yes(DOCS[x["index"]]), abs=1e-5)
        server.wait_idle()

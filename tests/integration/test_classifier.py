"""Sequence classifiers offline (``LLM.classify``; ``LLM.score`` with a cross-encoder): each
prompt's logits are transformers' ``*ForSequenceClassification`` logits on every family, the
same whether the prompt ran whole, in chunks, batched, or partly from the prefix cache; a
one-label model scores a pair as the sigmoid of its logit over the tokenizer's pair encoding;
what a classifier cannot do is refused naming why; every KV block comes back (``make_llm``)."""

from __future__ import annotations

import pytest
import torch

from infer import SamplingParams
from infer.core.pooling_params import PoolingParams
from infer.core.sampling_params import InvalidRequestError
from infer.testing.checkpoints import build_classifier

from .conftest import PROMPTS

LONG = PROMPTS[5]  # ~40 tokens
FAMILIES = [("llama", 3), ("qwen3", 1), ("gemma3", 2), ("gpt2", 2), ("mistral", 1),
            ("qwen2_moe", 2)]  # fmt: skip


@pytest.fixture(scope="module")
def classifiers(tiny_checkpoints):
    """(kind, labels) -> the tiny checkpoint of that family as a sequence classifier."""
    root = tiny_checkpoints["llama"].parent
    return {(kind, n): build_classifier(kind, root, n) for kind, n in FAMILIES + [("qwen2", 3)]}


def engine_idle(llm) -> bool:
    kv = llm.engine.kv_manager
    return not llm.engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_total_blocks


def test_num_labels_wins_over_id2label_as_transformers_reads_it(classifiers, tmp_path):
    from infer.model.registry import classifier_labels

    arch = "LlamaForSequenceClassification"
    two = {"id2label": {"0": "neg", "1": "pos"}}
    assert classifier_labels(arch, two) == ("neg", "pos")
    assert classifier_labels(arch, {**two, "num_labels": 2}) == ("neg", "pos")
    assert classifier_labels(arch, {**two, "num_labels": 1}) == ("LABEL_0",)
    assert classifier_labels(arch, {}) == ("LABEL_0", "LABEL_1")
    assert classifier_labels("LlamaForCausalLM", two) == ()


def _hf(path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()

    def logits(**encoded) -> torch.Tensor:
        with torch.no_grad():
            return model(**{k: torch.tensor([v]) for k, v in encoded.items()}).logits[0]

    return tok, model, logits


def _logits(results) -> list[torch.Tensor]:
    return [torch.tensor(r.outputs.logits) for r in results]


@pytest.mark.parametrize(("kind", "num_labels"), FAMILIES)
def test_classify_gives_transformers_sequence_classification_logits(
    classifiers, make_llm, kind, num_labels
):
    path = classifiers[(kind, num_labels)]
    tok, model, hf_logits = _hf(path)
    prompts = [PROMPTS[0], PROMPTS[4], LONG]
    llm = make_llm(str(path), max_num_batched_tokens=16)  # the long prompt runs in chunks
    results = llm.classify(prompts)
    labels = [model.config.id2label[i] for i in range(num_labels)]
    for r, got in zip(results, _logits(results), strict=True):
        ids = tok.encode(r.prompt)
        assert r.prompt_token_ids == ids
        want = hf_logits(input_ids=ids)
        assert got.shape == (num_labels,)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert r.outputs.num_classes == num_labels
        assert r.outputs.label == labels[int(want.argmax())]
        probs = torch.sigmoid(want) if num_labels == 1 else torch.softmax(want, dim=0)
        assert r.outputs.probs == pytest.approx(probs.tolist(), abs=1e-5)


def test_chunked_cached_and_batched_prompts_give_the_same_logits(classifiers, make_llm):
    path = str(classifiers[("qwen2", 3)])
    whole = _logits(make_llm(path).classify([LONG, PROMPTS[2]]))
    llm = make_llm(path, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=8)
    first = llm.classify([LONG, PROMPTS[2]])
    again = llm.classify(LONG)[0]
    assert first[0].num_cached_tokens == 0 and again.num_cached_tokens >= 32
    for got, want in zip(_logits([*first, again]), [*whole, whole[0]], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a pooling config cannot move a decoder classifier's head off its last token
    llm = make_llm(path, max_num_batched_tokens=8, pooler_config={"pooling_type": "MEAN"})
    assert llm.engine.runner.pooling_type == "LAST"
    for got, want in zip(_logits(llm.classify([LONG, PROMPTS[2]])), whole, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_cross_encoder_scores_a_pair_as_the_sigmoid_of_its_logit(classifiers, make_llm):
    path = classifiers[("qwen3", 1)]
    tok, _, hf_logits = _hf(path)
    llm = make_llm(str(path))
    query, docs = "a list in Python", [PROMPTS[1], PROMPTS[0], LONG]

    def want(a: str, b: str) -> float:
        return float(torch.sigmoid(hf_logits(**tok(a, text_pair=b))[0]))

    results = llm.score(query, docs)
    assert [(r.text_1, r.text_2) for r in results] == [(query, d) for d in docs]
    assert [r.outputs.score for r in results] == pytest.approx(
        [want(query, d) for d in docs], abs=1e-5
    )
    # pair by pair; two token-id lists are joined as they are
    pairwise = llm.score(docs[:2], docs[1:])
    assert [r.outputs.score for r in pairwise] == pytest.approx(
        [want(docs[0], docs[1]), want(docs[1], docs[2])], abs=1e-5
    )
    a, b = tok.encode(query), tok.encode(docs[0])
    joined = llm.score([a], [b])[0].outputs.score
    assert joined == pytest.approx(float(torch.sigmoid(hf_logits(input_ids=a + b)[0])), abs=1e-5)
    with pytest.raises(InvalidRequestError, match="both as texts or both as ids") as e:
        llm.score(query, [b])
    assert e.value.param == "text_2"


def test_what_a_classifier_cannot_do_is_refused_and_it_keeps_serving(classifiers, make_llm):
    llm = make_llm(str(classifiers[("llama", 3)]))
    with pytest.raises(InvalidRequestError, match="sequence classifier with 3 labels") as e:
        llm.generate("hello", SamplingParams(max_tokens=4))
    assert e.value.param == "prompt" and "neither generates nor embeds" in str(e.value)
    with pytest.raises(InvalidRequestError, match="sequence classifier"):
        llm.embed("hello")
    assert "scores pairs" not in str(e.value)  # (three labels: it cannot)
    with pytest.raises(InvalidRequestError, match="needs a cross-encoder with one"):
        llm.score("a", "b")  # three labels: which one means "relevant"?
    assert engine_idle(llm)  # (refused before any pair ran)
    engine = llm.engine
    with pytest.raises(ValueError, match="a sequence classifier, which generates none"):
        make_llm(
            str(classifiers[("llama", 3)]),
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(InvalidRequestError, match="neither dimensions nor normalize"):
        engine.add_request("r", [1, 2, 3], PoolingParams(task="classify", dimensions=2))
    assert len(llm.classify(["still", "serving"])) == 2
    # a language model has no head to classify with
    lm = make_llm("llama")
    with pytest.raises(InvalidRequestError, match="no classification head"):
        lm.classify("hello")
    with pytest.raises(InvalidRequestError, match="task must be one of embed, classify"):
        PoolingParams(task="generate")


def test_weight_quantization_leaves_the_head_in_the_models_dtype(classifiers, make_llm):
    path = str(classifiers[("llama", 3)])
    exact = _logits(make_llm(path).classify(PROMPTS[:3]))
    llm = make_llm(path, dtype="bfloat16", quantization="int8")
    head = llm.engine.model.classifier
    assert head.weight.dtype == torch.bfloat16 and head.weight.shape == (3, 64)
    for got, want in zip(_logits(llm.classify(PROMPTS[:3])), exact, strict=True):
        torch.testing.assert_close(got, want, atol=0.15, rtol=0.05)


def test_the_plan_counts_what_a_quantized_classifier_holds(classifiers, make_llm):
    """``infer plan --quantization int8`` on a classifier: its layers quantized, the head and
    the embedding table as they are, and no quantized vocabulary copy (it projects nothing onto
    the vocabulary): within 1% of what the engine holds."""
    from infer.plan import quantized_weight_bytes

    path = classifiers[("llama", 3)]
    planned = quantized_weight_bytes(path, 4, "int8")
    held = make_llm(str(path), quantization="int8").engine.weights_bytes
    assert getattr(make_llm(str(path)).engine.model, "packed_logits", None) is None
    assert abs(planned - held) <= 0.01 * held, (planned, held)


def _causal_reranker_overrides(tok, arch: str, **extra) -> tuple[dict, list[int]]:
    """vLLM's ``--hf-overrides`` for a causal reranker answering with one of two tokens (two
    tokens of the tiny tokenizer stand in for "no" and "yes")."""
    ids = [300, 301]
    tokens = tok.convert_ids_to_tokens(ids)
    overrides = {"architectures": [arch], "classifier_from_token": tokens, **extra}
    return overrides, ids


@pytest.mark.parametrize(("kind", "arch"), [("qwen3", "Qwen3ForSequenceClassification"),
                                            ("gpt2", "GPT2ForSequenceClassification")])  # fmt: skip
def test_a_causal_reranker_is_served_as_a_classifier_with_hf_overrides(
    tiny_checkpoints, make_llm, monkeypatch, tmp_path, kind, arch
):
    """Qwen3-Reranker's recipe: the head is ``W[yes] - W[no]`` of the vocabulary projection
    (an untied lm_head for Qwen3, the tied embedding table for GPT-2), so a pair's score is the
    causal model's softmax probability of "yes" over the two tokens; ``no_post_processing``
    keeps each token's row: the causal model's logits of those tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    path = tiny_checkpoints[kind]
    tok = AutoTokenizer.from_pretrained(path)
    causal = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def last_logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return causal(torch.tensor([ids])).logits[0, -1]

    overrides, ids = _causal_reranker_overrides(tok, arch, is_original_qwen3_reranker=True)
    llm = make_llm(str(path), hf_overrides=overrides)
    assert llm.engine.spec.labels == (tok.convert_ids_to_tokens(ids[1]),)
    assert llm.engine.model_path.parent == tmp_path / "overrides"
    docs = [PROMPTS[0], LONG]
    for r, doc in zip(llm.score(PROMPTS[1], docs), docs, strict=True):
        want = torch.softmax(last_logits(tok(PROMPTS[1], text_pair=doc)["input_ids"])[ids], 0)[1]
        assert r.outputs.score == pytest.approx(float(want), abs=1e-5)
    overrides, ids = _causal_reranker_overrides(tok, arch, method="no_post_processing")
    got = make_llm(str(path), hf_overrides=overrides).classify(PROMPTS[2])[0]
    assert got.outputs.logits == pytest.approx(last_logits(tok.encode(PROMPTS[2]))[ids].tolist(),
                                               abs=1e-4)  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"classifier_from_token": ["a"]}, "set architectures too"),
        ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": "yes"},
         "must be a list of token strings"),
        ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a"],
          "method": "from_2_way_softmax"}, "takes two tokens"),
        ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a"],
          "method": "sum"}, "is not one of from_2_way_softmax, no_post_processing"),
        ({"architectures": ["Qwen3ForSequenceClassification"],
          "classifier_from_token": ["no such token"]}, "is not a token of the tokenizer"),
    ],
)  # fmt: skip
def test_bad_overrides_are_start_up_errors_naming_the_field(
    tiny_checkpoints, monkeypatch, tmp_path, overrides, says
):
    from infer import LLM
    from infer.model.folders import ModelLoadError

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match=says):
        LLM(str(tiny_checkpoints["qwen3"]), dtype="float32", hf_overrides=overrides)
    with pytest.raises(ValueError, match="--hf-overrides must be a JSON object"):
        LLM(str(tiny_checkpoints["qwen3"]), hf_overrides="[1]")


def test_hf_overrides_replace_config_fields_in_a_folder_of_links(tiny_checkpoints, tmp_path):
    import json

    from infer.model.overrides import overridden_folder

    source = tiny_checkpoints["llama"]
    folder = overridden_folder(source, {"max_position_embeddings": 77}, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config == {**json.loads((source / "config.json").read_text()),
                      "max_position_embeddings": 77}  # fmt: skip
    weights = folder / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (source / "model.safetensors").resolve()
    # the same overrides: the same folder; others: another one; none: the folder itself
    assert overridden_folder(source, '{"max_position_embeddings": 77}', tmp_path) == folder
    assert overridden_folder(source, {"max_position_embeddings": 78}, tmp_path) != folder
    assert overridden_folder(source, "", tmp_path) == source.resolve()


def test_a_causal_reranker_gguf_file_is_served_with_hf_overrides(
    tiny_checkpoints, make_llm, monkeypatch, tmp_path
):
    """A Qwen3-Reranker as llama.cpp users hold it, a GGUF file of the causal model: the
    overrides apply to the folder made from its metadata, and the head's rows come from the
    file's vocabulary projection."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infer.testing.gguf_files import write_gguf

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    folder = tiny_checkpoints["qwen3"]
    file = write_gguf(folder, tmp_path / "reranker.gguf")
    tok = AutoTokenizer.from_pretrained(folder)
    overrides, ids = _causal_reranker_overrides(tok, "Qwen3ForSequenceClassification",
                                                is_original_qwen3_reranker=True)  # fmt: skip
    llm = make_llm(str(file), hf_overrides=overrides)
    causal = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    query, docs = tok.encode(PROMPTS[1]), [tok.encode(PROMPTS[0]), tok.encode(LONG)]
    for r, doc in zip(llm.score([query], docs), docs, strict=True):
        with torch.no_grad():
            logits = causal(torch.tensor([query + doc])).logits[0, -1]
        assert r.outputs.score == pytest.approx(float(torch.softmax(logits[ids], 0)[1]), abs=1e-5)


def test_a_cross_encoders_saved_activation_decides_its_score(classifiers, make_llm, monkeypatch,
                                                              tmp_path):  # fmt: skip
    """sentence-transformers saves a CrossEncoder's activation in config.json: Identity scores
    a pair by its raw logit; an activation infer does not apply is a start-up error."""
    from infer import LLM
    from infer.model.folders import ModelLoadError

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    path = str(classifiers[("qwen3", 1)])
    sigmoid = make_llm(path).score("a query", ["a document", "another"])
    identity = {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}
    raw = make_llm(path, hf_overrides=identity).score("a query", ["a document", "another"])
    for s, r in zip(sigmoid, raw, strict=True):
        assert s.outputs.score == pytest.approx(float(torch.sigmoid(torch.tensor(r.outputs.score))))
    tanh = {"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}
    with pytest.raises(ModelLoadError, match="activation 'torch.nn.modules.activation.Tanh'"):
        LLM(path, dtype="float32", hf_overrides=tanh)


RERANK_TEMPLATE = ("<|im_start|>system\nJudge the document.<|im_end|>\n<|im_start|>user\n"
                   "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip


def test_a_llama_cpp_reranker_gguf_file_is_served_as_it_is(tiny_checkpoints, make_llm,
                                                             monkeypatch, tmp_path):  # fmt: skip
    """A Qwen3-Reranker GGUF file as llama.cpp's converter writes it (pooling RANK, the "yes"
    and "no" rows as cls.output.weight, a ``rerank`` chat template): no flag; a pair is the
    template with the two texts in it, its score the softmax probability of "yes", as
    llama-server's /v1/rerank answers."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infer.testing.gguf_files import write_gguf

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    folder = tiny_checkpoints["qwen3"]
    yes, no = 301, 300  # (two tokens of the tiny tokenizer stand in for them)
    file = write_gguf(folder, tmp_path / "rr.gguf", reranker=(yes, no, RERANK_TEMPLATE))
    llm = make_llm(str(file))
    spec = llm.engine.spec
    assert spec.architecture == "Qwen3ForSequenceClassification" and spec.labels == ("yes",)
    tok = AutoTokenizer.from_pretrained(folder)
    causal = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def p_yes(ids: list[int]) -> float:
        with torch.no_grad():
            logits = causal(torch.tensor([ids])).logits[0, -1]
        return float(torch.softmax(logits[[yes, no]], 0)[0])

    query, docs = "a list in Python", [PROMPTS[1], LONG]
    for r, doc in zip(llm.score(query, docs), docs, strict=True):
        text = RERANK_TEMPLATE.replace("{query}", query).replace("{document}", doc)
        ids = tok.encode(text, add_special_tokens=False)
        assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # (parsed as specials)
        assert r.outputs.score == pytest.approx(p_yes(ids), abs=1e-5)


def test_a_templated_pair_past_max_length_drops_the_documents_last_tokens(tiny_checkpoints):
    from transformers import AutoTokenizer

    from infer.model.tokenizer import encode_pair

    tok = AutoTokenizer.from_pretrained(tiny_checkpoints["qwen3"])
    whole = encode_pair(tok, "a query", LONG, template=RERANK_TEMPLATE)
    cut = encode_pair(tok, "a query", LONG, max_length=len(whole) - 10, template=RERANK_TEMPLATE)
    assert len(cut) == len(whole) - 10
    # the whole prompt's tokens, ten of the document's last ones left out: the prompt around
    # it and the query keep theirs
    end = tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert cut[-len(end) :] == whole[-len(end) :] == end
    i = next(k for k in range(len(cut)) if cut[k] != whole[k])
    assert cut == whole[:i] + whole[i + 10 :] and i > 20
    # a query holding the placeholder is written in as it is
    odd = encode_pair(
        tok, "{document}?", LONG, max_length=len(whole) - 10, template=RERANK_TEMPLATE
    )
    assert len(odd) == len(whole) - 10
    with pytest.raises(InvalidRequestError, match="without the document is") as e:
        encode_pair(tok, "a query", LONG, max_length=12, template=RERANK_TEMPLATE)
    assert e.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize(
    ("overrides", "starts"),
    [
        ({"rerank_template": "<Document>: {document}"}, "rerank_template must be a string"),
        ({"rerank_template": "{query} {document} {document}"}, "rerank_template must be"),
        # a several-label model's saved activation is not one a pair score uses: it starts
        ({"sentence_transformers": {"activation_fn": "torch.nn.Softmax"}}, None),
    ],
)
def test_classifier_config_fields_checked_at_start_up(classifiers, monkeypatch, tmp_path,
                                                       overrides, starts):  # fmt: skip
    from infer import LLM
    from infer.model.folders import ModelLoadError

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    path = str(classifiers[("llama", 3)])
    if starts is None:
        LLM(path, dtype="float32", hf_overrides=overrides).close()
        return
    with pytest.raises(ModelLoadError, match=starts):
        LLM(path, dtype="float32", hf_overrides=overrides)


def test_a_pair_cut_below_its_special_tokens_is_refused(tiny_checkpoints):
    """A tokenizer that writes ``E a E b E`` for a pair cannot cut it to 2 tokens: a 400
    naming truncate_prompt_tokens, not a pair of special tokens scored."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from infer.model.tokenizer import encode_pair

    tok = AutoTokenizer.from_pretrained(tiny_checkpoints["qwen3"])
    eos = tok.eos_token
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"$A {eos}", pair=f"{eos} $A {eos} $B {eos}",
        special_tokens=[(eos, tok.eos_token_id)],
    )  # fmt: skip
    assert len(encode_pair(tok, "a list", "of words", max_length=5)) == 5
    with pytest.raises(InvalidRequestError, match="leaves no room") as e:
        encode_pair(tok, "a list", "of words", max_length=2)
    assert e.value.param == "truncate_prompt_tokens"

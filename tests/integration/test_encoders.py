"""BERT-family encoders (``BertModel``, ``XLMRobertaModel``) as embedding models: each input's
vector is what sentence-transformers computes from transformers' hidden states (the mean of
every token's, or the CLS token's, then normalized as the files say), whether the input ran
alone, beside others of other lengths, or again; what an encoder cannot do is refused naming
it; every KV block comes back (``make_llm``)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.core.pooling_params import PoolingParams
from infer.core.sampling_params import InvalidRequestError
from infer.testing.encoders import ENCODER_KINDS, build_encoder, default_encoder_root

from .conftest import PROMPTS, skip_unless_cpu

TEXTS = [PROMPTS[0], PROMPTS[5], "a", PROMPTS[2]]


@pytest.fixture(scope="module")
def encoder_root():
    return default_encoder_root()


def _skip_without_the_oracle(kind: str) -> None:
    """Transformers releases before GTE's port (5.17 has none) cannot build or check one."""
    import transformers

    name = ENCODER_KINDS[kind].replace("Model", "Config")
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")


def _sentence_transformers(folder, texts: list[str], pooling: str) -> list[torch.Tensor]:
    """transformers' hidden states of each text (its tokenizer's ``[CLS] ... [SEP]``), pooled
    as sentence-transformers' Pooling module does (unnormalized)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
            out.append(hidden.mean(dim=0) if pooling == "mean" else hidden[0])
    return out


def _vectors(results) -> list[torch.Tensor]:
    return [torch.tensor(r.outputs.embedding) for r in results]


@pytest.mark.parametrize(
    "kind", ["bert", "xlm_roberta", "nomic_bert", "gte", "modernbert", "mpnet", "distilbert"]
)
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_embeddings_are_sentence_transformers_vectors(kind, pooling, encoder_root, make_llm):
    _skip_without_the_oracle(kind)
    folder = build_encoder(kind, encoder_root, pooling)
    want = _sentence_transformers(folder, TEXTS, pooling)
    llm = make_llm(str(folder))
    results = llm.embed(TEXTS)  # one step: inputs of 3 to 40 tokens side by side
    raw = _vectors(llm.embed(TEXTS, PoolingParams(normalize=False)))
    for r, got, unnormalized, w in zip(results, _vectors(results), raw, want, strict=True):
        assert r.prompt_token_ids[0] == llm.tokenizer.cls_token_id  # [CLS] text [SEP]
        assert r.prompt_token_ids[-1] == llm.tokenizer.sep_token_id
        torch.testing.assert_close(unnormalized, w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, torch.nn.functional.normalize(w, dim=0), atol=1e-6,
                                   rtol=1e-5)  # fmt: skip
    engine = llm.engine
    assert engine.spec.is_encoder and not engine.config.cache.enable_prefix_caching
    assert engine.pooler_config.pooling_type == pooling.upper()


def test_an_input_gives_the_same_vector_alone_beside_others_and_again(encoder_root, make_llm):
    """Padded into one attention call beside inputs of like length, attended one by one beside
    a much longer one (padding would more than double the rows), alone, or sent again (nothing
    cached: an encoder's every token sees its whole input), with a token budget smaller than
    the longest input (it runs whole as the step's first prefill)."""
    from transformers import AutoModel

    folder = build_encoder("bert", encoder_root, "mean")
    llm = make_llm(str(folder), max_num_batched_tokens=16, block_size=4)
    alike = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]  # (padded: one call)
    skewed = [PROMPTS[5], "a", "b", "c", "d"]  # (one by one)
    for texts in (alike, skewed):
        together = _vectors(llm.embed(texts))
        for text, vector in zip(texts, together, strict=True):
            alone = _vectors(llm.embed(text))[0]
            torch.testing.assert_close(alone, vector, atol=1e-6, rtol=1e-6)
    ids = llm.tokenizer.encode(PROMPTS[5])
    assert len(ids) > 16
    again = _vectors(llm.embed(PROMPTS[5]))[0]
    torch.testing.assert_close(again, together[0], atol=1e-6, rtol=1e-6)
    # a one-token input (the context's decode path) is its own token's state
    one = _vectors(llm.embed([[ids[1]]], PoolingParams(normalize=False)))[0]
    with torch.no_grad():
        model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
        want = model(input_ids=torch.tensor([[ids[1]]])).last_hidden_state[0, 0]
    torch.testing.assert_close(one, want, atol=1e-5, rtol=1e-5)


def test_bf16_and_quantized_linears_are_close_to_float32(encoder_root, make_llm, engine_device):
    """bf16 (the tiled kernels), and its linears quantized at load: int8 weights, and int8
    weights x int8 activations (w8a8) stay close to the float32 vectors."""
    from infer.runner.quant import w8a8_available

    folder = build_encoder("bert", encoder_root, "cls")
    exact = _vectors(make_llm(str(folder)).embed(TEXTS))
    cases = [({}, 0.999), ({"quantization": "int8"}, 0.99)]
    if w8a8_available(torch.device(engine_device)):  # (AVX-512 VNNI: else refused, naming it)
        cases.append(({"quantization": "w8a8"}, 0.98))
    for options, least in cases:
        llm = make_llm(str(folder), dtype="bfloat16", **options)
        held = {"int8": "Int8Linear", "w8a8": "W8A8Linear"}.get(options.get("quantization"))
        if held is not None:  # (every projection of every layer)
            assert {type(m).__name__ for layer in llm.engine.model.layers
                    for m in (layer.qkv_proj, layer.attn_out, layer.intermediate,
                              layer.output)} == {held}  # fmt: skip
        for a, b in zip(exact, _vectors(llm.embed(TEXTS)), strict=True):
            assert torch.nn.functional.cosine_similarity(a, b, dim=0) > least, options


@pytest.mark.parametrize("kind,layers", [("bert", 2), ("modernbert", 3), ("mpnet", 2), ("jina", 2)])
def test_bf16_attention_kernel_gives_the_float32_vectors(kind, layers, encoder_root, make_llm,
                                                         monkeypatch, engine_device):  # fmt: skip
    """Heads 64 wide (the C++ encoder attention kernel's shapes; the tiny model's 16 take
    SDPA): in bf16 every layer's attention is one kernel call (ModernBERT's local layers with
    their window), and the vectors of inputs of many lengths side by side stay within bf16's
    reach of float32's."""
    from infer.runner.cpu.kernels import CpuKernels, cpu_kernels

    skip_unless_cpu(engine_device, "the C++ encoder attention kernel")
    kernels = cpu_kernels()
    if kernels is None or not kernels.has_prefill_attention:
        pytest.skip("no C++ attention kernels on this machine")
    from infer.testing.encoders import build_jina

    shape = dict(hidden_size=128, num_attention_heads=2, intermediate_size=256)
    if kind == "jina":  # (ALiBi: a bias by distance inside the kernel)
        folder = build_jina(encoder_root, name="jina-mean-d64", **shape)
    else:
        folder = build_encoder(kind, encoder_root, "mean", name=f"{kind}-mean-d64", **shape)
    texts = [*TEXTS, PROMPTS[1], PROMPTS[3] * 3]
    exact = _vectors(make_llm(str(folder)).embed(texts))
    calls = []
    original = CpuKernels.encoder_attention
    monkeypatch.setattr(CpuKernels, "encoder_attention",
                        lambda self, *a: calls.append(1) or original(self, *a))  # fmt: skip
    got = _vectors(make_llm(str(folder), dtype="bfloat16").embed(texts))
    assert calls and len(calls) % layers == 0  # (every layer of each step)
    for a, b in zip(exact, got, strict=True):
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999


def test_pooler_config_overrides_the_files(encoder_root, make_llm):
    folder = build_encoder("bert", encoder_root, "mean")
    cls_vectors = _sentence_transformers(folder, TEXTS[:2], "cls")
    llm = make_llm(str(folder), pooler_config={"pooling_type": "CLS", "normalize": False})
    for got, want in zip(_vectors(llm.embed(TEXTS[:2])), cls_vectors, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the last token: [SEP]'s state
    last = make_llm(str(folder), pooler_config={"pooling_type": "last", "normalize": False})
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        want = AutoModel.from_pretrained(folder).eval()(**tok(TEXTS[0], return_tensors="pt"))
    torch.testing.assert_close(_vectors(last.embed(TEXTS[0]))[0],
                               want.last_hidden_state[0, -1], atol=1e-5, rtol=1e-5)  # fmt: skip


def test_score_is_the_cosine_of_the_embeddings(encoder_root, make_llm):
    folder = build_encoder("xlm_roberta", encoder_root, "mean")
    llm = make_llm(str(folder))
    a, b = _vectors(llm.embed(TEXTS[:2]))
    score = llm.score(TEXTS[0], TEXTS[1])[0].outputs.score
    assert score == pytest.approx(float(torch.dot(a, b)), abs=1e-5)


def test_what_an_encoder_cannot_do_is_refused_naming_it(encoder_root, make_llm):
    folder = build_encoder("bert", encoder_root, "mean")
    llm = make_llm(str(folder))
    with pytest.raises(InvalidRequestError, match="is an encoder: it embeds") as e:
        llm.generate(TEXTS[0], SamplingParams(max_tokens=4))
    assert e.value.param == "prompt"
    too_long = "word " * 200  # past its 128 positions
    with pytest.raises(InvalidRequestError, match="128") as e:
        llm.embed(too_long)
    assert e.value.param == "input"
    assert _vectors(llm.embed(TEXTS[0]))  # it goes on serving
    for options, says in (
        ({"prefill_chunk_size": 8}, "chunked prefill"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
         "speculative decoding"),
        ({"tensor_parallel_size": 2}, "tensor parallelism"),
        ({"enable_lora": True}, "LoRA adapters"),
        ({"attention_backend": "triton"}, "triton"),
        ({"preemption_mode": "swap"}, "preemption-mode swap"),
        ({"pooler_config": {"pooling_type": "MAX"}}, "pooling_type 'MAX' is not supported"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            LLM(str(folder), dtype="float32", **options)


CROSS_ENCODERS = [("bert", {}), ("xlm_roberta", {}), ("nomic_bert", {}), ("gte", {}),
                  ("mpnet", {}), ("distilbert", {}), ("modernbert", {}),
                  ("modernbert", {"classifier_pooling": "mean", "classifier_bias": True,
                                  "classifier_activation": "silu"})]  # fmt: skip


@pytest.mark.parametrize("kind,head", CROSS_ENCODERS)
def test_a_cross_encoder_scores_pairs_as_transformers(kind, head, encoder_root, make_llm):
    _skip_without_the_oracle(kind)
    """A ``*ForSequenceClassification`` encoder (one label: a reranker) scores each pair as
    transformers' classifier does on the tokenizer's pair encoding (BERT's second text is token
    type 1), through its own head (BERT's pooler and classifier; RoBERTa's and MPNet's dense
    and out_proj; DistilBERT's pre_classifier, ReLU and classifier; ModernBERT's dense, activation and norm over the first token's state or
    the mean of all, as its ``classifier_pooling`` says), the sigmoid of the logit."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from infer.testing.encoders import build_cross_encoder

    folder = build_cross_encoder(kind, encoder_root, **head)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    query, docs = TEXTS[0], TEXTS[1:]
    with torch.no_grad():
        want = [torch.sigmoid(model.eval()(**tok(query, d, return_tensors="pt")).logits[0, 0])
                for d in docs]  # fmt: skip
    llm = make_llm(str(folder))
    assert llm.engine.spec.is_encoder and llm.engine.spec.is_classifier
    scores = [o.outputs.score for o in llm.score(query, docs)]
    assert scores == pytest.approx([float(w) for w in want], abs=1e-5)
    if kind in ("bert", "nomic_bert", "gte"):  # (with token types) the second text's type
        # counts: type 0 throughout is another score
        ids = tok(query, docs[0])
        assert 1 in ids["token_type_ids"]
        with torch.no_grad():
            flat = model(input_ids=torch.tensor([ids["input_ids"]])).logits[0, 0]
        assert abs(float(torch.sigmoid(flat)) - scores[0]) > 1e-4
    with pytest.raises(InvalidRequestError, match="classifies"):
        llm.embed(query)


def test_a_nomic_bert_published_config_reads_as_transformers_one(encoder_root, make_llm,
                                                                 tmp_path):  # fmt: skip
    """Nomic's own config names (``n_embd``, ``rotary_emb_base``, 8,192 positions over the
    2,048 trained: capped there, as llama.cpp caps them) serve the same model as transformers'
    names; settings infer does not run are refused naming them."""
    import json

    from infer.model.folders import ModelLoadError
    from infer.testing.encoders import nomic_published

    folder = build_encoder("nomic_bert", encoder_root, "mean")
    published = nomic_published(folder, tmp_path / "published")
    want = _vectors(make_llm(str(folder)).embed(TEXTS))
    llm = make_llm(str(published))
    assert llm.engine.max_model_len == 2048  # (max_trained_positions)
    for a, b in zip(want, _vectors(llm.embed(TEXTS)), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    config = json.loads((published / "config.json").read_text())
    (published / "config.json").write_text(json.dumps(config | {"rotary_emb_fraction": 0.5}))
    with pytest.raises(ModelLoadError, match="rotary_emb_fraction=0.5 is not supported"):
        make_llm(str(published))


def test_a_gte_published_config_reads_as_transformers_one(encoder_root, make_llm, tmp_path):
    """Alibaba's own config for GTE (``NewModel``, model_type ``new``, ``rope_theta`` and its
    code's options) serves the same model as transformers' ``GteModel`` config; its fixed NTK
    scaling (gte-base-en-v1.5's: base theta * f, frequencies over f ** (2 / d)) gives
    transformers' vectors of a linear rope of that base and factor; its mixed NTK (mixed_b) is
    refused naming it."""
    _skip_without_the_oracle("gte")
    import json
    import shutil

    from infer.model.folders import ModelLoadError

    folder = build_encoder("gte", encoder_root, "mean")
    published = tmp_path / "published"
    shutil.copytree(folder, published)
    native = json.loads((folder / "config.json").read_text())
    config = {k: v for k, v in native.items() if k != "rope_parameters"} | {
        "architectures": ["NewModel"], "model_type": "new", "position_embedding_type": "rope",
        "rope_theta": native["rope_parameters"]["rope_theta"], "layer_norm_type": "layer_norm",
        "logn_attention_scale": False, "logn_attention_clip1": False, "rope_scaling": None,
        "unpad_inputs": False, "use_memory_efficient_attention": False, "pack_qkv": True,
    }  # fmt: skip
    (published / "config.json").write_text(json.dumps(config))
    want = _vectors(make_llm(str(folder)).embed(TEXTS))
    for a, b in zip(want, _vectors(make_llm(str(published)).embed(TEXTS)), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    ntk = config | {"rope_scaling": {"type": "ntk", "factor": 2.0}}
    (published / "config.json").write_text(json.dumps(ntk))
    scaled = _vectors(make_llm(str(published)).embed(TEXTS, PoolingParams(normalize=False)))
    oracle = tmp_path / "linear"  # (transformers' GteModel config of the same frequencies)
    shutil.copytree(folder, oracle)
    head_dim = native["hidden_size"] // native["num_attention_heads"]
    linear = {"rope_type": "linear", "factor": 2.0 ** (2 / head_dim),
              "rope_theta": 2.0 * native["rope_parameters"]["rope_theta"]}  # fmt: skip
    (oracle / "config.json").write_text(json.dumps(native | {"rope_parameters": linear}))
    want = _sentence_transformers(oracle, TEXTS, "mean")
    off_scaled, off_plain = [], []
    for got, w, plain in zip(scaled, want, _sentence_transformers(folder, TEXTS, "mean"),
                             strict=True):  # fmt: skip
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
        off_scaled.append(float((got - w).abs().max()))
        off_plain.append(float((got - plain).abs().max()))
    # the scaling moved the vectors (~1e-4 on these short inputs, whose few positions rotate
    # little) far more than they differ from the scaled oracle's
    assert max(off_plain) > 10 * max(off_scaled) and max(off_plain) > 5e-5, (off_plain, off_scaled)
    mixed = config | {"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.75}}
    (published / "config.json").write_text(json.dumps(mixed))
    with pytest.raises(ModelLoadError, match="GTE with rope_scaling=.*is not supported"):
        make_llm(str(published))


def test_an_encoder_without_a_token_type_table(encoder_root, make_llm):
    """``type_vocab_size`` 0 (a GTE that has none): nothing added, transformers' vectors."""
    _skip_without_the_oracle("gte")
    folder = build_encoder("gte", encoder_root, "mean", name="gte-no-types", type_vocab_size=0)
    want = _sentence_transformers(folder, TEXTS, "mean")
    llm = make_llm(str(folder))
    assert llm.engine.model.token_type_embeddings is None
    raw = _vectors(llm.embed(TEXTS, PoolingParams(normalize=False)))
    for got, w in zip(raw, want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)


def test_a_mean_pooled_cross_encoder_in_bf16_is_close_to_float32(encoder_root, make_llm):
    """A ModernBERT cross-encoder that pools by the mean: its head runs on the mean in the
    model's dtype (bf16 here), scores within bf16's reach of float32's."""
    from infer.testing.encoders import build_cross_encoder

    folder = build_cross_encoder("modernbert", encoder_root, classifier_pooling="mean",
                                 classifier_bias=True, classifier_activation="silu")  # fmt: skip
    query, docs = TEXTS[0], TEXTS[1:]
    exact = [o.outputs.score for o in make_llm(str(folder)).score(query, docs)]
    llm = make_llm(str(folder), dtype="bfloat16")
    assert llm.engine.runner.pooling_type == "MEAN"
    got = [o.outputs.score for o in llm.score(query, docs)]
    assert got == pytest.approx(exact, abs=2e-2)


def test_plan_says_an_encoder_holds_no_kv_cache(encoder_root):
    from infer.plan import plan_from_folder, render, safetensors_weight_bytes

    folder = build_encoder("bert", encoder_root, "mean")
    text = render(plan_from_folder(folder, 2**30, 4, None))
    assert "an encoder (2 layers): it embeds; inputs of up to 128 tokens" in text
    assert "KV capacity" not in text
    with LLM(str(folder), dtype="float32") as llm:  # (what it holds: the weights, no KV)
        assert llm.engine.weights_bytes == safetensors_weight_bytes(folder, 4)
        assert llm.engine.kv_cache.tensor.numel() == 0


def _jina_reference(folder, ids: list[int]) -> torch.Tensor:
    """Jina BERT v2's hidden states of one input, written out here from its published design
    (float64, the checkpoint's tensors; ALiBi's slopes as llama.cpp computes them: m0 ** (h+1)
    for the first 2 ** floor(log2 n) heads, m1 ** (2 (h - that) + 1) for the rest)."""
    import json
    import math

    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(folder / "model.safetensors")).items()}
    heads, inter = cfg["num_attention_heads"], cfg["intermediate_size"]
    h = cfg["hidden_size"]
    d = h // heads

    def norm(x, name):
        return torch.nn.functional.layer_norm(x, (h,), w[f"{name}.weight"], w[f"{name}.bias"],
                                              cfg["layer_norm_eps"])  # fmt: skip

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w.get(f"{name}.bias", 0)

    log2 = 2 ** math.floor(math.log2(heads))
    m0, m1 = 2 ** (-8 / log2), 2 ** (-4 / log2)
    slopes = torch.tensor([m0 ** (i + 1) if i < log2 else m1 ** (2 * (i - log2) + 1)
                           for i in range(heads)], dtype=torch.float64)  # fmt: skip
    n = len(ids)
    pos = torch.arange(n)
    alibi = -slopes[:, None, None] * (pos[None, :] - pos[:, None]).abs()[None].double()
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = norm(x, "embeddings.LayerNorm")
    code = "auto_map" in cfg  # (the code model: q / k norms, a second residual, up first)
    for i in range(cfg["num_hidden_layers"]):
        at = f"encoder.layer.{i}."
        q, k, v = (linear(x, f"{at}attention.self.{p}") for p in ("query", "key", "value"))
        if code:
            q = norm(q, f"{at}attention.self.layer_norm_q")
            k = norm(k, f"{at}attention.self.layer_norm_k")
        q, k, v = (z.view(n, heads, d).transpose(0, 1) for z in (q, k, v))
        scores = q @ k.transpose(1, 2) / math.sqrt(d) + alibi
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, h)
        a = norm(x + linear(out, f"{at}attention.output.dense"), f"{at}attention.output.LayerNorm")
        if code:
            x = norm(x + a, f"{at}layer_norm_1")
            both = linear(x, f"{at}mlp.up_gated_layer")
            mlp = both[:, :inter] * torch.nn.functional.gelu(both[:, inter:])
            x = norm(x + linear(mlp, f"{at}mlp.down_layer"), f"{at}layer_norm_2")
        else:
            gated = linear(a, f"{at}mlp.gated_layers")
            mlp = torch.nn.functional.gelu(gated[:, :inter]) * gated[:, inter:]
            x = norm(a + linear(mlp, f"{at}mlp.wo"), f"{at}mlp.layernorm")
    return x


@pytest.mark.parametrize("code", [False, True])
def test_a_jina_bert_embeds_as_its_design(code, encoder_root, make_llm, monkeypatch):
    """Jina BERT v2 (``JinaBertForMaskedLM`` with ALiBi, as jina-embeddings-v2 is published;
    6 heads: ALiBi's slopes of a count that is not a power of two): the mean of the hidden
    states written out in float64 above, inputs side by side (padded) or one by one beside a
    long one, the bias made for the whole input or a few queries at a time (as for a long
    input); Jina's code model too (q / k norms, a second residual); a Jina reranker is refused
    naming it."""
    import json
    import shutil

    from infer.runner.attention import backend
    from infer.testing.encoders import build_jina

    folder = build_jina(encoder_root, name="jina-code" if code else None, code=code)
    llm = make_llm(str(folder))
    assert llm.engine.model.cfg.qk_post_norm == code
    for blocked in (False, True):
        if blocked:  # (a mask of at most 6 heads x 4 queries x 60 keys: blocks of queries)
            monkeypatch.setattr(backend, "MASK_ELEMENTS", 6 * 4 * 60)
        for texts in (TEXTS, [PROMPTS[5] * 2, "a", "b", "c"]):
            results = llm.embed(texts, PoolingParams(normalize=False))
            for r in results:
                want = _jina_reference(folder, r.prompt_token_ids).mean(0).float()
                torch.testing.assert_close(torch.tensor(r.outputs.embedding), want, atol=1e-5,
                                           rtol=1e-5)  # fmt: skip
    reranker = encoder_root / "jina-as-reranker"
    if not reranker.is_dir():
        shutil.copytree(folder, reranker)
        config = json.loads((reranker / "config.json").read_text())
        config["architectures"] = ["JinaBertForSequenceClassification"]
        (reranker / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a Jina BERT sequence classifier .* is not supported"):
        make_llm(str(reranker))


def test_dense_modules_project_the_pooled_vector(encoder_root, make_llm, tmp_path):
    """sentence-transformers ``Dense`` modules after the pooling (LaBSE's and stella's kind:
    64 -> 48 with a tanh, then 48 -> 32 without an activation, its weights in an older
    ``pytorch_model.bin``) project the pooled vector before it is normalized, as
    sentence-transformers runs them; ``dimensions`` counts the projected values; a Dense module
    whose activation infer does not run refuses embedding requests naming it."""
    import json
    import shutil

    from safetensors.torch import load_file

    from infer.testing.encoders import with_dense_modules

    base = build_encoder("bert", encoder_root, "cls")
    folder = with_dense_modules(base, encoder_root / "bert-cls-dense", [48, 32])
    first = load_file(str(folder / "2_Dense" / "model.safetensors"))
    second = torch.load(folder / "3_Dense" / "pytorch_model.bin", weights_only=True)
    want = []
    for pooled in _sentence_transformers(folder, TEXTS, "cls"):
        x = torch.tanh(first["linear.weight"] @ pooled + first["linear.bias"])
        x = second["linear.weight"] @ x + second["linear.bias"]
        want.append(torch.nn.functional.normalize(x, dim=0))
    llm = make_llm(str(folder))
    assert llm.engine.embedding_size == 32
    for got, w in zip(_vectors(llm.embed(TEXTS)), want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
    short = _vectors(llm.embed(TEXTS[:1], PoolingParams(dimensions=16)))[0]
    assert len(short) == 16
    with pytest.raises(InvalidRequestError, match=r"more than the model's embedding size \(32\)"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=33))
    odd = tmp_path / "odd"
    shutil.copytree(folder, odd)
    config = json.loads((odd / "2_Dense" / "config.json").read_text())
    config["activation_function"] = "torch.nn.modules.activation.Softplus"
    (odd / "2_Dense" / "config.json").write_text(json.dumps(config))
    llm = make_llm(str(odd))
    with pytest.raises(
        InvalidRequestError, match="activation torch.nn.modules.activation.Softplus"
    ):
        llm.embed(TEXTS[0])


def test_token_embeddings_are_every_tokens_projected_state(encoder_root, make_llm, tmp_path):
    """``LLM.encode`` (``token_embed``): each input's every token's final hidden state,
    through the model's Dense modules row by row (as a ColBERT model projects its tokens),
    normalized per token as the model's files say, cut by ``dimensions``; a step holding
    token-embedding requests beside pooled ones gives each its own; a decoder refuses them
    naming why."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    from infer.testing.encoders import with_dense_modules

    folder = with_dense_modules(build_encoder("bert", encoder_root, "cls"),
                                encoder_root / "bert-cls-dense", [48, 32])  # fmt: skip
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    first = load_file(str(folder / "2_Dense" / "model.safetensors"))
    second = torch.load(folder / "3_Dense" / "pytorch_model.bin", weights_only=True)

    def projected(text: str) -> torch.Tensor:
        with torch.no_grad():
            x = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        x = torch.tanh(x @ first["linear.weight"].T + first["linear.bias"])
        return torch.nn.functional.normalize(x @ second["linear.weight"].T + second["linear.bias"],
                                             dim=1)  # fmt: skip

    llm = make_llm(str(folder))
    results = llm.encode(TEXTS)
    for r, text in zip(results, TEXTS, strict=True):
        assert r.prompt_token_ids == tok(text)["input_ids"]
        assert r.outputs.data.shape == (len(r.prompt_token_ids), 32)
        torch.testing.assert_close(r.outputs.data, projected(text), atol=1e-5, rtol=1e-5)
    cut = llm.encode(TEXTS[0], PoolingParams(dimensions=8, normalize=False))[0].outputs.data
    assert cut.shape[1] == 8 and not torch.allclose(cut.norm(dim=1), torch.ones(len(cut)))
    vectors = llm.encode(TEXTS, pooling_task="embed")
    for got, want in zip(vectors, _vectors(llm.embed(TEXTS)), strict=True):
        torch.testing.assert_close(got.outputs.data, want)
    # one step: two token-embedding requests around a pooled one
    engine = llm.engine
    params = [PoolingParams(task="token_embed"), PoolingParams(), PoolingParams(task="token_embed")]
    for k, (text, p) in enumerate(zip(TEXTS, params, strict=False)):
        engine.add_request(f"r{k}", tok(text)["input_ids"], p)
    outputs = {o.request_id: o for o in engine.step()}
    assert sorted(outputs) == ["r0", "r1", "r2"] and all(o.finished for o in outputs.values())
    torch.testing.assert_close(torch.tensor(outputs["r0"].embedding), projected(TEXTS[0]),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(torch.tensor(outputs["r2"].embedding), projected(TEXTS[2]),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(torch.tensor(outputs["r1"].embedding),
                               _vectors(llm.embed(TEXTS[1]))[0])  # fmt: skip
    assert not engine.has_unfinished_requests()  # (and every KV block back: make_llm checks)
    # A model whose pooling infer refuses (MAX) still gives its tokens, projected.
    import json
    import shutil

    odd = tmp_path / "max"
    shutil.copytree(folder, odd)
    modes = json.loads((odd / "1_Pooling" / "config.json").read_text())
    modes = {k: k == "pooling_mode_max_tokens" for k in modes}
    (odd / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    max_pooled = make_llm(str(odd))
    with pytest.raises(InvalidRequestError, match="pools by MAX"):
        max_pooled.embed(TEXTS[0])
    torch.testing.assert_close(max_pooled.encode(TEXTS[0])[0].outputs.data,
                               projected(TEXTS[0]), atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("kind", ["bert", "modernbert"])
def test_tokens_past_attended_tokens_are_queries_only(kind, encoder_root, make_llm,
                                                     monkeypatch, engine_device):  # fmt: skip
    """``attended_tokens`` n: an input's tokens after its first n attend to them but are not
    attended to (transformers with those tokens' attention mask 0; what a ColBERT query's
    [MASK] expansion is); every token's vector comes back. In float32 (the torch reference:
    inputs of one length and of many, padded together) and in bf16 (the C++ kernel, heads 64
    wide)."""
    from transformers import AutoModel, AutoTokenizer

    from infer.runner.cpu.kernels import CpuKernels

    shape = dict(hidden_size=128, num_attention_heads=2, intermediate_size=256)
    folder = build_encoder(kind, encoder_root, "mean", name=f"{kind}-mean-d64", **shape)
    calls = []
    original = CpuKernels.encoder_attention
    monkeypatch.setattr(CpuKernels, "encoder_attention",
                        lambda self, *a: calls.append(a[-1]) or original(self, *a))  # fmt: skip
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    mask_id = tok.mask_token_id
    inputs = [ids for ids in (tok(t)["input_ids"] for t in TEXTS) if len(ids) < 40]
    # (4 expansion tokens: each within ModernBERT's local window, 4 either side, of a key)
    padded = [ids + [mask_id] * 4 for ids in inputs]
    want = []
    for ids, real in zip(padded, inputs, strict=False):
        attention = torch.tensor([[1] * len(real) + [0] * (len(ids) - len(real))])
        with torch.no_grad():
            want.append(model(input_ids=torch.tensor([ids]), attention_mask=attention)
                        .last_hidden_state[0])  # fmt: skip
    lengths = [len(ids) for ids in inputs]
    assert len(lengths) >= 3
    for dtype, tol in (("float32", 1e-5), ("bfloat16", None)):
        llm = make_llm(str(folder), dtype=dtype)
        for batch in ([0], list(range(len(padded)))):
            got = [llm.encode([padded[i]], PoolingParams(normalize=False,
                                                         attended_tokens=lengths[i]))[0]
                   for i in batch] if len(batch) == 1 else [
                llm.engine.add_request(f"r{i}", padded[i], PoolingParams(
                    task="token_embed", normalize=False, attended_tokens=lengths[i]))
                for i in batch]  # fmt: skip
            if len(batch) > 1:  # (one step: every input at once)
                outputs = {o.request_id: o for o in llm.engine.step()}
                got = [torch.tensor(outputs[f"r{i}"].embedding) for i in batch]
            else:
                got = [got[0].outputs.data]
            for i, g in zip(batch, got, strict=True):
                if tol is not None:
                    torch.testing.assert_close(g, want[i], atol=tol, rtol=tol)
                else:
                    cosine = torch.nn.functional.cosine_similarity(g, want[i], dim=1)
                    assert cosine.min() > 0.99, cosine
        with pytest.raises(InvalidRequestError, match="attended_tokens"):
            llm.encode([padded[0]], PoolingParams(attended_tokens=len(padded[0]) + 1))
        llm.shutdown()
    from infer.runner.cpu.kernels import cpu_kernels

    kernels = cpu_kernels() if engine_device == "cpu" else None
    if kernels is not None and kernels.has_prefill_attention:  # (the bf16 runs took it)
        assert calls and all(keys is not None for keys in calls)


def test_bge_m3_token_embeddings_are_its_multi_vector_output(encoder_root, make_llm, tmp_path):
    """A BGE-M3 folder (an XLM-RoBERTa with ``colbert_linear.pt`` beside it, here projecting
    to 32 values as a ``colbert_dim`` would): its token embeddings are FlagEmbedding's
    multi-vector output, ``colbert_linear`` over every token's state but the first,
    normalized; its embedding stays the CLS one its files name; one step serves both."""
    import shutil

    from transformers import AutoModel, AutoTokenizer

    folder = tmp_path / "bge-m3"
    shutil.copytree(build_encoder("xlm_roberta", encoder_root, "cls"), folder)
    gen = torch.Generator().manual_seed(3)
    linear = {"weight": 0.2 * torch.randn(32, 64, generator=gen),
              "bias": 0.1 * torch.randn(32, generator=gen)}  # fmt: skip
    torch.save(linear, folder / "colbert_linear.pt")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    llm = make_llm(str(folder))
    for text, got in zip(TEXTS, llm.encode(TEXTS), strict=True):
        with torch.no_grad():
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        want = torch.nn.functional.normalize(hidden[1:] @ linear["weight"].T + linear["bias"],
                                             dim=1)  # fmt: skip
        torch.testing.assert_close(got.outputs.data, want, atol=1e-5, rtol=1e-5)
        dense = torch.tensor(llm.embed(text)[0].outputs.embedding)
        torch.testing.assert_close(dense, torch.nn.functional.normalize(hidden[0], dim=0),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
    engine = llm.engine
    ids = tok(TEXTS[0])["input_ids"]
    engine.add_request("e", ids, PoolingParams())
    engine.add_request("t", ids, PoolingParams(task="token_embed"))
    outputs = {o.request_id: o for o in engine.step()}
    assert len(outputs["e"].embedding) == 64 and len(outputs["t"].embedding) == len(ids) - 1
    assert len(outputs["t"].embedding[0]) == 32
    with pytest.raises(InvalidRequestError, match=r"token embedding size|embedding size \(32\)"):
        llm.encode(TEXTS[0], PoolingParams(dimensions=33))


def test_a_dense_module_after_two_poolings_refuses_token_embeddings(encoder_root, make_llm,
                                                                      tmp_path):  # fmt: skip
    """A Dense module taking the CLS and mean vectors side by side (twice the hidden size)
    cannot project a token: such a model loads, and refuses token embeddings naming its
    pooling, as it refuses embeddings."""
    import json
    import shutil

    from infer.testing.encoders import with_dense_modules

    folder = tmp_path / "two"
    shutil.copytree(build_encoder("bert", encoder_root, "cls"), folder)
    modes = json.loads((folder / "1_Pooling" / "config.json").read_text())
    modes |= {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    dense = with_dense_modules(folder, tmp_path / "two-dense", [16])
    config = json.loads((dense / "2_Dense" / "config.json").read_text())
    (dense / "2_Dense" / "config.json").write_text(json.dumps(config | {"in_features": 128}))
    llm = make_llm(str(dense))
    for call in (llm.embed, llm.encode):
        with pytest.raises(InvalidRequestError, match="pools by MEAN \\+ CLS"):
            call(TEXTS[0])


def test_a_decoder_refuses_token_embeddings_naming_why(tiny_checkpoints, make_llm):
    llm = make_llm(str(tiny_checkpoints["llama"]))
    with pytest.raises(InvalidRequestError, match="is a decoder: token embeddings"):
        llm.encode(TEXTS[0])
    assert llm.embed(TEXTS[0])  # it goes on serving


@pytest.mark.parametrize("kind", ["mpnet", "distilbert", "bert"])
def test_an_encoder_published_with_its_masked_lm_head_embeds_as_its_encoder(
    kind, encoder_root, make_llm, tmp_path
):
    """all-mpnet-base-v2 is published as ``MPNetForMaskedLM`` (its encoder's tensors under
    ``mpnet.``, beside the head's): it embeds as the bare encoder does; the head is not read."""
    import shutil

    import transformers

    folder = build_encoder(kind, encoder_root, "mean")
    arch = transformers.AutoConfig.from_pretrained(folder).architectures[0]
    masked = getattr(transformers, arch.replace("Model", "ForMaskedLM"))
    published = tmp_path / "published"
    masked.from_pretrained(folder, dtype=torch.float32).save_pretrained(published)
    for item in folder.iterdir():
        if not (published / item.name).exists():
            copy = shutil.copytree if item.is_dir() else shutil.copy
            copy(item, published / item.name)
    assert transformers.AutoConfig.from_pretrained(published).architectures == [
        arch.replace("Model", "ForMaskedLM")
    ]
    want = _vectors(make_llm(str(folder)).embed(TEXTS))
    for a, b in zip(want, _vectors(make_llm(str(published)).embed(TEXTS)), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_jina_folder_without_pooling_files_pools_as_its_config_says(encoder_root, make_llm,
                                                                       tmp_path):  # fmt: skip
    """Without sentence-transformers files, Jina BERT's ``emb_pooler: mean`` (what its own
    ``encode`` does) pools by the mean, normalized: the vectors its files give."""
    import shutil

    from infer.testing.encoders import build_jina

    folder = build_jina(encoder_root)
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("modules.json", "*_Pooling",
                                                                 "*_Normalize"))  # fmt: skip
    llm = make_llm(str(bare))
    assert llm.engine.pooler_config.pooling_type == "MEAN"
    assert "emb_pooler" in llm.engine.pooler_config.source
    want = _vectors(make_llm(str(folder)).embed(TEXTS))  # (its files: MEAN, normalized)
    for a, b in zip(want, _vectors(llm.embed(TEXTS)), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_embedding_gemma_embeds_as_transformers(encoder_root, make_llm, tiny_checkpoints,
                                                monkeypatch, engine_device):  # fmt: skip
    """EmbeddingGemma (Gemma 3's layers, every token attending to its whole input, sliding
    layers to the keys at most ``sliding_window // 2`` away on either side; 4 query heads over
    2 kv heads): the mean of transformers' ``Gemma3TextModel`` hidden states in float32, inputs
    side by side, one by one beside a long one, and in bf16 through the C++ encoder kernel (64
    wide heads) within bf16's reach."""
    from transformers import AutoModel, AutoTokenizer

    from infer.runner.cpu.kernels import CpuKernels, cpu_kernels
    from infer.testing.encoders import build_embedding_gemma

    folder = build_embedding_gemma(encoder_root, tiny_checkpoints["gemma3"])
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    llm = make_llm(str(folder))
    assert llm.engine.spec.is_encoder and llm.engine.pooler_config.pooling_type == "MEAN"
    for texts in (TEXTS, [PROMPTS[5] * 2, "a", "b", "c"]):
        results = llm.embed(texts)
        for r, text in zip(results, texts, strict=True):
            assert r.prompt_token_ids == tok(text)["input_ids"]  # (its tokenizer's encoding)
            with torch.no_grad():
                ids = torch.tensor([r.prompt_token_ids])
                want = model(input_ids=ids).last_hidden_state[0].mean(0)
            torch.testing.assert_close(torch.tensor(r.outputs.embedding), want, atol=1e-5,
                                       rtol=1e-5)  # fmt: skip
    kernels = cpu_kernels() if engine_device == "cpu" else None  # (the C++ encoder kernel)
    if kernels is None or not kernels.has_prefill_attention:
        return
    wide = build_embedding_gemma(encoder_root, tiny_checkpoints["gemma3"],
                                 name="embedding-gemma-d64", head_dim=64,
                                 query_pre_attn_scalar=64)  # fmt: skip
    exact = _vectors(make_llm(str(wide)).embed(TEXTS))
    calls = []
    original = CpuKernels.encoder_attention
    monkeypatch.setattr(CpuKernels, "encoder_attention",
                        lambda self, *a: calls.append(1) or original(self, *a))  # fmt: skip
    got = _vectors(make_llm(str(wide), dtype="bfloat16").embed(TEXTS))
    assert calls and len(calls) % 3 == 0  # (every layer)
    for a, b in zip(exact, got, strict=True):
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999

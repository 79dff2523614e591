"""Embeddings offline (``LLM.embed``) and through the engine beside generation: each prompt's
vector is transformers' base-model hidden state at its last token on every architecture, the
same whether the prompt ran whole, in chunks, or partly from the prefix cache; generation
beside it is unchanged; the model's sentence-transformers files decide the pooling and the
normalization, ``pooler_config`` over them; every KV block comes back (``make_llm``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer import SamplingParams
from infer.core.pooling_params import PoolingParams
from infer.core.sampling_params import InvalidRequestError
from infer.model.pooling import write_pooling_files

from .conftest import GEN_TOKENS, PROMPTS

LONG = PROMPTS[5]  # ~40 tokens


def _hf_hidden(path, prompts: list[str]) -> list[torch.Tensor]:
    """transformers' base model: the last hidden state at each prompt's last token."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            out.append(model(torch.tensor([tok.encode(p)])).last_hidden_state[0, -1])
    return out


def _vectors(results) -> list[torch.Tensor]:
    return [torch.tensor(r.outputs.embedding) for r in results]


def test_embeddings_are_transformers_last_hidden_state(checkpoint_kind, tiny_checkpoint, make_llm):
    prompts = [PROMPTS[0], PROMPTS[4], LONG]
    llm = make_llm(checkpoint_kind)
    results = llm.embed(prompts)
    raw = llm.embed(prompts, PoolingParams(normalize=False))
    for r, got, unnormalized, want in zip(results, _vectors(results), _vectors(raw),
                                          _hf_hidden(tiny_checkpoint, prompts), strict=True):  # fmt: skip
        assert r.prompt_token_ids == llm.tokenizer.encode(r.prompt)
        torch.testing.assert_close(unnormalized, want, atol=2e-4, rtol=1e-4)
        # normalized by default (no sentence-transformers files: vLLM's default too)
        torch.testing.assert_close(got, torch.nn.functional.normalize(want, dim=0), atol=2e-5,
                                   rtol=1e-4)  # fmt: skip


def test_chunked_cached_and_whole_prompts_give_the_same_vector(make_llm):
    whole = _vectors(make_llm("qwen3").embed([LONG, PROMPTS[2]]))
    llm = make_llm("qwen3", block_size=4, enable_prefix_caching=True, max_num_batched_tokens=8)
    first = llm.embed([LONG, PROMPTS[2]])
    again = llm.embed(LONG)[0]
    assert first[0].num_cached_tokens == 0 and again.num_cached_tokens >= 32
    for got, want in zip(_vectors([*first, again]), [*whole, whole[0]], strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # dimensions: the first d values of the unnormalized state, normalized after the cut
    cut = llm.embed(LONG, PoolingParams(dimensions=5))[0].outputs.embedding
    raw = llm.embed(LONG, PoolingParams(normalize=False))[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(cut),
                               torch.nn.functional.normalize(torch.tensor(raw[:5]), dim=0))  # fmt: skip


@pytest.mark.parametrize("spec", [None, "ngram", "draft"])
def test_embeddings_join_running_decodes_without_changing_their_tokens(
    spec, make_llm, hf_greedy, tiny_checkpoints
):
    """Embedding requests (a one-token input among them: a row shaped like a decode) admitted
    while four prompts decode, with and without speculative decoding: the decodes' tokens are
    still transformers' greedy ones, the vectors the ones the prompts get alone, and the
    requests end with no output tokens."""
    options: dict = {"max_num_seqs": 8}
    if spec == "ngram":
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 3, "prompt_lookup_min": 1}  # fmt: skip
    elif spec == "draft":
        options["speculative_config"] = {"model": str(tiny_checkpoints["llama"]),
                                         "num_speculative_tokens": 3}  # fmt: skip
    llm = make_llm("llama", **options)
    alone = _vectors(llm.embed([LONG, [5], PROMPTS[1]]))
    engine = llm.engine
    params = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"g{i}", llm.tokenizer.encode(PROMPTS[i], add_special_tokens=False),
                           params)  # fmt: skip
    tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(4)}
    finals = {}
    for step in range(200):
        if step == 3:
            for j, ids in enumerate([llm.tokenizer.encode(LONG), [5],
                                     llm.tokenizer.encode(PROMPTS[1])]):  # fmt: skip
                engine.add_request(f"e{j}", ids, PoolingParams())
        for out in engine.step():
            if out.request_id in tokens:
                tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert [tokens[f"g{i}"] for i in range(4)] == hf_greedy("llama")[:4]
    for j, want in enumerate(alone):
        out = finals[f"e{j}"]
        assert out.finish_reason == "stop" and out.num_output_tokens == 0
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-4)


def _with_sentence_transformers(src, dst, pooling_type: str, normalize: bool):
    shutil.copytree(src, dst)
    write_pooling_files(dst, pooling_type, normalize)
    return dst


def test_the_models_pooling_files_decide_and_pooler_config_overrides(tiny_checkpoints, tmp_path):
    from infer import LLM

    opts = dict(dtype="float32", device="cpu", max_num_seqs=4)
    raw_folder = _with_sentence_transformers(tiny_checkpoints["qwen3"], tmp_path / "raw",
                                             "LAST", normalize=False)  # fmt: skip
    want = _hf_hidden(raw_folder, [PROMPTS[0]])[0]
    llm = LLM(str(raw_folder), **opts)
    got = torch.tensor(llm.embed(PROMPTS[0])[0].outputs.embedding)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)  # no Normalize module: raw
    llm = LLM(str(raw_folder), pooler_config='{"normalize": true}', **opts)
    got = torch.tensor(llm.embed(PROMPTS[0])[0].outputs.embedding)
    assert got.norm().item() == pytest.approx(1.0, abs=1e-5)

    cls_folder = _with_sentence_transformers(tiny_checkpoints["qwen3"], tmp_path / "cls",
                                             "CLS", normalize=True)  # fmt: skip
    llm = LLM(str(cls_folder), **opts)
    with pytest.raises(InvalidRequestError, match="pools by CLS") as e:
        llm.embed(PROMPTS[0])
    assert e.value.param == "input"
    assert llm.generate(PROMPTS[0])[0].outputs[0].token_ids  # it still generates
    llm = LLM(str(cls_folder), pooler_config={"pooling_type": "last"}, **opts)
    got = torch.tensor(llm.embed(PROMPTS[0])[0].outputs.embedding)
    torch.testing.assert_close(got, torch.nn.functional.normalize(want, dim=0), atol=2e-5,
                               rtol=1e-4)  # fmt: skip
    with pytest.raises(ValueError, match="pooling_type 'CLS' is not supported"):
        LLM(str(cls_folder), pooler_config='{"pooling_type": "CLS"}', **opts)
    with pytest.raises(ValueError, match="unknown field"):
        LLM(str(cls_folder), pooler_config='{"pooling": "LAST"}', **opts)


def test_a_mean_pooling_decoder_embeds_the_mean_of_its_prompts_states(tiny_checkpoints,
                                                                     make_llm, tmp_path):  # fmt: skip
    """A decoder whose sentence-transformers files pool by the mean (stella's, KaLM's): each
    vector is the mean of transformers' last hidden states over the whole prompt, whether the
    prompt ran whole or in chunks of 8 tokens over several steps, beside other requests and
    again; prefix caching is off for it (a cached prefix computes no states)."""
    from transformers import AutoModel, AutoTokenizer

    folder = _with_sentence_transformers(tiny_checkpoints["qwen3"], tmp_path / "mean", "MEAN",
                                         normalize=False)  # fmt: skip
    prompts = [LONG, PROMPTS[0], "a", LONG + " " + PROMPTS[3]]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [model(torch.tensor([tok.encode(p)])).last_hidden_state[0].mean(0)
                for p in prompts]  # fmt: skip
    for options in ({}, {"max_num_batched_tokens": 8, "block_size": 4}):
        llm = make_llm(str(folder), enable_prefix_caching=True, **options)
        assert not llm.engine.config.cache.enable_prefix_caching
        assert "mean of every prompt token" in llm.engine.config.prefix_caching_off_reason
        for _ in range(2):  # (again: nothing carried over)
            for got, w in zip(_vectors(llm.embed(prompts)), want, strict=True):
                torch.testing.assert_close(got, w, atol=2e-4, rtol=1e-4)
        assert not llm.engine.runner._mean_sums


def test_bad_embedding_requests_are_refused_naming_the_field(make_llm):
    llm = make_llm("llama")
    with pytest.raises(InvalidRequestError) as e:
        llm.embed("hi", PoolingParams(dimensions=10_000))
    assert e.value.param == "dimensions"
    with pytest.raises(InvalidRequestError) as e:
        PoolingParams(dimensions=0)
    assert e.value.param == "dimensions"
    with pytest.raises(InvalidRequestError) as e:
        llm.embed([1] * (llm.engine.max_model_len + 1))
    assert e.value.param == "input" and "context length" in str(e.value)
    # a prompt of exactly the context length: embedded (no room for a token is needed)
    assert len(llm.embed([1] * llm.engine.max_model_len)[0].outputs.embedding) == 64


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("mean+max", "pools by MEAN + MAX"),
        ("no pooling config", "missing the sentence-transformers pooling config"),
        ("dense after normalize", "its Dense modules are not between its Pooling and Normalize"),
        ("dense without files", "a sentence-transformers Dense config"),
        ("unreadable", "modules.json cannot be read"),
    ],
)
def test_files_infer_cannot_follow_refuse_embeddings_but_not_generation(
    case, says, tiny_checkpoints, tmp_path
):
    """A model whose sentence-transformers files ask for what infer does not do still loads and
    generates; its embedding requests are refused naming why, and ``pooler_config``'s
    ``pooling_type`` serves them with the last token (the files set aside)."""
    from infer import LLM

    folder = _with_sentence_transformers(tiny_checkpoints["qwen3"], tmp_path / "m", "LAST",
                                         normalize=True)  # fmt: skip
    if case == "mean+max":
        (folder / "1_Pooling" / "config.json").write_text(
            json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True})
        )
    elif case == "no pooling config":
        (folder / "1_Pooling" / "config.json").unlink()
    elif case.startswith("dense"):
        modules = json.loads((folder / "modules.json").read_text())
        dense = {"idx": 3, "name": "3", "path": "3_Dense",
                 "type": "sentence_transformers.models.Dense"}  # fmt: skip
        modules.insert(len(modules) if case == "dense after normalize" else 2, dense)
        (folder / "modules.json").write_text(json.dumps(modules))
    else:
        (folder / "modules.json").write_text("{not json")
    opts = dict(dtype="float32", device="cpu", max_num_seqs=4)
    llm = LLM(str(folder), **opts)
    assert llm.generate(PROMPTS[0])[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="pooling_type") as e:
        llm.embed(PROMPTS[0])
    assert says in str(e.value) and e.value.param == "input"
    llm = LLM(str(folder), pooler_config={"pooling_type": "LAST"}, **opts)
    assert len(llm.embed(PROMPTS[0])[0].outputs.embedding) == 64


def test_an_input_the_kv_cache_cannot_hold_is_refused_naming_the_input(tiny_checkpoints):
    from infer import LLM

    llm = LLM(str(tiny_checkpoints["qwen3"]), dtype="float32", num_kv_blocks=4, block_size=4)
    with pytest.raises(InvalidRequestError, match=r"input \(17 tokens\) is more than the KV "
                       r"cache can ever hold \(16 tokens") as e:  # fmt: skip
        llm.embed([[5] * 17])
    assert e.value.param == "input"
    assert len(llm.embed([[5] * 16])[0].outputs.embedding) == 64  # exactly what it holds


def test_score_is_the_cosine_of_the_embeddings(make_llm):
    llm = make_llm("qwen3")
    texts = [PROMPTS[0], PROMPTS[1], LONG]
    unit = [torch.nn.functional.normalize(v, dim=0) for v in _vectors(llm.embed(texts))]
    one_to_many = llm.score(texts[0], texts)
    assert [r.text_2 for r in one_to_many] == texts
    assert [r.outputs.score for r in one_to_many] == pytest.approx(
        [float(unit[0] @ u) for u in unit], abs=1e-5
    )
    assert one_to_many[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    pairwise = llm.score(texts[:2], texts[1:])
    assert [r.outputs.score for r in pairwise] == pytest.approx(
        [float(unit[0] @ unit[1]), float(unit[1] @ unit[2])], abs=1e-5
    )
    with pytest.raises(InvalidRequestError) as e:
        llm.score(texts, texts[:2])
    assert e.value.param == "text_2"
    with pytest.raises(InvalidRequestError) as e:  # named as the call gave it
        llm.score(texts[0], [texts[0], "", texts[1]])
    assert e.value.param == "text_2[1]"

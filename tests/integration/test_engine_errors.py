"""Bad input gets a clear error naming the problem, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from infer import LLM, InvalidRequestError, SamplingParams

from .conftest import PROMPTS

OK = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_empty_prompt(make_llm):
    llm = make_llm("llama")
    with pytest.raises(InvalidRequestError, match="empty") as e:
        llm.generate([""], OK)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], OK)
    assert len(llm.generate(PROMPTS[0], OK)[0].outputs[0].token_ids) == 4


def test_prompt_longer_than_context_states_both_lengths(make_llm):
    llm = make_llm("llama", max_model_len=64)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[5] * 100], OK)
    assert "100" in e.value.message and "64" in e.value.message


def test_bad_batch_leaves_no_request_or_block_behind(make_llm):
    llm = make_llm("llama", max_model_len=64)
    with pytest.raises(InvalidRequestError):
        llm.generate([PROMPTS[0], [5] * 100, PROMPTS[1]], OK)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(PROMPTS[:2], OK)) == 2


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(logprobs=50), "logprobs"),
        (dict(min_tokens=9, max_tokens=3), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(presence_penalty=5), "presence_penalty"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param.split("_")[0] in e.value.message


def test_token_id_outside_vocab(make_llm):
    llm = make_llm("llama")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**9]], OK)


def test_request_that_can_never_fit_the_pool_is_rejected_at_admission(make_llm):
    llm = make_llm("llama", num_kv_blocks=4, block_size=4)
    with pytest.raises(InvalidRequestError, match="KV cache"):
        llm.generate(PROMPTS[5], SamplingParams(max_tokens=64))


def test_the_default_cache_holds_a_full_length_sequence_whatever_the_block_size(make_llm):
    """Sized for every slot at full length in whole blocks: with 7-token blocks (which do not
    divide the 1,024-token context) one slot's cache was a block short of the context."""
    llm = make_llm("llama", max_num_seqs=1, block_size=7)
    assert llm.engine.capacity.num_tokens >= llm.engine.max_model_len == 1024
    out = llm.generate([[5] * 1000], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 24


def test_without_max_tokens_a_request_runs_up_to_what_the_kv_cache_holds(make_llm):
    """A KV cache smaller than the context: an unset max_tokens (a chat request's default)
    means up to what the cache can hold, not a refusal; a prompt that fills it is refused.
    The last output token's KV is never written, so 12 prompt tokens in a 40-token cache leave
    room for 29 output tokens (28 were allowed)."""
    llm = make_llm("llama", num_kv_blocks=10, block_size=4)  # 40 tokens, a 1,024-token context
    assert llm.engine.max_model_len > 40
    prompt = list(range(5, 17))
    out = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 29
    full = llm.generate([prompt], SamplingParams(max_tokens=29, temperature=0, ignore_eos=True))[0]
    assert full.outputs[0].token_ids == out.outputs[0].token_ids
    one = llm.generate([list(range(5, 45))], SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(one[0].outputs[0].token_ids) == 1  # a 40-token prompt: its one token fits
    with pytest.raises(InvalidRequestError, match="no room for an output token") as e:
        llm.generate([list(range(5, 46))], SamplingParams(max_tokens=None))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="can ever hold") as e:  # asked for: refused
        llm.generate([prompt], SamplingParams(max_tokens=30))
    assert e.value.param == "max_tokens"


def test_a_prompt_past_the_context_is_the_engines_refusal_alone(make_llm, capfd):
    """The engine refuses it naming both lengths; the tokenizer's model_max_length (2,048 in
    these checkpoints, whatever the model's context) adds no warning of transformers' own."""
    llm = make_llm("llama")
    with pytest.raises(InvalidRequestError, match="context length is 1024"):
        llm.generate(["word " * 3000], OK)
    assert "Token indices sequence length" not in capfd.readouterr().err


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_is_named(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints["llama"], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    cfg["model_type"] = "mystery"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="MysteryForCausalLM"):
        LLM(str(path))


def test_missing_weights_are_named(tiny_checkpoints, tmp_path):
    path = _copy(tiny_checkpoints["llama"], tmp_path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(Exception, match="safetensors"):
        LLM(str(path))


def test_missing_model_folder_is_named(tmp_path):
    with pytest.raises(Exception, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_a_missing_draft_model_or_tokenizer_folder_is_named(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    draft = {"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 2}
    with pytest.raises(Exception, match="the draft model of --speculative-config: .*/no/such"):
        LLM(path, speculative_config=draft)
    with pytest.raises(Exception, match="tokenizer folder /no/such/tokenizer does not exist"):
        LLM(path, tokenizer="/no/such/tokenizer")

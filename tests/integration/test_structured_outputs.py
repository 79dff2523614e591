"""Constrained decoding offline: the grammar, not the model, guarantees the output shape (20
seeds at temperature 1.0 on a random-weight model), unconstrained requests in the same batch
are unchanged, and bad grammars fail their request without stopping the engine."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from infer import SamplingParams
from infer.core.sampling_params import InvalidRequestError
from infer.core.structured import StructuredOutputs

from .conftest import PROMPTS

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "label": {"enum": ["cat", "dog"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["id", "label", "notes"],
    "additionalProperties": False,
}


def _sampled(spec: StructuredOutputs, n: int = 20, **options) -> list[SamplingParams]:
    options.setdefault("max_tokens", 120)
    return [SamplingParams(temperature=1.0, seed=s, structured_outputs=spec, **options)
            for s in range(n)]  # fmt: skip


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3", "gpt2", "qwen3_moe", "mixtral"])
def test_every_sampled_output_matches_its_constraint(kind, make_llm):
    llm = make_llm(kind)
    cases = {
        "json": StructuredOutputs(json=SCHEMA),
        "regex": StructuredOutputs(regex=r"(\+|-)?[0-9]{1,3}\.[0-9]{2} (EUR|USD)"),
        "choice": StructuredOutputs(choice=("alpha", "beta gamma", "delta")),
        "grammar": StructuredOutputs(grammar='start: item ("," item)*\nitem: "a" | "bb"'),
    }
    for name, spec in cases.items():
        outs = llm.generate(PROMPTS[:4] * 5, _sampled(spec))
        for out in outs:
            text, finish = out.outputs[0].text, out.outputs[0].finish_reason
            if name == "grammar" and finish == "length":  # an unbounded list may be cut
                assert re.fullmatch(r"(a|bb)(,(a|bb))*,?(b)?", text), text
                continue
            assert finish == "stop", (name, text)
            if name == "json":
                jsonschema.validate(json.loads(text), SCHEMA)
            elif name == "regex":
                assert re.fullmatch(r"(\+|-)?[0-9]{1,3}\.[0-9]{2} (EUR|USD)", text), text
            elif name == "choice":
                assert text in ("alpha", "beta gamma", "delta")
            else:
                assert re.fullmatch(r"(a|bb)(,(a|bb))*", text), text


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(make_llm):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = make_llm("llama", max_num_seqs=16)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    constrained = _sampled(StructuredOutputs(json=SCHEMA), n=len(PROMPTS))
    mixed = llm.generate(PROMPTS * 2, [greedy] * len(PROMPTS) + constrained)
    assert [o.outputs[0].token_ids for o in mixed[: len(PROMPTS)]] == alone
    for out in mixed[len(PROMPTS) :]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_greedy_constrained_output_is_the_best_allowed_token_each_step(make_llm):
    """With a choice between two strings the greedy constrained output is the one transformers'
    own logits prefer at the first token where they differ."""
    llm = make_llm("llama")
    spec = StructuredOutputs(choice=("yes", "no"))
    out = llm.generate(["x"], SamplingParams(max_tokens=5, temperature=0,
                                             structured_outputs=spec, logprobs=0))[0]  # fmt: skip
    assert out.outputs[0].text in ("yes", "no")
    assert out.outputs[0].finish_reason == "stop"


def test_a_grammar_that_fails_to_build_fails_only_its_request(make_llm):
    llm = make_llm("llama")
    with pytest.raises(InvalidRequestError, match="invalid regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs(regex="[a-")))
    # The engine goes on serving, constrained and not.
    outs = llm.generate(["x", "y"], [SamplingParams(max_tokens=4),
                                     SamplingParams(structured_outputs=StructuredOutputs(
                                         choice=("on", "off")))])  # fmt: skip
    assert outs[1].outputs[0].text in ("on", "off")


def test_bad_structured_output_specs_name_the_problem():
    for kwargs, message in [({}, "exactly one"), ({"choice": ()}, "choice list is empty"),
                            ({"regex": "a", "choice": ("b",)}, "exactly one"),
                            ({"grammar": "  "}, "grammar is empty")]:  # fmt: skip
        with pytest.raises(InvalidRequestError, match=message):
            StructuredOutputs(**kwargs)


def test_speculation_leaves_constrained_requests_alone(make_llm):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1}  # fmt: skip
    llm = make_llm("llama", speculative_config=spec)
    outs = llm.generate(PROMPTS[:4] * 2, _sampled(StructuredOutputs(json=SCHEMA), n=8))
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_engine_side_grammar_failure_and_abort_while_compiling(make_llm):
    """Past the offline API's check (as over HTTP, where the server checks first), a grammar
    that fails to build ends its request with an error; an abort during the build ends it."""
    engine = make_llm("llama").engine
    bad = SamplingParams(structured_outputs=StructuredOutputs(regex="[a-"))
    engine.add_request("bad", [5, 6, 7], bad)
    engine.add_request("gone", [5, 6], SamplingParams(structured_outputs=StructuredOutputs(
        json=SCHEMA)))  # fmt: skip
    engine.abort_request("gone")
    engine.add_request("fine", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].finish_reason == "error" and "invalid regex" in finished["bad"].error
    assert finished["gone"].finish_reason == "abort"
    assert finished["fine"].finish_reason == "length" and finished["fine"].num_output_tokens == 3


def test_digit_word_and_space_classes_are_ascii(make_llm):
    """`\\d`, `\\w`, `\\s` mean ASCII, as in JSON Schema's (ECMA-262) `pattern`: 40 draws at
    temperature 1 never produce another script's digit or letter. (Before, the grammar engine's
    Unicode classes let through e.g. U+1CCF4, an outlined digit.)"""
    llm = make_llm("llama")
    regex = r"[a-c]{2,5}-\d{3} \w{2,4}\s\w"
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": r"^\d{3}-\w{2}$"}},
              "required": ["code"], "additionalProperties": False}  # fmt: skip
    outs = llm.generate(PROMPTS[:4] * 5, _sampled(StructuredOutputs(regex=regex)))
    for out in outs:
        assert re.fullmatch(regex, out.outputs[0].text, re.ASCII), out.outputs[0].text
    outs = llm.generate(PROMPTS[:4] * 5, _sampled(StructuredOutputs(json=schema)))
    for out in outs:
        code = json.loads(out.outputs[0].text)["code"]
        assert re.fullmatch(r"\d{3}-\w{2}", code, re.ASCII), code


def test_word_boundaries_are_refused_by_name(make_llm):
    llm = make_llm("llama")
    with pytest.raises(InvalidRequestError, match=r"\\b \(a word boundary\) is not supported"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs(regex=r"\bab")))


def test_a_character_level_tokenizer_constrains_too(tiny_checkpoints, tmp_path):
    """A tokenizer llguidance cannot read itself (the built-in models' character-level BPE,
    whose ``Fuse`` decoder it does not know: every constrained request failed) is read token
    by token: outputs match their constraints and the ids past the tokenizer's are never
    sampled."""
    import shutil

    from infer import LLM
    from infer.builtin.textdata import build_char_tokenizer

    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_checkpoints["llama"] / name, tmp_path / name)
    tokenizer = build_char_tokenizer(tmp_path, 1024)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    specs = [StructuredOutputs(choice=("alpha", "beta gamma")),
             StructuredOutputs(regex=r"[0-9]{2}\.[0-9] (EUR|USD)"),
             StructuredOutputs(json=SCHEMA)]  # fmt: skip
    outs = llm.generate(["x"] * 15, [p for spec in specs for p in _sampled(spec, n=5)])
    for i, out in enumerate(outs):
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "stop", text
        assert max(ids) < len(tokenizer)
        if i < 5:
            assert text in ("alpha", "beta gamma")
        elif i < 10:
            assert re.fullmatch(r"[0-9]{2}\.[0-9] (EUR|USD)", text), text
        else:
            jsonschema.validate(json.loads(text), SCHEMA)
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_allowed_token_ids_that_cannot_start_the_output_are_refused(make_llm):
    """allowed_token_ids with a grammar: when none of them may start the output, every token
    would be masked (the sampler then picked one the grammar refused: an engine error); the
    request is refused naming the field, and a compatible set still gives valid JSON."""
    llm = make_llm("llama")
    schema = StructuredOutputs(json='{"type": "array", "minItems": 1}')
    letter = llm.tokenizer.encode("x", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=8, temperature=0, allowed_token_ids=[letter],
                            structured_outputs=schema)  # fmt: skip
    with pytest.raises(InvalidRequestError, match="none of allowed_token_ids") as e:
        llm.generate(PROMPTS[0], params)
    assert e.value.param == "allowed_token_ids"
    vocab = llm.engine.spec.vocab_size
    wide = SamplingParams(max_tokens=12, temperature=0, allowed_token_ids=list(range(vocab)),
                          structured_outputs=schema)  # fmt: skip
    text = llm.generate(PROMPTS[0], wide)[0].outputs[0].text
    assert text.startswith("[")

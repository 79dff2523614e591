"""The offline API's contract beyond sampling: threads, interruptions, bad input, chat."""

from __future__ import annotations

import threading

import pytest

from infer import InvalidRequestError, SamplingParams

from .conftest import PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _texts(results) -> list[str]:
    return [r.outputs[0].text for r in results]


def _idle(llm) -> bool:
    kv = llm.engine.kv_manager
    return not llm.engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_total_blocks


def test_calls_from_two_threads_take_turns(make_llm):
    """Each thread gets its own prompts' outputs, as if alone (the calls take turns: stepping
    one engine from two threads at once hung, each dropping the other's outputs)."""
    llm = make_llm("llama", max_num_seqs=8)
    batches = [PROMPTS[:4], PROMPTS[4:8]]
    want = [_texts(llm.generate(b, GREEDY)) for b in batches]
    got: dict[int, list[str]] = {}
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait()
        got[i] = _texts(llm.generate(batches[i], GREEDY))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a generate call never returned"
    assert [got[0], got[1]] == want


def test_an_interrupted_call_leaves_nothing_behind(make_llm, monkeypatch):
    """Ctrl-C (a KeyboardInterrupt) in the middle of generate: it propagates, the call's
    requests are aborted and their blocks are back, and the next call runs as on a fresh
    engine (it used to finish the abandoned work first, silently)."""
    llm = make_llm("llama", max_num_seqs=8)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    real, calls = llm.engine.step, [0]

    def step():
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:6], long)
    assert _idle(llm)
    monkeypatch.setattr(llm.engine, "step", real)
    before = llm.engine.scheduler.counters.generation_tokens
    assert _texts(llm.generate(PROMPTS[:2], GREEDY)) == [
        r.outputs[0].text for r in (llm.generate([p], GREEDY)[0] for p in PROMPTS[:2])
    ]
    assert llm.engine.scheduler.counters.generation_tokens - before == 4 * 12  # no leftovers


@pytest.mark.parametrize(
    ("prompts", "kwargs", "error", "message"),
    [
        (["a b", 5], {}, InvalidRequestError, "prompts[1]"),
        (["a b", None], {}, InvalidRequestError, "a string or a list of token ids"),
        ([[1, 2], [3, "x"]], {}, InvalidRequestError, "prompts[1]"),
        (["a b", "c d"], {"priority": [1]}, ValueError, "1 priorities for 2 prompts"),
        (["a b", "c d"], {"sampling_params": [GREEDY]}, ValueError, "1 sampling params"),
    ],
)
def test_bad_calls_are_named_and_leave_nothing_behind(make_llm, prompts, kwargs, error, message):
    llm = make_llm("llama")
    with pytest.raises(error) as e:
        llm.generate(prompts, **{"sampling_params": GREEDY, **kwargs})
    assert message in str(e.value) or message == getattr(e.value, "param", None)
    assert _idle(llm)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"seed": "abc"}, "seed"),
        ({"n": "2"}, "n"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": "0"}, "temperature"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_sampling_params_of_the_wrong_type_are_named(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in e.value.message


def test_chat_renders_the_template_one_conversation_or_many(make_llm):
    llm = make_llm("llama")
    conversations = [
        [{"role": "user", "content": "What is a list?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
    ]
    tok = llm.tokenizer
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
             for c in conversations]  # fmt: skip
    want = [llm.generate([tok.encode(t, add_special_tokens=False)], GREEDY)[0] for t in texts]
    one = llm.chat(conversations[0], GREEDY)
    assert one.prompt_token_ids == want[0].prompt_token_ids
    assert one.outputs[0].text == want[0].outputs[0].text
    many = llm.chat(conversations, GREEDY)
    assert [r.prompt_token_ids for r in many] == [w.prompt_token_ids for w in want]
    assert _texts(many) == _texts(want)


def test_chat_messages_the_template_cannot_render_are_named(make_llm):
    llm = make_llm("llama")
    with pytest.raises(InvalidRequestError, match="could not render") as e:
        llm.chat([{"role": "user"}], GREEDY)  # no content
    assert e.value.param == "messages"
    assert _idle(llm)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_num_seqs": "4"}, "engine option max_num_seqs must be an integer, got '4'"),
        ({"block_size": 7.5}, "engine option block_size must be an integer, got 7.5"),
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a number"),
        ({"swap_space": -1}, "swap_space must be >= 0 bytes, got -1"),
        ({"no_such_option": 1}, "unknown engine option 'no_such_option'"),
    ],
)
def test_engine_options_of_the_wrong_type_or_value_are_named(tiny_checkpoints, options, message):
    from infer import LLM

    with pytest.raises((TypeError, ValueError), match=message):
        LLM(str(tiny_checkpoints["llama"]), **options)


def test_chat_takes_vllms_options_and_renders_as_the_server_does(make_llm):
    """``LLM.chat`` takes vLLM's options (add_generation_prompt, continue_final_message,
    chat_template_kwargs, a template of its own; they were refused or, for the kwargs, passed
    on as one variable), and content parts become text (a Python list was written into the
    prompt)."""
    from infer.model.chat_template import render_chat_ids

    llm = make_llm("llama")
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello"}]  # fmt: skip
    out = llm.chat(messages, GREEDY, add_generation_prompt=False, continue_final_message=True)
    want = render_chat_ids(llm.tokenizer, messages, add_generation_prompt=False,
                           continue_final_message=True)  # fmt: skip
    assert out.prompt_token_ids == want
    text = llm.tokenizer.decode(want)
    assert "Hi" in text and "'type'" not in text and text.endswith("Hello")
    flavoured = llm.chat(messages[:1], GREEDY, chat_template="{{ flavour }}:{{ messages[0]['content'] }}",
                         chat_template_kwargs={"flavour": "mint"})  # fmt: skip
    assert llm.tokenizer.decode(flavoured.prompt_token_ids) == "mint:Hi"
    assert _idle(llm)


def test_unset_sampling_fields_take_the_models_generation_config(
    tiny_checkpoints, tmp_path, engine_device
):
    """As vLLM: ``generate`` with no SamplingParams samples as the model's
    generation_config.json recommends (top_k 1 is greedy; max_new_tokens is max_tokens);
    ``generation_config="none"`` keeps infer's own defaults."""
    import json
    import shutil

    from infer import LLM

    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    path = folder / "generation_config.json"
    recommended = {"top_k": 1, "temperature": 0.7, "max_new_tokens": 5, "do_sample": True}
    path.write_text(json.dumps({**json.loads(path.read_text()), **recommended}))
    with LLM(str(folder), dtype="float32", device=engine_device) as llm:
        # (max_tokens None: the engine gives each prompt the model's 5, or what fits)
        assert llm.get_default_sampling_params() == SamplingParams(
            top_k=1, temperature=0.7, max_tokens=None
        )
        got = llm.generate(PROMPTS[:3])
        want = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=5))
        assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in want]
        assert _idle(llm)
    # A length the KV cache cannot give every prompt: each gets what is left to it, not a
    # refusal naming a max_tokens nobody set (40-token cache, 100 recommended).
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_new_tokens": 100}))
    with LLM(str(folder), dtype="float32", device=engine_device, num_kv_blocks=10,
             block_size=4) as llm:  # fmt: skip
        short, long = [5, 6, 7], list(range(5, 35))
        outs = llm.generate([short, long], SamplingParams(max_tokens=None, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outs] == [38, 11]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with LLM(str(folder), dtype="float32", device=engine_device, generation_config="none") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()

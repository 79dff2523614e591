"""LoRA adapters in real engines: greedy tokens identical to transformers + PEFT for each adapter
(float32), a batch mixing adapters and the base model giving each request what it gets alone
(bf16, the C++ kernel), more adapters than slots, prefix caching keyed by adapter, and bad
adapters refused naming the problem. Every test's engines end idle with every KV block back
(the ``make_llm`` fixture checks)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from infer import InvalidRequestError, LoRARequest, SamplingParams
from infer.runner.lora.adapter import LoRAError
from infer.testing.lora import build_lora_adapter

from .conftest import PROMPTS

pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
KINDS = ["llama", "qwen2", "qwen3", "gemma3"]
# Ranks, targets and PEFT options that change how an adapter is read or scaled.
ADAPTERS = {
    "all8": dict(rank=8, seed=1),
    "qv4": dict(rank=4, seed=2, targets=("q_proj", "v_proj")),
    "mlp16_rslora": dict(rank=16, seed=3, targets=("gate_proj", "up_proj", "down_proj"),
                         use_rslora=True),
    "o2_pattern": dict(rank=2, seed=4, targets=("o_proj", "k_proj"), alpha=8.0,
                       alpha_pattern={"k_proj": 32.0}),
}  # fmt: skip


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


def adapter(tiny_checkpoints, root: Path, kind: str, name: str) -> LoRARequest:
    path = build_lora_adapter(tiny_checkpoints[kind], root / kind / name, **ADAPTERS[name])
    return LoRARequest(name, 0, str(path))


_HF: dict[tuple[str, str | None], list[list[int]]] = {}


def hf_greedy(tiny_checkpoints, kind: str, lora: LoRARequest | None) -> list[list[int]]:
    """transformers (+ PEFT) greedy continuations of the prompts, float32."""
    key = (kind, None if lora is None else lora.lora_path)
    if key not in _HF:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = tiny_checkpoints[kind]
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if lora is not None:
            model = PeftModel.from_pretrained(model, lora.lora_path)
        model.eval()
        model.generation_config.eos_token_id = None
        outs = []
        for prompt in PROMPTS[:6]:
            ids = tok.encode(prompt, add_special_tokens=False)
            with torch.no_grad():
                g = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens,
                                   do_sample=False, pad_token_id=tok.eos_token_id)  # fmt: skip
            outs.append(g[0, len(ids) :].tolist())
        _HF[key] = outs
    return _HF[key]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", KINDS)
def test_each_adapter_matches_transformers_and_peft(kind, make_llm, tiny_checkpoints,
                                                    adapter_root):  # fmt: skip
    loras = [adapter(tiny_checkpoints, adapter_root, kind, n) for n in ADAPTERS]
    # One batch: every prompt under every adapter and the base model, two slots for four
    # adapters (the scheduler runs at most two at a time), chunked prefill.
    llm = make_llm(kind, enable_lora=True, max_loras=2, max_cpu_loras=2, prefill_chunk_size=5,
                   block_size=4)  # fmt: skip
    prompts = PROMPTS[:6]
    choices: list[LoRARequest | None] = [None, *loras]
    outs = llm.generate([p for _ in choices for p in prompts], GREEDY,
                        lora_request=[c for c in choices for _ in prompts])  # fmt: skip
    got = _tokens(outs)
    for i, lora in enumerate(choices):
        want = hf_greedy(tiny_checkpoints, kind, lora)
        assert got[i * 6 : (i + 1) * 6] == want, f"{kind} / {lora and lora.lora_name}"
    assert llm.engine.lora.num_loads >= 4  # slots were reused


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_a_mixed_batch_gives_each_request_what_it_gets_alone(make_llm, tiny_checkpoints,
                                                             adapter_root, quantization):  # fmt: skip
    """bf16 on the C++ kernel where it builds: rows of 4 adapters and the base model in one
    step, each row's tokens exactly those of the same request run alone; also over int8 and
    4-bit base weights (the adapters wrap whatever kernel the weights got)."""
    loras = [adapter(tiny_checkpoints, adapter_root, "llama", n) for n in ADAPTERS]
    choices: list[LoRARequest | None] = [None, *loras]
    llm = make_llm("llama", dtype="bfloat16", enable_lora=True, max_loras=4,
                   quantization=quantization)  # fmt: skip
    prompts = PROMPTS[:5]
    mixed_prompts = [prompts[i % 5] for i in range(10)]
    mixed_loras = [choices[i % 5] for i in range(10)]
    mixed = _tokens(llm.generate(mixed_prompts, GREEDY, lora_request=mixed_loras))
    for prompt, lora, tokens in zip(mixed_prompts, mixed_loras, mixed, strict=True):
        alone = _tokens(llm.generate([prompt], GREEDY, lora_request=lora))[0]
        assert tokens == alone, lora and lora.lora_name
    # The adapters do change the output.
    assert len({tuple(t) for t in mixed[:5]}) == 5


def test_fast_path_equals_module_path_with_adapters(make_llm, tiny_checkpoints, adapter_root,
                                                    monkeypatch):  # fmt: skip
    """The fused decode loop applies the same updates as the modules, bit for bit (logprobs
    too), in all-decode steps and in steps with prefill chunks."""
    loras = [adapter(tiny_checkpoints, adapter_root, "llama", n) for n in ADAPTERS]
    choices: list[LoRARequest | None] = [None, *loras]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [PROMPTS[i % 6] for i in range(10)]
    picks = [choices[i % 5] for i in range(10)]
    options = dict(dtype="bfloat16", enable_lora=True, max_loras=4, prefill_chunk_size=6)
    fast = make_llm("llama", **options)
    if fast.engine.runner.fast_decoder is None:
        pytest.skip("no fused decode loop on this machine")
    got = fast.generate(prompts, params, lora_request=picks)
    monkeypatch.setenv("INFER_FAST_DECODE", "0")
    slow = make_llm("llama", **options)
    assert slow.engine.runner.fast_decoder is None
    want = slow.generate(prompts, params, lora_request=picks)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [lp.logprob for lp in g.outputs[0].logprobs] == [
            lp.logprob for lp in w.outputs[0].logprobs
        ]


def test_more_adapters_than_slots_all_complete(make_llm, tiny_checkpoints, adapter_root):
    loras = [adapter(tiny_checkpoints, adapter_root, "llama", n) for n in ADAPTERS]
    llm = make_llm("llama", enable_lora=True, max_loras=1, max_cpu_loras=1)
    outs = llm.generate(PROMPTS[:6] * 4, GREEDY, lora_request=[loras[i % 4] for i in range(24)])
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_checkpoints, "llama", loras[i % 4])[i % 6]


def test_prefix_cache_never_shares_kv_between_adapters(make_llm, tiny_checkpoints,
                                                       adapter_root):  # fmt: skip
    a, b = (adapter(tiny_checkpoints, adapter_root, "llama", n) for n in ("all8", "qv4"))
    llm = make_llm("llama", enable_lora=True, max_loras=2, block_size=4)
    prompt = PROMPTS[5]  # long: several full blocks
    first = llm.generate([prompt], GREEDY, lora_request=a)[0]
    assert first.num_cached_tokens == 0
    other = llm.generate([prompt], GREEDY, lora_request=b)[0]
    assert other.num_cached_tokens == 0  # the same tokens under another adapter: no hit
    base = llm.generate([prompt], GREEDY)[0]
    assert base.num_cached_tokens == 0
    again = llm.generate([prompt], GREEDY, lora_request=a)[0]
    assert again.num_cached_tokens > 0  # the same adapter: a hit, and the same tokens
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.lora.num_loads == 2  # two slots, two adapters: each copied in once
    assert other.outputs[0].token_ids == hf_greedy(tiny_checkpoints, "llama", b)[5]


def test_speculative_decoding_with_adapters(make_llm, tiny_checkpoints, adapter_root):
    a = adapter(tiny_checkpoints, adapter_root, "llama", "all8")
    llm = make_llm("llama", enable_lora=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    outs = llm.generate(PROMPTS[:6], GREEDY, lora_request=a)
    assert _tokens(outs) == hf_greedy(tiny_checkpoints, "llama", a)


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_adapters_are_refused_naming_the_problem(make_llm, tiny_checkpoints, adapter_root,
                                                     tmp_path):  # fmt: skip
    good = adapter(tiny_checkpoints, adapter_root, "llama", "all8")
    llm = make_llm("llama", enable_lora=True, max_lora_rank=8)

    def refused(path, match: str) -> None:
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate(["x"], GREEDY, lora_request=LoRARequest("bad", 0, str(path)))

    refused(tmp_path / "missing", "is not a folder")
    rank16 = build_lora_adapter(tiny_checkpoints["llama"], adapter_root / "llama" / "rank16",
                                rank=16, seed=5)  # fmt: skip
    refused(rank16, "rank 16 .* above --max-lora-rank 8")
    other = build_lora_adapter(tiny_checkpoints["qwen3"], adapter_root / "qwen3" / "for-qwen3",
                               rank=4, seed=6)  # fmt: skip
    refused(other, "another base model")  # qwen3's tiny model has other projection widths
    saved = _copy(good.lora_path, tmp_path / "modules_to_save")
    cfg = json.loads((saved / "adapter_config.json").read_text())
    cfg["modules_to_save"] = ["lm_head"]
    (saved / "adapter_config.json").write_text(json.dumps(cfg))
    refused(saved, "modules_to_save")
    dora = _copy(good.lora_path, tmp_path / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    refused(dora, "DoRA")
    broken = _copy(good.lora_path, tmp_path / "broken")
    (broken / "adapter_config.json").write_text('{"r": 8,')
    refused(broken, "LoRA adapter 'bad': .*adapter_config.json is not valid JSON")
    # The engine still serves, with and without the good adapter.
    assert llm.generate(["x"], GREEDY, lora_request=good)[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="'nope' is not loaded"):
        llm.engine.add_request("r", [1, 2, 3], GREEDY, lora_request="nope")


def test_lora_options_need_enable_lora_and_a_llama_family_model(make_llm, tiny_checkpoints,
                                                                adapter_root):  # fmt: skip
    a = adapter(tiny_checkpoints, adapter_root, "llama", "all8")
    with pytest.raises(ValueError, match="--max-loras needs --enable-lora"):
        make_llm("llama", max_loras=2)
    plain = make_llm("llama")
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        plain.generate(["x"], GREEDY, lora_request=a)
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported"):
        make_llm("gpt2", enable_lora=True)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_llm("mixtral", enable_lora=True)
    with pytest.raises(LoRAError, match="another base model"):
        other = build_lora_adapter(tiny_checkpoints["qwen3"], adapter_root / "qwen3" / "x2",
                                   rank=4, seed=7)  # fmt: skip
        make_llm("llama", enable_lora=True, lora_modules=[f"x={other}"])


def _run_all(engine) -> dict[str, tuple[list[int], object]]:
    """Step the engine until idle: each request's tokens and its last output."""
    tokens: dict[str, list[int]] = {}
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            last[out.request_id] = out
    return {rid: (tokens[rid], last[rid]) for rid in tokens}


def test_a_name_loaded_again_is_a_new_adapter(make_llm, tiny_checkpoints, adapter_root):
    """Unloaded and loaded again from another folder, a name runs the new weights: the prefix
    cache never gives the new load the old one's KV, and a request already running keeps the
    weights its name stood for when it arrived, to its last token (it switched mid-way)."""
    a, b = (adapter(tiny_checkpoints, adapter_root, "llama", n) for n in ("all8", "qv4"))
    llm = make_llm("llama", enable_lora=True, max_loras=2, block_size=4)
    engine = llm.engine
    prompt = PROMPTS[5]  # long: several full blocks
    engine.load_lora_adapter("swap", a.lora_path)
    assert llm.generate([prompt], GREEDY, lora_request="swap")[0].outputs[0].token_ids == (
        hf_greedy(tiny_checkpoints, "llama", a)[5])  # fmt: skip
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    engine.add_request("running", ids, long, lora_request="swap")
    for _ in range(3):
        engine.step()
    engine.unload_lora_adapter("swap")
    engine.load_lora_adapter("swap", b.lora_path)
    engine.add_request("again", ids, GREEDY, lora_request="swap")
    done = _run_all(engine)
    again, last = done["again"]
    assert last.num_cached_tokens == 0
    assert again == hf_greedy(tiny_checkpoints, "llama", b)[5]
    alone = make_llm("llama", enable_lora=True).generate([prompt], long, lora_request=a)[0]
    assert done["running"][0][-37:] == alone.outputs[0].token_ids[-37:]


def test_an_adapter_whose_folder_is_gone_fails_only_its_requests(make_llm, tiny_checkpoints,
                                                                 adapter_root, tmp_path):  # fmt: skip
    """An adapter evicted from host memory is read again when a request names it: a folder
    gone meanwhile is that request's error, named, before it joins a batch (it failed every
    request of the step it was read in); one in use is never evicted, so requests already
    running with it finish."""
    a, b, c = (adapter(tiny_checkpoints, adapter_root, "llama", n)
               for n in ("all8", "qv4", "mlp16_rslora"))  # fmt: skip
    gone = _copy(a.lora_path, tmp_path / "gone")
    held = _copy(b.lora_path, tmp_path / "held")
    llm = make_llm("llama", enable_lora=True, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    engine.load_lora_adapter("gone", str(gone))
    engine.load_lora_adapter("held", str(held))  # "gone" leaves host memory
    engine.add_request("held running", [5, 6, 7], GREEDY, lora_request="held")
    engine.add_request("base running", [5, 6, 7], GREEDY)
    first: dict[str, list[int]] = {}
    while "held running" not in first:  # (a step launched ahead returns its tokens a step later)
        for out in engine.step():
            first.setdefault(out.request_id, []).extend(out.new_token_ids)
    shutil.rmtree(gone)
    with pytest.raises(InvalidRequestError, match="LoRA adapter 'gone': .* is not a folder"):
        engine.add_request("gone", [5, 6, 7], GREEDY, lora_request="gone")
    engine.load_lora_adapter("c", c.lora_path)  # host memory is full; "held" is in use: kept
    engine.unload_lora_adapter("held")
    shutil.rmtree(held)  # (its running request reads nothing from disk again)
    done = _run_all(engine)
    assert set(done) == {"held running", "base running"}
    assert all(last.finish_reason == "length" for _, last in done.values())
    alone = llm.generate([[5, 6, 7]], GREEDY, lora_request=b)[0].outputs[0].token_ids
    assert first["held running"] + done["held running"][0] == alone


def test_beam_search_runs_with_the_adapter(make_llm, tiny_checkpoints, adapter_root):
    """``LLM.beam_search(..., lora_request=)`` (vLLM's): every round runs with the adapter; one
    beam is the adapter's greedy reply, not the base model's."""
    from infer import BeamSearchParams, SamplingParams

    a = adapter(tiny_checkpoints, adapter_root, "llama", "all8")
    llm = make_llm("llama", enable_lora=True)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = llm.generate([PROMPTS[1]], greedy, lora_request=a)[0].outputs[0].token_ids
    base = llm.generate([PROMPTS[1]], greedy)[0].outputs[0].token_ids
    params = BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True)
    (got,) = llm.beam_search([PROMPTS[1]], params, lora_request=a)
    assert got.sequences[0].token_ids == want != base

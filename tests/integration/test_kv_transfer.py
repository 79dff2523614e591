"""Prefill on one engine, decode on another: the prompt's KV blocks move between them
(``export_kv`` on the prefill side: the payload rides on the final output; ``kv_payload`` on the
decode side) and the tokens are exactly one engine's. The ``make_llm`` fixture checks, after each test,
that both engines are idle with every KV block back in the pool."""

from __future__ import annotations

import pickle

import pytest

from infer import SamplingParams

from .conftest import PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SYSTEM = "You are a careful assistant that answers questions about the Python language. "


def _run(engine, payloads: dict | None = None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.kv_payload is not None:
                assert out.finished
                assert payloads is not None
                payloads[out.request_id] = out.kv_payload
    return tokens


def _prefill(engine, prompts: list[list[int]]):
    """Prefill each prompt with ``export_kv``: the payloads of the final outputs (pickled and
    back, as they travel) and the first tokens; the blocks are free once the step is done."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, FIRST, export_kv=True)
    got: dict = {}
    firsts = _run(engine, got)
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks and not engine.scheduler.held
    payloads = [pickle.loads(pickle.dumps(got[f"p{i}"])) for i in range(len(prompts))]
    return payloads, [firsts[f"p{i}"] for i in range(len(prompts))]


def _decode(engine, prompts, payloads, params=GREEDY) -> list[list[int]]:
    for i, (ids, payload) in enumerate(zip(prompts, payloads, strict=True)):
        engine.add_request(f"d{i}", ids, params, kv_payload=payload)
    got = _run(engine)
    return [got[f"d{i}"] for i in range(len(prompts))]


def _ids(llm, texts: list[str]) -> list[list[int]]:
    return [llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=4, enable_prefix_caching=False),
        dict(block_size=4, enable_prefix_caching=True),
        dict(block_size=4, prefill_chunk_size=5, max_num_seqs=3, enable_prefix_caching=False),
        dict(block_size=8, enable_prefix_caching=True, prefill_chunk_size=7),
        dict(block_size=4, kv_cache_dtype="int8"),
        dict(block_size=4, kv_cache_dtype="fp8", enable_prefix_caching=True),
    ],
    ids=["plain", "prefix", "chunked", "prefix+chunked", "int8-kv", "fp8-kv+prefix"],
)
def test_prefill_here_decode_there_is_token_identical_to_one_engine(options, make_llm):
    one = make_llm("llama", **options)
    prompts = _ids(one, [SYSTEM + p for p in PROMPTS])
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    prefill, decode = make_llm("llama", **options), make_llm("llama", **options)
    payloads, firsts = _prefill(prefill.engine, prompts)
    assert [f[0] for f in firsts] == [w[0] for w in want]
    assert _decode(decode.engine, prompts, payloads) == want
    # Every prompt token but the last came with its payload (or, past the first prompt, from
    # the decode side's own prefix cache when it is on): the decode side computed one each.
    stats = decode.engine.get_stats()
    computed_elsewhere = stats.kv_transferred_tokens_total + stats.prefix_cache_hits_total
    assert computed_elsewhere == sum(len(p) - 1 for p in prompts)
    assert stats.kv_transferred_tokens_total >= len(prompts[0]) - 1
    assert all(p.num_tokens == len(ids) - 1 for p, ids in zip(payloads, prompts, strict=True))


def test_payload_fills_only_past_the_decode_sides_own_prefix_hit(make_llm):
    options = dict(block_size=4, enable_prefix_caching=True)
    one = make_llm("llama", **options)
    prompts = _ids(one, [SYSTEM + p for p in PROMPTS[:4]])
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    prefill, decode = make_llm("llama", **options), make_llm("llama", **options)
    decode.generate(prompts[:1], FIRST)  # the decode side now caches the shared system prompt
    payloads, _ = _prefill(prefill.engine, prompts)
    before = decode.engine.get_stats()
    assert _decode(decode.engine, prompts, payloads) == want
    after = decode.engine.get_stats()
    hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
    transferred = after.kv_transferred_tokens_total - before.kv_transferred_tokens_total
    assert hits > 0
    assert hits + transferred == sum(len(p) - 1 for p in prompts)


def test_a_payload_that_does_not_fit_is_set_aside_and_the_prompt_computed(make_llm):
    one = make_llm("llama", block_size=4)
    prompts = _ids(one, PROMPTS[:3])
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    prefill = make_llm("llama", block_size=4)
    payloads, _ = _prefill(prefill.engine, prompts)
    # Another prompt's payload; another block size; another cache dtype: all refused.
    other_block = make_llm("llama", block_size=8)
    other_dtype = make_llm("llama", block_size=4, kv_cache_dtype="int8")
    shuffled = [payloads[1], payloads[2], payloads[0]]
    for decode, given in ((one, shuffled), (other_block, payloads), (other_dtype, payloads)):
        got = _decode(decode.engine, prompts, given)
        assert decode.engine.get_stats().kv_transferred_tokens_total == 0
        if decode is not other_dtype:  # int8 KV rounds: tokens may differ from the fp32 cache
            assert got == want


def test_a_payload_comes_only_with_a_normal_finish(make_llm):
    llm = make_llm("llama", block_size=4, prefill_chunk_size=8)
    engine = llm.engine
    prompt = list(range(10, 60))
    engine.add_request("gone", prompt, FIRST, export_kv=True)
    engine.add_request("kept", prompt[:30], FIRST, export_kv=True)
    engine.step()  # "gone" is mid-prefill
    engine.abort_request("gone")
    got: dict = {}
    _run(engine, got)
    assert list(got) == ["kept"] and got["kept"].num_tokens == 29
    # The payload is the cache's own bytes: whole blocks, values then int8 scales if any.
    assert got["kept"].num_blocks == 8 and len(got["kept"].arrays) == 1
    assert got["kept"].nbytes == engine.runner.kv_cache.block_views()[0][:, :, :8].numel() * 4


def test_a_payload_comes_with_a_finish_by_stop_string(make_llm):
    # A stop string is found when the step's outputs are made, after the step has exported
    # the payloads of the requests it finished: the request's own output still carries one.
    llm = make_llm("llama", block_size=4)
    engine = llm.engine
    prompt = list(range(10, 40))
    text = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0,
                                                 ignore_eos=True))[0].outputs[0].text  # fmt: skip
    assert text.strip()
    stop = text.strip()[-1]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop])
    engine.add_request("s", prompt, params, export_kv=True)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [(o.finish_reason, o.stop_reason) for o in finals] == [("stop", stop)]
    assert finals[0].kv_payload is not None and finals[0].kv_payload.num_tokens == len(prompt) - 1
    assert not engine.scheduler.held


def test_decode_side_preempted_after_import_recomputes_correctly(make_llm):
    # A pool too small for every request at once: requests seeded with a payload get
    # preempted (recompute) and must still give one engine's tokens.
    options = dict(block_size=4, num_kv_blocks=40, max_num_seqs=8)
    one = make_llm("llama", **options)
    prompts = _ids(one, [SYSTEM + p for p in PROMPTS])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    prefill, decode = make_llm("llama", block_size=4), make_llm("llama", **options)
    payloads, _ = _prefill(prefill.engine, prompts)
    assert _decode(decode.engine, prompts, payloads, params) == want
    assert decode.engine.get_stats().num_preemptions_total > 0

"""Prefill on one engine, decode on another: the prompt's KV blocks move between them
(``hold_kv`` / ``export_kv`` / ``release_kv`` on the prefill side, ``kv_payload`` on the decode
side) and the tokens are exactly one engine's. The ``make_llm`` fixture checks, after each test,
that both engines are idle with every KV block back in the pool."""

from __future__ import annotations

import pickle

import pytest

from infer import SamplingParams

from .conftest import PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SYSTEM = "You are a careful assistant that answers questions about the Python language. "


def _run(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def _prefill(engine, prompts: list[list[int]]):
    """Prefill each prompt with ``hold_kv``; the exported payloads (pickled and back, as they
    travel), every held block released."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, FIRST, hold_kv=True)
    firsts = _run(engine)
    assert engine.get_stats().num_kv_held_requests == len(prompts)
    payloads = []
    for i in range(len(prompts)):
        payloads.append(pickle.loads(pickle.dumps(engine.export_kv(f"p{i}"))))
        assert engine.release_kv(f"p{i}")
    assert engine.get_stats().num_kv_held_requests == 0
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


def test_held_blocks_are_freed_by_release_abort_or_timeout(make_llm, monkeypatch):
    llm = make_llm("llama", block_size=4, enable_prefix_caching=True)
    engine = llm.engine
    kv = engine.kv_manager
    prompt = list(range(10, 60))
    for rid in ("a", "b", "c"):
        engine.add_request(rid, prompt, FIRST, hold_kv=True)
    _run(engine)
    assert engine.get_stats().num_kv_held_requests == 3
    assert kv.num_free_blocks < kv.num_total_blocks
    assert engine.release_kv("a") and not engine.release_kv("a")
    with pytest.raises(ValueError, match="no KV held"):
        engine.export_kv("a")
    engine.abort_request("b")  # the caller went away after the prefill finished
    assert engine.get_stats().num_kv_held_requests == 1
    monkeypatch.setenv("INFER_KV_HOLD_TIMEOUT", "0")
    engine.step()  # a held request past the timeout is freed between steps
    assert engine.get_stats().num_kv_held_requests == 0
    assert kv.num_free_blocks == kv.num_total_blocks


def test_aborted_or_failed_prefills_hold_nothing(make_llm):
    llm = make_llm("llama", block_size=4)
    engine = llm.engine
    engine.add_request("a", list(range(10, 60)), FIRST, hold_kv=True)
    engine.abort_request("a")  # before it ran
    _run(engine)
    assert engine.get_stats().num_kv_held_requests == 0


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

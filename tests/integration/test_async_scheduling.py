"""Async scheduling (the Triton step): a decode step launched while the step before is still on
the device, its input ids taken there, gives the tokens of waiting for every step — requests
that end by length, by a stop token while their next step is in flight, seeded sampling, an
abort and a new request under the aborted one's id — and every KV block comes back.

On a CPU the Triton step runs under Triton's interpreter (see test_triton_step.py); with a GPU
it is the real thing.
"""

from __future__ import annotations

import pytest
import torch

from infer import SamplingParams

from .conftest import PROMPTS

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPTIONS = dict(device=DEVICE, attention_backend="triton", block_size=4, max_num_seqs=4)


def _count_ahead(llm) -> list[int]:
    """Counts the steps the engine launches ahead (the engine's own method, wrapped)."""
    engine, launched = llm.engine, [0]
    plan = engine._plan_and_launch

    def counting(running):
        ahead = plan(running)
        launched[0] += ahead is not None
        return ahead

    engine._plan_and_launch = counting
    return launched


def _params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),  # ends by length first
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=7, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
    ]


def _run_to_the_end(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_steps_launched_ahead_give_the_waiting_steps_tokens(make_llm):
    sync = make_llm("llama", async_scheduling=False, **OPTIONS)
    prompts = PROMPTS[:4]
    # A stop token the third prompt meets mid-way (its 5th greedy token): it ends while the
    # step after is already launched.
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    stop_token = sync.generate([prompts[2]], plain)[0].outputs[0].token_ids[4]
    want = [o.outputs[0].token_ids for o in sync.generate(prompts, _params(stop_token))]
    assert len(want[2]) <= 5 and want[2][-1] == stop_token and len(want[1]) == 4

    llm = make_llm("llama", **OPTIONS)
    launched = _count_ahead(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _params(stop_token))]
    assert got == want
    assert launched[0] >= 4  # most decode steps went ahead
    assert llm.engine._ahead is None  # nothing left on the device once every request ended

    # An abort while a step is in flight, and a new request under the aborted one's id: the
    # in-flight step's token for the old request never reaches the new one.
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[5:8]]
    engine.add_request("a", ids[0], greedy)
    engine.add_request("b", ids[1], greedy)
    b_tokens: list[int] = []
    seen = 0
    while seen < 3:  # a few decode steps in: the next one is launched ahead of its tokens
        for out in engine.step():
            if out.request_id == "a":
                seen += len(out.new_token_ids)
            else:
                b_tokens += out.new_token_ids
    assert engine._ahead is not None
    engine.abort_request("a")
    engine.add_request("a", ids[2], greedy)
    tokens = _run_to_the_end(engine)
    tokens["b"] = b_tokens + tokens["b"]
    sync.engine.add_request("a", ids[2], greedy)
    sync.engine.add_request("b", ids[1], greedy)
    want_tokens = _run_to_the_end(sync.engine)
    assert tokens["b"] == want_tokens["b"]
    assert tokens["a"][-8:] == want_tokens["a"]  # after the aborted request's few
    assert engine._ahead is None


def test_async_scheduling_can_be_switched_off(make_llm):
    llm = make_llm("llama", async_scheduling=False, **OPTIONS)
    launched = _count_ahead(llm)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert launched[0] == 0 and not llm.engine._async


def test_a_reused_id_does_not_lose_the_ended_requests_last_output(make_llm):
    """A request the scheduler has ended whose last output is still deferred (made during the
    next step's forward pass): adding a new request under its id makes that output first."""
    llm = make_llm("llama", **OPTIONS)
    engine = llm.engine
    ids = engine.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("x", ids, params)
    outs = []
    while "x" in engine.scheduler.requests:
        outs += engine.step()
    assert not any(o.finished for o in outs)  # ended, its last output deferred
    engine.add_request("x", ids, params)
    outs += engine.step()
    first = [o for o in outs if o.finished]
    assert len(first) == 1 and first[0].num_output_tokens == 3
    assert sum(len(o.new_token_ids) for o in outs[: outs.index(first[0]) + 1]) == 3
    while engine.has_unfinished_requests():
        engine.step()


def test_a_reused_id_draws_from_its_own_seed(make_llm):
    """A seeded request is aborted while a step launched ahead holds its row, and a new request
    takes its id with the same parameters. That step samples when collected (a request admitted
    into it wants logprobs), so it still draws for the dropped row: the new request must draw
    from its own seed, as a fresh run does, not from a generator that draw made again."""
    llm = make_llm("llama", **OPTIONS)
    engine, tok = llm.engine, llm.tokenizer
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=123, ignore_eos=True)
    engine.add_request("fresh", tok.encode(PROMPTS[0]), seeded)
    want = _run_to_the_end(engine)["fresh"]
    engine.add_request("r", tok.encode(PROMPTS[0]), seeded)
    engine.add_request("g", tok.encode(PROMPTS[1]),
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))  # fmt: skip
    for _ in range(3):
        engine.step()
    engine.add_request("p", tok.encode(PROMPTS[2]), SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1))  # fmt: skip
    engine.step()
    ahead = engine._ahead
    assert ahead is not None and ahead.step.pending is None  # it samples when collected
    assert "r" in [c.request_id for c in ahead.step.out.chunks]
    engine.abort_request("r")
    engine.add_request("r", tok.encode(PROMPTS[0]), seeded)
    got: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "r" and out.finish_reason != "abort":  # (not the old r's end)
                got += out.new_token_ids
    assert got == want
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks


def test_a_discarded_step_launched_ahead_still_counts_its_launch(make_llm):
    """A stop token ends the only request while the step after it is already launched: that
    step is dropped, and its launch (inputs, queueing the pass) is still in ``step_times``."""
    llm = make_llm("llama", **OPTIONS)
    engine = llm.engine
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    stop_token = llm.generate([PROMPTS[1]], plain)[0].outputs[0].token_ids[4]
    launched, discarded = [], []
    launch, discard = engine.runner.launch, engine._discard_ahead

    def recording_launch(*args, **kwargs):
        launched.append(launch(*args, **kwargs))
        return launched[-1]

    def recording_discard(ahead):
        discarded.append(ahead)
        discard(ahead)

    engine.runner.launch, engine._discard_ahead = recording_launch, recording_discard
    before = (engine.step_times.prepare, engine.step_times.forward)
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_token])
    out = llm.generate([PROMPTS[1]], params)[0].outputs[0]
    assert out.token_ids[-1] == stop_token and len(out.token_ids) <= 5
    assert [a.step for a in discarded if a is not None] == launched[-1:]  # the last launch
    st = engine.step_times
    assert st.prepare - before[0] == pytest.approx(sum(s.t1 - s.t0 for s in launched))
    assert st.forward - before[1] == pytest.approx(sum(s.t2 - s.t1 for s in launched))


# (padded mixed steps under the interpreter take ~75 s here: slow on a CPU; on a GPU every run)
@pytest.mark.parametrize(
    "mixed_graphs",
    [False, pytest.param(True, marks=pytest.mark.slow if DEVICE == "cpu" else ())],
    ids=["mixed-eager", "mixed-graphs"],
)
def test_requests_admitted_into_steps_launched_ahead_get_the_waiting_steps_tokens(
    make_llm, hf_greedy, mixed_graphs, monkeypatch
):
    """Arrivals while others decode (more prompts than slots, and requests added mid-flight)
    go into steps launched ahead — a decode step's rows fed on the device, the new prompts'
    chunks after them — with the tokens of waiting for every step (greedy: transformers'
    tokens, which the Triton step gives when it waits; see test_triton_step.py), every block
    back. With INFER_MIXED_GRAPHS=1 those mixed steps run padded to token buckets (graphs on
    a GPU)."""
    from infer.runner.gpu.cuda_step import MIXED_GRAPHS_ENV

    monkeypatch.setenv(MIXED_GRAPHS_ENV, "1" if mixed_graphs else "0")
    options = dict(OPTIONS, max_num_seqs=2, prefill_chunk_size=5)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:6]
    hf = [tokens[:6] for tokens in hf_greedy("llama")]
    want = hf[:6]

    llm = make_llm("llama", **options)
    assert bool(llm.engine.runner.cuda_step.mixed_sizes) == mixed_graphs
    admitted: list[str] = []
    admit = llm.engine.scheduler._admit_ahead

    def counting(budget, slots):
        chunks = admit(budget, slots)
        admitted.extend(c.request_id for c in chunks)
        return chunks

    llm.engine.scheduler._admit_ahead = counting
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    assert admitted  # slots freed by length were filled by steps launched ahead

    engine, tok = llm.engine, llm.tokenizer
    got: dict[str, list[int]] = {}
    for step in range(200):
        if step in (2, 3, 6):  # arrivals while a decode step is in flight
            rid = str(step)
            engine.add_request(rid, tok.encode(PROMPTS[step], add_special_tokens=False), greedy)
        if step > 6 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [got[r] for r in ("2", "3", "6")] == [hf[2], hf[3], hf[6]]


def test_embedding_requests_admitted_into_steps_launched_ahead(make_llm):
    """Embedding requests arriving while decodes run are admitted into steps launched ahead (a
    request that pools samples nothing, so no later step is fed from its row): the decodes keep
    the waiting steps' tokens, and each vector is the one the Triton step gives the prompt
    alone and the torch path's."""
    from infer.core.pooling_params import PoolingParams

    sync = make_llm("llama", async_scheduling=False, **OPTIONS)
    torch_path = make_llm("llama", block_size=4, max_num_seqs=4)
    inputs = [sync.tokenizer.encode(PROMPTS[5]), [5], sync.tokenizer.encode(PROMPTS[1])]
    alone = [r.outputs.embedding for r in sync.embed(inputs)]
    reference = [r.outputs.embedding for r in torch_path.embed(inputs)]
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(reference), atol=1e-4, rtol=1e-4)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in sync.generate(PROMPTS[:2], greedy)]

    llm = make_llm("llama", **OPTIONS)
    engine = llm.engine
    plan, ahead_ids = engine._plan_and_launch, []

    def recording(running):
        ahead = plan(running)
        if ahead is not None:
            ahead_ids.append({c.request_id for c in ahead.step.out.chunks})
        return ahead

    engine._plan_and_launch = recording
    for i in range(2):
        engine.add_request(f"g{i}", engine.tokenizer.encode(PROMPTS[i]), greedy)
    tokens: dict[str, list[int]] = {"g0": [], "g1": []}
    finals = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 3:
            assert engine._ahead is not None  # the next step is already on its way
            for j, ids in enumerate(inputs):
                engine.add_request(f"e{j}", ids, PoolingParams())
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        steps += 1
    assert [tokens["g0"], tokens["g1"]] == want
    assert len(ahead_ids) >= 4
    assert any(ids & {"e0", "e1", "e2"} for ids in ahead_ids), ahead_ids  # admitted ahead
    for j, vector in enumerate(alone):
        assert finals[f"e{j}"].num_output_tokens == 0
        torch.testing.assert_close(torch.tensor(finals[f"e{j}"].embedding), torch.tensor(vector),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip

"""The Triton step — step buffers, paged attention kernels, decode steps padded to graph buckets —
gives transformers' greedy tokens, and the same tokens with and without graphs, in every kind of
step (decode, chunked prefill over a paged past, prefix-cache hits, preemption, quantized KV,
speculative verify rows), and every KV block comes back.

On a CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by the test
conftest) and the "graphs" replay the padded bucket eagerly: the same buffers, padding rows and
kernels a CUDA graph replays, so what padding does to outputs is checked on every CI run. With
``--device cuda`` the same tests capture and replay real CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from infer import SamplingParams

from .conftest import PROMPTS

pytest.importorskip("triton")

# The Triton step's device: the GPU when there is one (whatever --device says), else the CPU
# under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def make_llm(make_llm):
    def factory(kind: str = "llama", **options):
        options.setdefault("device", DEVICE)
        return make_llm(kind, **options)

    return factory


NUM_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
FEW = PROMPTS[:5]


def _tokens(llm, prompts=FEW, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _want(hf_greedy, kind: str, prompts=FEW) -> list[list[int]]:
    return [t[:NUM_TOKENS] for t in hf_greedy(kind)[: len(prompts)]]


def _count_attention_calls(monkeypatch) -> dict[str, int]:
    """Count the step's attention launches as they happen: the prefill kernels (``tiles``:
    fixed grid; ``grid``: grid per step) and the decode kernel on a mixed step's decodes
    (``decode rows``: called with ``row_tables``). Graph captures count; the start-up
    warm-up (``CudaStep.warm_up``, on a GPU), which launches every variant once, does not."""
    from infer.runner.gpu import cuda_step, triton_attention

    calls = {"tiles": 0, "grid": 0, "decode rows": 0}
    warm_up = cuda_step.CudaStep.warm_up

    def uncounted(self) -> int:
        before = dict(calls)
        passes = warm_up(self)
        calls.update(before)
        return passes

    monkeypatch.setattr(cuda_step.CudaStep, "warm_up", uncounted)
    for name, key in (("paged_prefill_attention_tiles", "tiles"),
                      ("paged_prefill_attention", "grid"),
                      ("paged_decode_attention", "decode rows")):  # fmt: skip
        original = getattr(triton_attention, name)

        def counted(*args, _original=original, _key=key, **kwargs):
            if _key != "decode rows" or kwargs.get("row_tables") is not None:
                calls[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(triton_attention, name, counted)
    return calls


def _record_variants(monkeypatch) -> set[tuple]:
    """The attention kernels' variants as the step launches them: the entry point and the
    arguments that pick a compiled binary (splits, a decode list, the shortest chunk, a
    window, the KV cache's kind)."""
    from infer.runner.gpu import triton_attention

    seen: set[tuple] = set()
    for name in ("paged_prefill_attention_tiles", "paged_prefill_attention",
                 "paged_decode_attention"):  # fmt: skip
        original = getattr(triton_attention, name)

        def recorded(*args, _original=original, _name=name, **kwargs):
            key = (_name, kwargs.get("sliding_window") is not None, kwargs.get("kv_kind"))
            if _name == "paged_decode_attention":
                key += (kwargs.get("num_splits", 1), kwargs.get("row_ids") is not None)
            elif _name == "paged_prefill_attention":
                key += (kwargs.get("min_query_len", 1),)
            seen.add(key)
            return _original(*args, **kwargs)

        monkeypatch.setattr(triton_attention, name, recorded)
    return seen


# The interpreter is slow (~10 s an engine here): the default run keeps the kinds that add
# something (gemma3: sliding windows and q/k norms; gpt2: learned positions); the
# rest run with -m slow, and every one runs on a GPU.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("llama", marks=SLOW),
        pytest.param("qwen3", marks=SLOW),
        "gemma3",
        "gpt2",
    ],
)
def test_greedy_matches_transformers(kind, make_llm, hf_greedy):
    llm = make_llm(kind, attention_backend="triton", block_size=4, max_num_seqs=4)
    assert llm.engine.runner.cuda_step is not None
    assert _tokens(llm) == _want(hf_greedy, kind)


MODES = {
    # a tight budget and chunks of 5 after blocks of 4: chunks start mid-block over a paged past
    "chunked": dict(prefill_chunk_size=5, block_size=4, max_num_seqs=3),
    "preempt_recompute": dict(num_kv_blocks=14, block_size=4, max_num_seqs=5),
    "preempt_swap": dict(num_kv_blocks=14, block_size=4, max_num_seqs=5, preemption_mode="swap"),
    "contiguous": dict(kv_cache_backend="contiguous", max_num_seqs=3),
}


@pytest.mark.parametrize(
    "mode",
    [pytest.param(m, marks=SLOW) if m in ("preempt_swap", "contiguous") else m for m in MODES],
)
def test_graphs_and_eager_give_transformers_tokens(mode, make_llm, hf_greedy, monkeypatch):
    """Padded buckets (graphs) and exact-size eager steps: the same tokens, transformers'. A
    step with prompt chunks (eager) attends its decodes through the decode kernel, or (the
    second engine of the chunked mode: INFER_MIXED_DECODE_ROWS=0) through the prefill kernel."""
    from infer.runner.gpu import cuda_step

    want = _want(hf_greedy, "llama")
    calls = _count_attention_calls(monkeypatch)
    listed = []
    for eager in (False, True):
        switch = "0" if eager and mode == "chunked" else "1"
        monkeypatch.setenv(cuda_step.MIXED_DECODE_ROWS_ENV, switch)
        before = calls["decode rows"]
        llm = make_llm("llama", attention_backend="triton", enforce_eager=eager, **MODES[mode])
        graphs = llm.engine.runner.cuda_step.graphs
        assert (graphs is None) == eager
        assert _tokens(llm) == want, f"enforce_eager={eager}"
        counters = llm.engine.scheduler.counters
        if mode.startswith("preempt"):
            assert counters.preemptions_recompute + counters.preemptions_swap > 0
        listed.append(calls["decode rows"] - before)
    if mode == "chunked":  # (max_num_seqs 3, chunks of 5: decodes run beside prompt chunks)
        assert listed[0] > 0 and listed[1] == 0


@pytest.mark.parametrize(
    ("mode", "decode_rows"),
    [
        ("chunked", "1"),
        pytest.param("chunked", "0", marks=SLOW),
        pytest.param("preempt_recompute", "1", marks=SLOW),
    ],
)
def test_mixed_steps_padded_to_token_buckets_give_transformers_tokens(
    mode, decode_rows, make_llm, hf_greedy, monkeypatch
):
    """INFER_MIXED_GRAPHS=1: steps with prompt chunks run padded to a token bucket through the
    fixed-grid prefill kernel (replayed as CUDA graphs on a GPU, eagerly here), their decodes
    through the decode kernel (``INFER_MIXED_DECODE_ROWS=0``: through the tiles too):
    transformers' tokens with and without graphs, every padded step through the tile list,
    every block back."""
    from infer.runner.gpu import cuda_step

    monkeypatch.setenv(cuda_step.MIXED_GRAPHS_ENV, "1")
    monkeypatch.setenv(cuda_step.MIXED_DECODE_ROWS_ENV, decode_rows)
    calls = _count_attention_calls(monkeypatch)
    want = _want(hf_greedy, "llama")
    # (on a CPU both engines would run the same padded steps: one is enough)
    for eager in (False, True) if DEVICE == "cuda" else (False,):
        llm = make_llm("llama", attention_backend="triton", enforce_eager=eager, **MODES[mode])
        step = llm.engine.runner.cuda_step
        assert step.mixed_sizes[0] == 16 and (step.mixed_graphs is None) == eager
        assert _tokens(llm) == want, f"enforce_eager={eager}"
        kinds = step.step_kinds  # (no graphs are captured on a CPU: padded, not replayed)
        assert kinds["mixed replayed" if step.mixed_graphs and step.mixed_graphs.graphs
                     else "mixed padded"] > 0 and kinds["mixed eager"] == 0  # fmt: skip
        kv = llm.engine.kv_manager
        assert kv.num_free_blocks == kv.num_total_blocks
    # every mixed step fits a bucket (the budget is under 512 tokens): no grid-per-step launch;
    # the decode kernel attends a mixed step's decodes exactly when the switch is on
    assert calls["tiles"] > 0 and calls["grid"] == 0
    assert calls["decode rows"] == (calls["tiles"] if decode_rows == "1" else 0)


# (environment, engine options) of the warm-up cases
WARM_UP_CASES = {
    "eager-mixed": ({}, {}),
    "padded-mixed": ({"INFER_MIXED_GRAPHS": "1"}, {}),
    "int8-kv": ({}, {"kv_cache_dtype": "int8"}),
    "decodes-in-tiles": ({"INFER_MIXED_DECODE_ROWS": "0"}, {}),
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=SLOW) if c in ("int8-kv", "decodes-in-tiles") else c
        for c in WARM_UP_CASES
    ],  # fmt: skip
)
def test_the_start_up_warm_up_launches_every_variant_a_load_does_and_writes_no_kv(
    case, make_llm, hf_greedy, monkeypatch
):
    """Start-up launches each attention kernel variant only eager steps use, once (on a GPU,
    Triton compiles them then, not in the middle of the first request needing one): every
    variant a chunked load with decodes beside its prompt chunks then launches outside the
    decode graphs was launched by the warm-up, which wrote nothing to the KV cache and left the
    tokens transformers'. The decode graphs count as captured, as on a GPU; with
    INFER_MIXED_GRAPHS=1 the mixed steps are padded (and nothing of theirs captured here)."""
    env, options = WARM_UP_CASES[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    seen = _record_variants(monkeypatch)
    llm = make_llm("gemma3", attention_backend="triton", prefill_chunk_size=5, block_size=4,
                   max_num_seqs=5, **options)  # fmt: skip
    step, cache = llm.engine.runner.cuda_step, llm.engine.kv_cache
    if not step.graphs.graphs:  # a CPU captures nothing: the decode buckets replay eagerly
        step.graphs.graphs = dict.fromkeys(step.sizes)
    before = [t.clone() for t in (cache.tensor, cache.scales) if t is not None]
    seen.clear()
    passes = step.warm_up()  # (at start-up on a GPU only: the interpreter compiles nothing)
    assert passes > 0 and step.warm_up_passes == passes  # (as infer bench gpu reports it)
    warm = set(seen)
    after = [t for t in (cache.tensor, cache.scales) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    seen.clear()
    kv_dtype = options.get("kv_cache_dtype")
    if kv_dtype:  # (a quantized cache: the torch path's tokens, not transformers')
        ref = make_llm("gemma3", attention_backend="torch", kv_cache_dtype=kv_dtype, block_size=4)
        want = _tokens(ref)
    else:
        want = _want(hf_greedy, "gemma3")
    seen.clear()
    assert _tokens(llm) == want

    def decode_steps(keys):  # the decode kernel over decode rows: the captured graphs'
        return {key for key in keys if key[0] == "paged_decode_attention" and not key[4]}

    assert not decode_steps(warm)
    assert seen - decode_steps(seen) <= warm, seen - decode_steps(seen) - warm
    if step.mixed_graphs is not None and step.mixed_graphs.graphs:
        # A GPU with INFER_MIXED_GRAPHS=1: every step of the load replayed a graph (decode or
        # mixed bucket), so nothing launched from Python: nothing for the warm-up to cover.
        assert not seen and step.step_kinds["mixed eager"] == 0
        return
    assert {key[1] for key in seen} == {True, False}  # gemma3: windowed and global layers
    assert {key[2] for key in seen} == {kv_dtype}
    lists = {key[3] for key in seen if key[0] == "paged_decode_attention" and key[4]}
    if case == "decodes-in-tiles":
        assert not lists and ("paged_prefill_attention", False, None, 1) in seen
    elif DEVICE == "cpu" and case == "padded-mixed":  # a fixed list of 5 entries: one split
        assert lists == {1} and any(key[0] == "paged_prefill_attention_tiles" for key in seen)
    elif DEVICE == "cpu":  # eager mixed steps listed 1 to 4 decodes: the interpreter's 2 counts
        assert lists == {1, 2}


def test_shared_prefix_hits_read_the_cached_blocks(make_llm, hf_greedy):
    """Two waves of the same prompts: the second wave's prompts hit the cache (blocks shared
    between sequences), and the kernels read them through the block tables."""
    llm = make_llm(
        "llama",
        attention_backend="triton",
        enable_prefix_caching=True,
        block_size=4,
        max_num_seqs=4,
    )
    first = _tokens(llm, PROMPTS[5:7])
    second = _tokens(llm, PROMPTS[5:7])
    assert first == second == [t[:NUM_TOKENS] for t in hf_greedy("llama")[5:7]]
    assert llm.engine.kv_manager.pool.stats.hits > 0


@pytest.mark.parametrize("kv_dtype", [pytest.param("int8", marks=SLOW), "fp8"])
def test_quantized_kv_cache_matches_the_torch_path(kv_dtype, make_llm):
    """A one-byte cache: the Triton kernels dequantize inside; greedy tokens equal the torch
    path's over the same rounded keys and values."""
    ref = make_llm("llama", kv_cache_dtype=kv_dtype, block_size=4, attention_backend="torch")
    llm = make_llm(
        "llama", kv_cache_dtype=kv_dtype, block_size=4, max_num_seqs=4, attention_backend="triton"
    )
    assert _tokens(llm) == _tokens(ref)


def test_speculative_verify_rows_replay_and_match(make_llm, hf_greedy):
    """n-gram proposals: verify chunks (k + 1 decode rows per sequence, each with its own
    context length) go through the decode kernel and the padded buckets."""
    prompts = ["a b c a b c a b c a b", "1 2 3 4 1 2 3 4 1 2", *FEW[:2]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    ref = make_llm("llama", block_size=4)
    llm = make_llm(
        "llama", attention_backend="triton", block_size=4, max_num_seqs=4, speculative_config=spec
    )
    assert _tokens(llm, prompts) == _tokens(ref, prompts)
    assert llm.engine.scheduler.counters.spec_draft_tokens > 0


@SLOW
def test_sampling_with_a_seed_is_reproducible(make_llm):
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    a = make_llm("llama", attention_backend="triton", max_num_seqs=4)
    b = make_llm("llama", attention_backend="triton", max_num_seqs=4, enforce_eager=True)
    assert _tokens(a, FEW[:3], params) == _tokens(b, FEW[:3], params)


@pytest.mark.parametrize("stream_interval", [1, 3])
def test_deferred_outputs_stop_strings_aborts_and_n(make_llm, stream_interval):
    """On the GPU step a step's outputs are made during the next step's forward pass: stop
    strings, stop ids, max_tokens, n > 1 and an abort mid-way give what the torch path gives,
    and the last outputs are not left behind (also when ``--stream-interval`` holds tokens
    back)."""
    ref = make_llm("llama", block_size=4)
    llm = make_llm("llama", attention_backend="triton", block_size=4, max_num_seqs=4,
                   stream_interval=stream_interval)  # fmt: skip
    assert llm.engine._defer_outputs
    greedy = ref.generate(FEW[:3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    text = greedy[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # a stop string in the middle
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]),
        SamplingParams(
            max_tokens=12, temperature=0, stop_token_ids=[greedy[1].outputs[0].token_ids[3]]
        ),
        SamplingParams(max_tokens=5, temperature=0.9, seed=3, n=2, ignore_eos=True),
    ]
    want = ref.generate(FEW[:3], params)
    got = llm.generate(FEW[:3], params)
    for w, g in zip(want, got, strict=True):
        assert [(o.text, o.token_ids, o.finish_reason) for o in g.outputs] == [
            (o.text, o.token_ids, o.finish_reason) for o in w.outputs
        ]
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request("a")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs and outs[-1].finished and outs[-1].finish_reason == "abort"


def test_prompt_logprobs_and_a_mixed_batch_gather_the_right_rows(make_llm):
    """Prompt-logprob rows and the sampled rows of a step with prefill chunks go to the LM head
    through index buffers on the device: the same numbers as the torch path's."""
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, ignore_eos=True)
    ref = make_llm("llama", block_size=4).generate(FEW[:3], params)
    got = make_llm("llama", attention_backend="triton", block_size=4).generate(FEW[:3], params)
    for w, g in zip(ref, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        want_lp = [lp.logprob for lp in w.prompt_logprobs[1:]]
        got_lp = [lp.logprob for lp in g.prompt_logprobs[1:]]
        assert got_lp == pytest.approx(want_lp, abs=1e-4)


def test_the_lm_head_row_indices_are_copied_before_the_forward_pass(make_llm, monkeypatch):
    """A step with prefill chunks gathers its sampled (and prompt-logprob) rows for the LM head;
    their index copies are queued before the forward pass, never after it: on a GPU the next
    step's fill waits for the last copy out of the pinned buffers, so a copy queued behind the
    pass made the host wait for the whole step (no overlap with async scheduling)."""
    from infer.runner.gpu import cuda_step
    from infer.runner.gpu import step as step_mod

    llm = make_llm("llama", attention_backend="triton", block_size=4)
    steps: list[list[str]] = []
    model = llm.engine.runner.model

    def record(cls, name, label):
        original = getattr(cls, name)

        def recorded(self, *args, **kwargs):
            if label == "step":
                steps.append([])
            else:
                steps[-1].append(label if label else args[0])
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, recorded)

    record(cuda_step.CudaStep, "forward", "step")
    record(step_mod.StepInputs, "stage", None)  # its name: sample_rows, prompt_rows, ...
    record(step_mod.StepInputs, "upload", "upload")
    record(type(model), "forward", "pass")
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, ignore_eos=True)
    llm.generate(FEW[:3], params)
    gathering = [s for s in steps if "sample_rows" in s or "prompt_rows" in s]
    assert gathering, steps
    for events in gathering:
        assert events.count("pass") == 1, events
        after = events[events.index("pass") :]
        assert "sample_rows" not in after and "prompt_rows" not in after, events
        # one upload of the step's buffers, after the last row staged, before the pass
        assert events.count("upload") == 1, events
        assert events.index("upload") > max(events.index(n) for n in ("sample_rows",
                                             "prompt_rows") if n in events), events  # fmt: skip
        assert events.index("upload") < events.index("pass"), events


def test_a_step_that_fails_before_its_inputs_are_copied_fails_alone(make_llm, monkeypatch):
    """A step failing between writing its inputs and copying them (here: staging its LM-head
    rows) fails its requests; the next steps write theirs afresh and serve the next requests
    as a fresh engine does, every KV block back."""
    llm = make_llm("llama", attention_backend="triton", block_size=4)
    want = _tokens(llm, FEW[:2])
    inputs = llm.engine.runner.cuda_step.inputs
    stage, calls = inputs.stage, [0]

    def failing_once(name, rows):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("staging failed")
        return stage(name, rows)

    monkeypatch.setattr(inputs, "stage", failing_once)
    engine = llm.engine
    engine.add_request("doomed", engine.tokenizer.encode(FEW[2]), GREEDY)
    engine.add_request("doomed-too", engine.tokenizer.encode(FEW[3]), GREEDY)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert {o.finish_reason for o in finals} == {"error"} and calls[0] >= 1
    assert "staging failed" in finals[0].error
    assert _tokens(llm, FEW[:2]) == want
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_requests_stopped_while_the_next_step_runs_leave_no_generator(make_llm):
    """A seeded request whose stop string is found while its next step runs (deferred outputs)
    still has that step's draw made, which re-creates its generator: the engine forgets it."""
    llm = make_llm("llama", attention_backend="triton", block_size=4, max_num_seqs=4)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, stop=["e", "a", " "])
    outs = llm.generate(FEW[:4], params)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)
    assert not llm.engine.runner.sampler._generators


def test_the_bench_arrival_cell_times_mixed_steps(make_llm, monkeypatch):
    """``infer bench gpu``'s step with an arrival: B requests decode and a new prompt comes
    before every timed step, so every timed step holds a prompt chunk beside the decodes (a
    mixed step: replayed on a GPU, padded here), and nothing is left behind. Asked for a full
    batch (max_num_seqs), it keeps a slot free for the arrivals."""
    from infer.bench.gpu import arrival_step_ms
    from infer.runner.gpu import cuda_step

    monkeypatch.setenv(cuda_step.MIXED_GRAPHS_ENV, "1")
    llm = make_llm("llama", attention_backend="triton", max_num_seqs=3)
    engine = llm.engine
    r = arrival_step_ms(engine, 3, 4, 12, seed=0)
    assert r["batch"] == 2 and r["steps"] == 4 and r["ms"] > 0
    kind = "mixed replayed" if DEVICE == "cuda" else "mixed padded"
    assert r["step_kinds"] == {kind: 4}
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks

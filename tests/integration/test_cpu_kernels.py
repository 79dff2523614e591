"""The CPU kernels in a real bfloat16 engine: they agree with the torch ops they replace, and with
them a sequence's greedy tokens do not depend on what else is in its batch."""

from __future__ import annotations

import pytest

from infer import SamplingParams
from infer.runner.cpu.kernels import cpu_kernels

from .conftest import PROMPTS

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler for the kernels")

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3", "gpt2"]


@pytest.fixture
def engine_device() -> str:
    """These engines test the CPU kernels: on the CPU whatever ``--device`` says."""
    return "cpu"


@pytest.fixture
def kernels_off(monkeypatch):
    """Builds engines on the torch ops (``INFER_CPU_KERNELS=0``) until the test ends."""

    def switch_off() -> None:
        monkeypatch.setenv("INFER_CPU_KERNELS", "0")
        cpu_kernels.cache_clear()

    yield switch_off
    monkeypatch.delenv("INFER_CPU_KERNELS", raising=False)
    cpu_kernels.cache_clear()


def _tokens_and_logprobs(llm, prompts):
    outs = llm.generate(prompts, PARAMS)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("kind", ARCHS)
def test_bf16_kernels_agree_with_torch_ops(kind, make_llm, kernels_off):
    fast = _tokens_and_logprobs(make_llm(kind, dtype="bfloat16"), PROMPTS)
    kernels_off()
    slow = _tokens_and_logprobs(make_llm(kind, dtype="bfloat16"), PROMPTS)
    agreeing = 0
    for (fast_ids, fast_lps), (slow_ids, slow_lps) in zip(fast, slow, strict=True):
        assert fast_ids[0] == slow_ids[0]  # the prompt's next token
        for a, b, lp_a, lp_b in zip(fast_ids, slow_ids, fast_lps, slow_lps, strict=True):
            if a != b:
                break  # bf16 rounding may flip a near-tie; the sequences part ways there
            assert abs(lp_a - lp_b) < 0.1, (kind, a, lp_a, lp_b)
            agreeing += 1
    assert agreeing >= 0.75 * sum(len(ids) for ids, _ in fast)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_bf16_greedy_tokens_do_not_depend_on_the_batch(kind, make_llm):
    """Row-independent linears and norms, per-sequence attention: a sequence alone, in a batch of
    three or of all prompts, gets the same tokens."""
    alone = [_tokens_and_logprobs(make_llm(kind, dtype="bfloat16", max_num_seqs=1), PROMPTS)]
    for max_num_seqs in (3, 32):
        llm = make_llm(kind, dtype="bfloat16", max_num_seqs=max_num_seqs)
        assert _tokens_and_logprobs(llm, PROMPTS) == alone[0]


@pytest.mark.parametrize("kind", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    "quant",
    [
        {},
        {"quantization": "int8", "kv_cache_dtype": "int8"},
        {"quantization": "w8a8"},
        {"quantization": "int4"},
        {"quantization": "w4a8", "kv_cache_dtype": "int8"},
    ],
)
def test_fast_decode_path_gives_the_module_paths_bits(kind, quant, make_llm, monkeypatch):
    """All-decode steps skip the module code (runner/cpu/decode_fast.py): same kernels, same order,
    so the same tokens and the same logprobs, bit for bit."""
    kernels = cpu_kernels()
    if kernels.linear_kind < 1:
        pytest.skip("the fast decode path needs tiled linear layers")
    if quant.get("quantization") == "int8" and not kernels.linear_int8:
        pytest.skip("tiled int8 weights need AMX or AVX-512 BF16 with VBMI")
    if quant.get("quantization") == "w8a8" and not kernels.has_w8a8:
        pytest.skip("w8a8 needs AVX-512 VNNI")
    if quant.get("quantization") == "int4" and not kernels.has_int4:
        pytest.skip("int4 needs AVX-512 BF16 or AVX2")
    if quant.get("quantization") == "w4a8" and not kernels.has_w4a8:
        pytest.skip("w4a8 needs AVX-512 VNNI")
    fast_llm = make_llm(kind, dtype="bfloat16", **quant)
    assert fast_llm.engine.runner.fast_decoder is not None
    fast = _tokens_and_logprobs(fast_llm, PROMPTS)
    monkeypatch.setenv("INFER_FAST_DECODE", "0")
    slow_llm = make_llm(kind, dtype="bfloat16", **quant)
    assert slow_llm.engine.runner.fast_decoder is None
    assert _tokens_and_logprobs(slow_llm, PROMPTS) == fast


def test_fast_decode_path_is_not_taken_where_a_kernel_is_missing(make_llm):
    assert make_llm("gemma3", dtype="bfloat16").engine.runner.fast_decoder is None  # sandwich norms
    assert make_llm("llama", dtype="float32").engine.runner.fast_decoder is None

"""Engine fixtures: an LLM factory that checks, after every test, that the engine is idle and
every KV block is back in the pool; and transformers' greedy outputs as the oracle."""

from __future__ import annotations

import pytest
import torch

from infer import LLM

PROMPTS = [
    "The quick brown fox",
    "In Python, a list is a mutable sequence",
    "def main():",
    "Exceptions are raised when an error occurs during execution of a statement",
    "x",
    "The import statement combines two operations; it searches for the named module, then it "
    "binds the results of that search to a name in the local scope.",
    "Assignment statements are used to (re)bind names to values",
    "for i in range(10):",
    "A class definition defines a class object",
    "Unicode: héllo wörld",
    "The with statement is used to wrap the execution of a block",
    "Comparisons",
]
GEN_TOKENS = 24


def skip_unless_cpu(device: str, what: str) -> None:
    """Skip a test of ``what`` (a C++ CPU kernel, a property only the CPU path has) when the
    engine tests run on a GPU (``--device cuda``)."""
    if not str(device).startswith("cpu"):
        pytest.skip(f"{what}: a CPU engine's (the engines run on {device})")


@pytest.fixture
def make_llm(tiny_checkpoints, engine_device, engine_options):
    created: list[LLM] = []

    def factory(kind: str = "llama", **options) -> LLM:
        """An engine on the tiny checkpoint ``kind`` (or on the folder ``kind`` names)."""
        for name, value in engine_options.items():
            options.setdefault(name, value)
        options.setdefault("dtype", "float32")
        options.setdefault("device", engine_device)
        if str(options["device"]).startswith("cuda") and options.get("num_kv_blocks") is None:
            # A GPU's default budget is a share of its whole memory: two engines alive in one
            # test would leave the second none. 2 GiB is what a CPU engine takes at most.
            options.setdefault("kv_cache_memory", "2GiB")
        llm = LLM(str(tiny_checkpoints.get(kind, kind)), **options)  # (a kind, or a folder)
        created.append(llm)
        return llm

    yield factory
    for llm in created:
        engine = llm.engine
        assert not engine.has_unfinished_requests(), "engine left requests unfinished"
        kv = engine.kv_manager
        assert kv.num_free_blocks == kv.num_total_blocks, "KV blocks leaked"
        draft_kv = getattr(engine.proposer, "kv", None)  # a draft model's own cache
        if draft_kv is not None:
            assert draft_kv.num_free_blocks == draft_kv.num_total_blocks, "draft KV blocks leaked"
        if engine.structured is not None:
            assert not engine.structured.matchers, "grammar matchers left behind"


_HF_CACHE: dict[tuple[str, int, str], list[list[int]]] = {}


@pytest.fixture
def hf_greedy(tiny_checkpoints, engine_device):
    """transformers' greedy continuation (GEN_TOKENS tokens, EOS ignored) of each prompt, run on
    the engine's device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def get(kind: str = "llama", num_tokens: int = GEN_TOKENS) -> list[list[int]]:
        key = (kind, num_tokens, engine_device)
        if key not in _HF_CACHE:
            path = tiny_checkpoints[kind]
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            model = model.to(engine_device).eval()
            # Pure greedy that runs past EOS (like ignore_eos); min_new_tokens would mask EOS.
            model.generation_config.eos_token_id = None
            outs = []
            for prompt in PROMPTS:
                ids = tok.encode(prompt, add_special_tokens=False)
                with torch.no_grad():
                    g = model.generate(
                        torch.tensor([ids], device=engine_device),
                        max_new_tokens=num_tokens,
                        do_sample=False,
                        pad_token_id=tok.eos_token_id,
                    )
                outs.append(g[0, len(ids) :].tolist())
            _HF_CACHE[key] = outs
        return _HF_CACHE[key]

    return get

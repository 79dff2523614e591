"""Our model modules against transformers' implementation, on every tiny checkpoint (float32).

Logits must agree to 1e-4 at every prompt position and along 32 greedy decode steps run through
a paged KV cache (block size 4, shuffled physical blocks, so block boundaries are crossed), and
the greedy tokens must equal ``generate(do_sample=False)``. Chunked prefill and a mixed batch
(one sequence decoding while another prefills) must give the same logits.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from infer.model import CausalLM, load_model, load_tokenizer
from infer.runner.attention import AttentionContext, KVCache, SequenceSlice
from infer.testing.checkpoints import GEMMA3_SLIDING_WINDOW, MISTRAL_SLIDING_WINDOW

PROMPT = (
    "The import statement combines two operations; it searches for the named module, "
    "then binds the result to a name in the local scope."
)
GEN_TOKENS = 32
TOL = 1e-4
BLOCK_SIZE = 4


class PagedSequences:
    """Runs forward passes over several sequences sharing one paged KV cache.

    Each sequence gets blocks from a shuffled free list, so logical neighbours are physically
    scattered, as in the engine.
    """

    def __init__(self, model: CausalLM, num_blocks: int = 64, seed: int = 0) -> None:
        spec = model.spec
        weight = next(model.parameters())
        self.model, self.device = model, weight.device
        self.cache = KVCache(
            spec.num_layers, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim,
            weight.dtype, self.device,
        )  # fmt: skip
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one forward pass over ``chunks`` (sequence -> new tokens); logits per sequence."""
        slices, ids, positions = [], [], []
        for name, tokens in chunks.items():
            table = self.tables.setdefault(name, [])
            done = self.computed.get(name, 0)
            while len(table) * BLOCK_SIZE < done + len(tokens):
                table.append(self.free.pop())
            slices.append(SequenceSlice(done, len(tokens), list(table)))
            ids.extend(tokens)
            positions.extend(range(done, done + len(tokens)))
            self.computed[name] = done + len(tokens)
        ctx = AttentionContext(self.cache, slices, self.device)
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(ids, device=self.device),
                torch.tensor(positions, device=self.device),
                ctx,
            )
            logits = self.model.compute_logits(hidden)
        return dict(zip(chunks, logits.split([len(t) for t in chunks.values()]), strict=True))


_REFERENCE: dict[tuple[str, str], tuple[list[int], list[int], torch.Tensor]] = {}


def reference(path: Path, device: str) -> tuple[list[int], list[int], torch.Tensor]:
    """transformers' (prompt ids, greedy continuation, logits of the whole sequence) on ``device``."""
    key = (str(path), device)
    if key not in _REFERENCE:
        from transformers import AutoModelForCausalLM

        ids = load_tokenizer(path).encode(PROMPT, add_special_tokens=False)
        hf = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        hf = hf.to(device).eval()
        hf.generation_config.eos_token_id = None  # greedy for exactly GEN_TOKENS tokens
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids], device=device),
                do_sample=False,
                max_new_tokens=GEN_TOKENS,
                pad_token_id=0,
            )
            full = out[0].tolist()
            logits = hf(torch.tensor([full], device=device)).logits[0].float()
        _REFERENCE[key] = (ids, full[len(ids) :], logits)
    return _REFERENCE[key]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_prefill_and_paged_decode_match_transformers(
    tiny_checkpoint: Path, engine_device: str
) -> None:
    prompt, hf_generated, hf_logits = reference(tiny_checkpoint, engine_device)
    assert 20 <= len(prompt) <= 40
    model = load_model(tiny_checkpoint, torch.float32, device=engine_device)
    seqs = PagedSequences(model)

    logits = seqs.step({"a": prompt})["a"]
    assert logits.dtype == torch.float32
    assert max_diff(logits, hf_logits[: len(prompt)]) < TOL

    generated: list[int] = []
    for step in range(GEN_TOKENS):
        token = int(logits[-1].argmax())
        generated.append(token)
        assert token == hf_generated[step], f"greedy diverged at step {step}"
        logits = seqs.step({"a": [token]})["a"]
        position = len(prompt) + step
        assert max_diff(logits[0], hf_logits[position]) < TOL, f"decode step {step}"
    assert generated == hf_generated
    # On a GPU, gemma3's continuation alternates two tokens (each still checked logit by logit).
    assert len(set(generated)) > 1, "degenerate checkpoint: greedy output never varies"


def test_chunked_prefill_matches_transformers(tiny_checkpoint: Path, engine_device: str) -> None:
    prompt, generated, hf_logits = reference(tiny_checkpoint, engine_device)
    sequence = prompt + generated
    model = load_model(tiny_checkpoint, torch.float32, device=engine_device)
    seqs = PagedSequences(model, seed=1)
    chunks = [sequence[i : i + 7] for i in range(0, len(sequence), 7)]
    logits = torch.cat([seqs.step({"a": chunk})["a"] for chunk in chunks])
    assert max_diff(logits, hf_logits) < TOL


def test_mixed_batch_matches_transformers(tiny_checkpoint: Path, engine_device: str) -> None:
    """One sequence decodes while a second prefills in chunks, in the same forward passes."""
    prompt, generated, hf_logits = reference(tiny_checkpoint, engine_device)
    sequence = prompt + generated
    model = load_model(tiny_checkpoint, torch.float32, device=engine_device)
    seqs = PagedSequences(model, seed=2)
    seqs.step({"dec": prompt})
    b_logits = []
    for i in range(0, 5 * 9, 9):
        step = len(prompt) + i // 9
        out = seqs.step({"dec": [sequence[step]], "pre": sequence[i : i + 9]})
        assert max_diff(out["dec"][0], hf_logits[step]) < TOL
        b_logits.append(out["pre"])
    assert max_diff(torch.cat(b_logits), hf_logits[:45]) < TOL


@pytest.mark.parametrize(
    ("kind", "window", "mixed"),
    [("gemma3", GEMMA3_SLIDING_WINDOW, True), ("mistral", MISTRAL_SLIDING_WINDOW, False)],
)
def test_sliding_window_is_exercised(
    tiny_checkpoints: dict[str, Path], kind: str, window: int, mixed: bool, engine_device: str
) -> None:
    """The parity tests above only cover the window if the prompt is longer than it."""
    prompt, _, _ = reference(tiny_checkpoints[kind], engine_device)
    model = load_model(tiny_checkpoints[kind], torch.float32)
    windows = {layer.attn.sliding_window for layer in model.layers}
    assert windows == ({window, None} if mixed else {window})
    assert len(prompt) > window


def test_bfloat16_loads_and_runs(tiny_checkpoint: Path, engine_device: str) -> None:
    prompt, generated, hf_logits = reference(tiny_checkpoint, engine_device)
    model = load_model(tiny_checkpoint, torch.bfloat16, device=engine_device)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    seqs = PagedSequences(model)
    logits = [seqs.step({"a": prompt})["a"]]
    for token in generated[:8]:
        logits.append(seqs.step({"a": [token]})["a"])
    out = torch.cat(logits)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    # Not parity, but bf16 must still be computing the same function. A mixture of experts
    # gets more room: bf16's rounding can flip a near-tie in the router, and a token then runs
    # other experts (on an H200 qwen2_moe measured 5.2% where the dense models stay under 5%).
    reference_logits = hf_logits[: len(out)]
    bound = 0.1 if "moe" in tiny_checkpoint.name else 0.05
    assert (out - reference_logits).abs().mean() < bound * reference_logits.abs().mean()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_model_runs_on_device_of_its_weights(
    tiny_checkpoints: dict[str, Path], kind: str, engine_device: str
) -> None:
    model = load_model(tiny_checkpoints[kind], "float32", device=engine_device)
    want = torch.device(engine_device).type
    assert {b.device.type for b in model.buffers()} == {want}
    assert {p.device.type for p in model.parameters()} == {want}
    assert not any(p.requires_grad for p in model.parameters())

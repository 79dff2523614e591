"""Train a built-in model from its preset and save it as an ordinary Hugging Face folder.

transformers' own ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` are the trainers, so the folder
is exactly what transformers (and infer's loader) expect: ``config.json``,
``model.safetensors`` (float32), ``generation_config.json``, the tokenizer files with the
ChatML template, and ``infer_builtin.json`` describing the build.

Determinism: the weights init and the data order come from ``seed`` alone (a seeded
``torch.Generator`` draws window offsets), and the corpus is a fixed function of the running
Python. On one machine, with the same torch build and thread count, the same seed gives the
same loss curve and byte-identical weights. Across machines or thread counts the float
reductions inside matmuls may be ordered differently, so weights can differ in the last bits;
and a preset's bf16 matmuls run in float32 on a CPU without bf16 in hardware
(:func:`infer.builtin.presets.bf16_matmuls`), whose build gets a folder of its own.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from infer.builtin.presets import MANIFEST, RECIPE_VERSION, Preset, bf16_matmuls
from infer.builtin.textdata import (
    batch_windows,
    build_tokenizer,
    encode_stream,
    split_docs,
    training_docs,
)

WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class TrainResult:
    """What a training run produced (``elapsed_s`` and ``tokens_per_s`` are not saved)."""

    out_dir: Path
    preset: str
    seed: int
    steps: int
    num_params: int
    losses: list[float] = field(repr=False)
    final_loss: float  # mean training loss of the last 10% of steps
    val_loss: float
    sample: str
    weights_sha256: str
    elapsed_s: float
    tokens_per_s: float


def build_config(preset: Preset):
    """The transformers config of ``preset`` (ids 0..2: endoftext, im_start, im_end)."""
    common = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    if preset.arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=preset.vocab_size,
            n_positions=preset.context_len,
            n_embd=preset.hidden_size,
            n_layer=preset.num_layers,
            n_head=preset.num_heads,
            n_inner=preset.intermediate_size,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.context_len,
        rms_norm_eps=1e-5,
        **common,
    )


# The last projection of each residual branch (Llama attention, Llama MLP).
RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def build_model(preset: Preset) -> torch.nn.Module:
    """A freshly initialised model (init draws from torch's global RNG: seed it first)."""
    from transformers import AutoModelForCausalLM

    config = build_config(preset)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if preset.zero_init_residual:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(RESIDUAL_OUTPUTS):
                    param.zero_()
    return model


def lr_ratio(preset: Preset, step: int, total: int) -> float:
    """The learning rate of ``step`` of ``total`` as a fraction of the peak: linear warmup, then
    cosine or linear decay to ``min_lr_ratio``."""
    warmup = min(preset.warmup_steps, max(total // 10, 1))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    if preset.schedule == "linear":
        decay = 1 - progress
    else:
        decay = 0.5 * (1 + math.cos(math.pi * progress))
    return preset.min_lr_ratio + (1 - preset.min_lr_ratio) * decay


def _newton_schulz(grad: torch.Tensor, steps: int = 5, bf16: bool = True) -> torch.Tensor:
    """An approximately orthogonal matrix with ``grad``'s singular vectors (the quintic
    Newton-Schulz iteration of Muon, in bf16: its result only needs to be roughly right;
    ``bf16=False``: in float32, where bf16 matmuls would be emulated, and slower)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = grad.to(torch.bfloat16 if bf16 else torch.float32)
    wide = x.size(0) <= x.size(1)
    if not wide:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.T).float()


class Muon(torch.optim.Optimizer):
    """Muon: SGD momentum (Nesterov) whose update is orthogonalised before it is applied.

    For 2-D hidden weight matrices only (embeddings, head and norms go to AdamW). Each update
    has all singular values near 1, scaled by ``sqrt(max(1, rows / cols))``; it moves every
    direction of a matrix at the same rate, which is what makes a few hundred steps enough.
    """

    def __init__(self, params, lr: float, momentum: float = 0.95, bf16: bool = True):
        super().__init__(params, {"lr": lr, "momentum": momentum})
        self.bf16 = bf16  # the Newton-Schulz iteration's dtype (see _newton_schulz)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                buf = state["momentum"]
                buf.mul_(group["momentum"]).add_(p.grad)
                update = _newton_schulz(p.grad.add(buf, alpha=group["momentum"]), bf16=self.bf16)
                scale = max(1.0, p.size(0) / p.size(1)) ** 0.5
                p.add_(update, alpha=-group["lr"] * scale)


def _is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    return param.dim() == 2 and "embed" not in name and "lm_head" not in name


def make_optimizers(model: torch.nn.Module, preset: Preset) -> list[torch.optim.Optimizer]:
    """AdamW (weight decay on matrices only, not norms or biases), plus Muon for the hidden
    matrices when the preset has a ``muon_lr``. Each param group remembers its peak lr."""
    named = list(model.named_parameters())
    muon = [p for n, p in named if preset.muon_lr is not None and _is_hidden_matrix(n, p)]
    muon_ids = {id(p) for p in muon}
    rest = [p for _, p in named if id(p) not in muon_ids]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": preset.weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    # foreach=False: one fixed per-tensor update order, no fused-kernel surprises.
    opts: list[torch.optim.Optimizer] = [
        torch.optim.AdamW(groups, lr=preset.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    ]
    if muon:
        opts.append(Muon(muon, lr=preset.muon_lr, bf16=bf16_matmuls(preset)))
    for opt in opts:
        for group in opt.param_groups:
            group["peak_lr"] = group["lr"]
    return opts


def _loss(model: torch.nn.Module, window: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=window[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), window[:, 1:].reshape(-1))


def _autocast(preset: Preset):
    if bf16_matmuls(preset):
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return nullcontext()


@torch.no_grad()
def evaluate(model: torch.nn.Module, preset: Preset, stream: torch.Tensor) -> float:
    """Mean loss per token over the first ``preset.val_windows`` non-overlapping
    ``context_len`` windows of ``stream`` (all of them if there are fewer)."""
    model.eval()
    n = (len(stream) - 1) // preset.context_len
    starts = torch.arange(min(n, preset.val_windows)) * preset.context_len
    total = 0.0
    for chunk in starts.split(max(1, preset.tokens_per_step // preset.context_len)):
        window = batch_windows(stream, chunk, preset.context_len)
        with _autocast(preset):
            logits = model(input_ids=window[:, :-1]).logits
        total += F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), window[:, 1:].reshape(-1), reduction="sum"
        ).item()
    model.train()
    return total / max(len(starts) * preset.context_len, 1)


@torch.no_grad()
def sample_text(model: torch.nn.Module, tokenizer, preset: Preset, seed: int) -> str:
    """A seeded sample (temperature 0.8, top-k 40) continuing ``preset.sample_prompt``."""
    model.eval()
    ids = tokenizer(preset.sample_prompt, add_special_tokens=False, return_tensors="pt")
    prompt_len = ids["input_ids"].shape[1]
    new = min(preset.sample_tokens, preset.context_len - prompt_len)
    gen = torch.Generator().manual_seed(seed)
    out = ids["input_ids"]
    for _ in range(new):
        # No KV cache: short samples, and one code path for both architectures.
        logits = model(input_ids=out[:, -preset.context_len :]).logits[0, -1].float() / 0.8
        top = torch.topk(logits, 40)
        probs = torch.softmax(top.values, dim=-1)
        nxt = top.indices[torch.multinomial(probs, 1, generator=gen)]
        if nxt.item() == tokenizer.eos_token_id:
            break
        out = torch.cat([out, nxt.view(1, 1)], dim=1)
    model.train()
    return tokenizer.decode(out[0], skip_special_tokens=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextmanager
def _training_env(seed: int, threads: int | None):
    """Seed torch, make algorithms deterministic, pin the thread count, quiet transformers.

    Everything is restored afterwards: ``train`` may run inside a caller's process (``infer
    train --out``, a script), so no global state may leak out of a build.
    """
    import torch.utils.deterministic as det
    from transformers.utils import logging as hf_logging

    was_det = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = det.fill_uninitialized_memory
    was_threads = torch.get_num_threads()
    was_verbosity = hf_logging.get_verbosity()
    was_bars = hf_logging.is_progress_bar_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Deterministic mode also fills every new tensor with NaN, which cost a quarter of a
        # training step; every tensor here is written before it is read, so skip that.
        det.fill_uninitialized_memory = False
        if threads is not None:
            torch.set_num_threads(threads)
        # Training windows contain <|endoftext|> (= pad id) by design: no padding warning,
        # and no "writing shards" bar under our own progress bar.
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(was_det, warn_only=was_warn)
            det.fill_uninitialized_memory = was_fill
            torch.set_num_threads(was_threads)
            hf_logging.set_verbosity(was_verbosity)
            if was_bars:
                hf_logging.enable_progress_bar()


def train(
    preset: Preset,
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps: int | None = None,
    progress: bool = True,
    docs: list[str] | None = None,
) -> TrainResult:
    """Train ``preset`` for ``steps`` (default: the preset's) and save it into ``out_dir``.

    ``docs`` replaces the corpus (tests); by default it is :func:`infer.data.corpus.load_corpus`.
    ``progress`` shows a tqdm bar on stderr with the step, loss and tokens/s.
    """
    from tqdm import tqdm
    from transformers import GenerationConfig

    from infer.data.corpus import load_corpus

    steps = preset.steps if steps is None else steps
    if steps < 1:
        raise ValueError("steps must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_docs, val_docs = split_docs(load_corpus() if docs is None else docs)
    # The tokenizer learns from the training split of the corpus only; the extra training
    # documents (if the preset has them) are never held out and never shape the vocabulary.
    tokenizer = build_tokenizer(preset, out, train_docs)
    if preset.api_docstrings and docs is None:
        train_docs = train_docs + training_docs(val_docs)
    train_ids = encode_stream(tokenizer, train_docs)
    val_ids = encode_stream(tokenizer, val_docs)
    longest = max(preset.seq_len, preset.final_seq_len or 0)
    if len(train_ids) <= longest + 1:
        raise ValueError("corpus too small for one training window")

    with _training_env(seed, preset.threads):
        model = build_model(preset)
        model.train()
        num_params = sum(p.numel() for p in model.parameters())
        opts = make_optimizers(model, preset)
        data_gen = torch.Generator().manual_seed(seed)
        losses: list[float] = []
        bar = tqdm(
            total=steps,
            desc=f"training {preset.name}",
            unit="step",
            disable=not progress,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        t0 = time.perf_counter()
        for step in range(steps):
            ratio = lr_ratio(preset, step, steps)
            for opt in opts:
                for group in opt.param_groups:
                    group["lr"] = group["peak_lr"] * ratio
            windows, length = preset.window_shape(step, steps)
            high = len(train_ids) - length - 1
            starts = torch.randint(0, high + 1, (windows,), generator=data_gen)
            with _autocast(preset):
                loss = _loss(model, batch_windows(train_ids, starts, length))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), preset.grad_clip, foreach=False)
            for opt in opts:
                opt.step()
            model.zero_grad(set_to_none=True)
            losses.append(loss.item())
            elapsed = time.perf_counter() - t0
            bar.update(1)
            bar.set_postfix(
                loss=f"{losses[-1]:.3f}",
                tok_s=f"{(step + 1) * preset.tokens_per_step / elapsed:,.0f}",
                refresh=False,
            )
        bar.close()
        elapsed = time.perf_counter() - t0
        val_loss = (
            evaluate(model, preset, val_ids)
            if len(val_ids) > preset.context_len + 1
            else float("nan")
        )
        sample = sample_text(model, tokenizer, preset, seed)
        # Generation stops at <|endoftext|> and, for chat, at <|im_end|>.
        model.generation_config = GenerationConfig(
            bos_token_id=0, eos_token_id=[0, 2], pad_token_id=0, max_length=preset.context_len
        )
        model.save_pretrained(out)

    tail = losses[-max(1, steps // 10) :]
    final_loss = sum(tail) / len(tail)
    digest = sha256_file(out / WEIGHTS)
    manifest = {
        "preset": preset.name,
        "description": preset.description,
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "steps": steps,
        "num_params": num_params,
        "tokens_seen": steps * preset.tokens_per_step,
        "train_tokens": len(train_ids),
        "final_loss": round(final_loss, 4),
        "val_loss": round(val_loss, 4),
        "sample_prompt": preset.sample_prompt,
        "sample": sample,
        "weights_sha256": digest,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "torch": torch.__version__,
        "bf16_matmuls": bf16_matmuls(preset),
    }
    # Written last: its presence marks a finished folder (cache.py also renames atomically).
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return TrainResult(
        out_dir=out,
        preset=preset.name,
        seed=seed,
        steps=steps,
        num_params=num_params,
        losses=losses,
        final_loss=final_loss,
        val_loss=val_loss,
        sample=sample,
        weights_sha256=digest,
        elapsed_s=elapsed,
        tokens_per_s=steps * preset.tokens_per_step / elapsed,
    )

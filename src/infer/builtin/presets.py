"""The recipes of the built-in models: architecture, tokenizer and training schedule.

A preset fully determines its model together with a seed and a step count: the corpus is the
running Python's own documentation, the data order comes from the seed, and nothing is
downloaded. Bump :data:`RECIPE_VERSION` whenever a change here (or in the training code) would
change the weights a preset produces, so cached builds of the old recipe are not reused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Literal

# Part of every cache path: a recipe change must never silently reuse old weights.
RECIPE_VERSION = 2

DEFAULT_SEED = 0

# What a finished build writes beside its weights: the recipe, the losses, the checksums.
MANIFEST = "infer_builtin.json"


@dataclass(frozen=True)
class Preset:
    """One built-in model recipe.

    ``context_len`` is the model's maximum position count (``n_positions`` /
    ``max_position_embeddings``); ``seq_len`` is the training window, at most that.
    ``intermediate_size`` is the MLP width (GPT-2: the usual 4x hidden; Llama: the SwiGLU width).
    """

    name: str
    description: str
    arch: Literal["gpt2", "llama"]
    tokenizer: Literal["char", "bpe"]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    context_len: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    # Decay after warmup: cosine or linear, down to ``min_lr_ratio`` of the peak at the end.
    schedule: Literal["cosine", "linear"] = "cosine"
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # Muon (momentum orthogonalised by a Newton-Schulz iteration) for the hidden weight
    # matrices at this peak learning rate; ``lr`` (AdamW) then trains only the embeddings and
    # norms. None: AdamW for everything.
    muon_lr: float | None = None
    # Start the residual branches' output projections (attention o_proj, MLP down_proj) at
    # zero, so every block begins as the identity.
    zero_init_residual: bool = False
    # The last ``final_frac`` of the steps train on ``final_seq_len``-token windows (same
    # tokens per step, fewer windows), so a model trained mostly on short windows learns the
    # positions up to its full context.
    final_seq_len: int | None = None
    final_frac: float = 0.0
    # Also train (never validate) on the docstrings of the standard library's public
    # functions, classes and methods; see :func:`infer.builtin.textdata.training_docs`.
    api_docstrings: bool = False
    # Held-out loss: the mean over up to this many non-overlapping ``context_len`` windows of
    # the held-out documents.
    val_windows: int = 32
    # bf16 autocast matmuls (AMX / tensor cores); master weights and saved weights stay fp32.
    bf16_autocast: bool = False
    # Training threads; None keeps torch's default. The toy's ops are too small to split, and
    # one thread also makes its weights independent of the machine's core count.
    threads: int | None = None
    sample_prompt: str = "The"
    sample_tokens: int = 100

    def __post_init__(self) -> None:
        if self.seq_len > self.context_len:
            raise ValueError(f"{self.name}: seq_len {self.seq_len} > context {self.context_len}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: heads must divide hidden size and kv heads divide heads"
            )
        if self.arch == "gpt2" and self.num_kv_heads != self.num_heads:
            raise ValueError("GPT-2 has no grouped-query attention")
        if self.final_seq_len is not None:
            if self.final_seq_len > self.context_len:
                raise ValueError(f"{self.name}: final_seq_len {self.final_seq_len} > context")
            if self.tokens_per_step % self.final_seq_len:
                raise ValueError(f"{self.name}: final_seq_len must divide the tokens per step")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def window_shape(self, step: int, steps: int) -> tuple[int, int]:
        """(windows, window length) of training step ``step`` of ``steps``."""
        if self.final_seq_len is not None and step >= steps * (1 - self.final_frac):
            return self.tokens_per_step // self.final_seq_len, self.final_seq_len
        return self.batch_size, self.seq_len


# A minimal character-level NanoGPT, the size commonly used to benchmark NanoGPT on a CPU:
# 4 layers, 4 heads, 32 wide, a 64-character context. Its character vocabulary is printable
# ASCII plus a few typographic characters (120 ids with the special tokens), which with GPT-2's
# tied embeddings gives 56,768 parameters -- that benchmark model reports 0.056769M.
TOY = Preset(
    name="toy",
    description="tiny NanoGPT benchmark model: GPT-2, 0.057M params, char-level, context 64",
    arch="gpt2",
    tokenizer="char",
    vocab_size=120,
    hidden_size=32,
    num_layers=4,
    num_heads=4,
    num_kv_heads=4,
    intermediate_size=128,
    context_len=64,
    seq_len=64,
    batch_size=32,
    steps=2000,
    lr=3e-3,
    warmup_steps=50,
    weight_decay=0.0,
    threads=1,
    sample_tokens=60,
    val_windows=256,
)

# Built in two to four minutes on two CPU cores (the previous recipe, an 11M Llama trained for
# 480 AdamW steps of 4 x 1024 tokens, took ~9 minutes for a held-out loss of 5.24; this one
# gets 4.92 on the same measure). docs/builtin-models.md has the measurements; in short:
# - Muon for the hidden matrices and zero-initialised residual outputs: the loss leaves the
#   unigram plateau within ~20 steps instead of ~50 and needs far fewer tokens.
# - At a fixed time budget the step count matters most: 240 steps of a 4 x 256 model beat
#   160 steps of 6 x 384 that take twice as long.
# - 256-token windows for all but the last 10% of the steps, which use 1024-token windows to
#   learn the positions up to the full context (attention over 1024 tokens is costly).
# - The stdlib's API docstrings as extra training text: less memorising of a small corpus.
# - A linear decay to ~0.
# Grouped-query attention (4 query / 2 KV heads) so the default model exercises that path of
# the engine too.
SMALL = Preset(
    name="small",
    description="Llama, 4.2M params, byte-level BPE (4096), context 1024, English prose",
    arch="llama",
    tokenizer="bpe",
    vocab_size=4096,
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=768,
    context_len=1024,
    seq_len=256,
    batch_size=8,
    steps=240,
    lr=6e-3,
    warmup_steps=10,
    min_lr_ratio=0.02,
    schedule="linear",
    weight_decay=0.0,
    muon_lr=0.03,
    zero_init_residual=True,
    final_seq_len=1024,
    final_frac=0.1,
    api_docstrings=True,
    bf16_autocast=True,
)

# The draft model of `small` for speculative decoding: the same corpus, the same tokenizer
# (a BPE trained on the same documents with the same vocabulary size is the same tokenizer;
# the engine checks the vocabularies match), ~1M parameters, 2 layers x 128. Most of its
# weights are the 4096 x 128 embedding. Proposals need only be right often, and cheap.
SMALL_DRAFT = replace(
    SMALL,
    name="small-draft",
    description="Llama, 0.9M params, the draft model of small (same tokenizer), context 1024",
    hidden_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=384,
)

PRESETS: dict[str, Preset] = {p.name: p for p in (TOY, SMALL, SMALL_DRAFT)}
BUILTIN_NAMES: tuple[str, ...] = tuple(PRESETS)


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ``ValueError`` naming the built-ins for anything else."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown built-in model {name!r}; the built-ins are: {', '.join(BUILTIN_NAMES)}"
        ) from None


BF16_ENV = "INFER_BUILTIN_BF16"
"""``1`` / ``0`` (or ``true`` / ``false``): a preset that asks for bf16 (autocast matmuls, Muon's
Newton-Schulz) trains with it / in float32, whatever the CPU. Default: with it where the CPU
multiplies bf16 in hardware (:func:`native_bf16`)."""


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX). Elsewhere torch
    emulates bf16 matmuls: on a 2-core AVX2-only EPYC a step of ``small`` took 24 s in bf16
    against 0.7 s in float32."""
    from infer.runner.cpu.kernels import cpu_flags_line  # (the CPU kernels read it too)

    return not {"avx512_bf16", "amx_bf16"}.isdisjoint(cpu_flags_line().partition(":")[2].split())


def bf16_matmuls(preset: Preset) -> bool:
    """Whether ``preset`` trains its matmuls in bf16 here (see :data:`BF16_ENV`): part of its
    cache folder's name, as the weights differ."""
    if not preset.bf16_autocast:
        return False
    forced = os.environ.get(BF16_ENV, "").strip().lower()
    if forced in ("1", "true"):
        return True
    if forced in ("0", "false"):
        return False
    if forced:
        raise ValueError(f"{BF16_ENV}={forced!r}: use 1 or 0 (unset: bf16 where the CPU has it)")
    return native_bf16()

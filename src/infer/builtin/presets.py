"""The recipes of the built-in models: architecture, tokenizer and training schedule.

A preset fully determines its model together with a seed and a step count: the corpus is the
running Python's own documentation, the data order comes from the seed, and nothing is
downloaded. Bump :data:`RECIPE_VERSION` whenever a change here (or in the training code) would
change the weights a preset produces, so cached builds of the old recipe are not reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Part of every cache path: a recipe change must never silently reuse old weights.
RECIPE_VERSION = 1

DEFAULT_SEED = 0


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
    weight_decay: float = 0.1
    grad_clip: float = 1.0
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

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


# The NanoGPT of the reference articles: 4 layers, 4 heads, 32 wide, a 64-character context.
# Its character vocabulary is printable ASCII plus a few typographic characters (120 ids with
# the special tokens), which with GPT-2's tied embeddings gives 56,768 parameters -- the
# article's model reports 0.056769M.
TOY = Preset(
    name="toy",
    description="NanoGPT of the reference articles: GPT-2, 0.057M params, char-level, context 64",
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
)

# Sized by measurement on a 2-core AMX Xeon: bf16 autocast trains this 11M Llama at ~3,600
# tokens/s (2.5x fp32), so 480 steps of 4 x 1024 tokens (~2M tokens, ~15 passes over the
# 133k-token training split) take about 9 minutes. The loss is still falling fast when the
# cosine schedule anneals; samples read as the Python docs' English. Grouped-query attention
# (6 query / 2 KV heads) so the default model exercises that path of the engine too.
SMALL = Preset(
    name="small",
    description="Llama, 11M params, byte-level BPE (4096), context 1024, English prose",
    arch="llama",
    tokenizer="bpe",
    vocab_size=4096,
    hidden_size=384,
    num_layers=6,
    num_heads=6,
    num_kv_heads=2,
    intermediate_size=1024,
    context_len=1024,
    seq_len=1024,
    batch_size=4,
    steps=480,
    lr=2e-3,
    warmup_steps=30,
    bf16_autocast=True,
)

PRESETS: dict[str, Preset] = {p.name: p for p in (TOY, SMALL)}
BUILTIN_NAMES: tuple[str, ...] = tuple(PRESETS)


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ``ValueError`` naming the built-ins for anything else."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown built-in model {name!r}; the built-ins are: {', '.join(BUILTIN_NAMES)}"
        ) from None

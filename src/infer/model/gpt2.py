"""GPT-2 and the NanoGPT family saved in its format: learned positions, LayerNorm, GELU MLP.

Checkpoints store Conv1D weights as ``[in, out]``; they are transposed to ``nn.Linear`` at load.
Tensor names come with a ``transformer.`` prefix (``GPT2LMHeadModel.save_pretrained``) or
without one (the original OpenAI conversion); both load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.model.layers import CausalLM, WeightSource, activation, embedding, transposed
from infer.model.parallel import (
    COLUMN,
    ROW,
    ROW_BIAS,
    VOCAB,
    Shard,
    get_tensor_parallel,
)

if TYPE_CHECKING:  # the attention backend is the runner's: models only call it
    from infer.model.attention import Attention


@dataclass(frozen=True)
class GPT2Config:
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_position_embeddings: int
    intermediate_size: int
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True  # GPT-2's own checkpoints tie; a fine-tune may not

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _get(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is None:
        raise ValueError(f"config.json has no {keys[0]!r}")
    return default


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # Tensor parallelism: this rank's heads (column-parallel c_attn, row-parallel c_proj).
        self.tp = get_tensor_parallel()
        self.num_heads = self.tp.local(cfg.num_heads, "n_head")
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1
        width = self.num_heads * self.head_dim
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * width)
        self.c_proj = nn.Linear(width, cfg.hidden_size)

    def forward(self, x: torch.Tensor, attn: Attention) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.c_attn(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        out = attn.attend(self.layer_idx, q, k, v, scale=self.scale)
        return self.tp.all_reduce(self.c_proj(out.reshape(t, self.num_heads * self.head_dim)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.tp = get_tensor_parallel()
        width = self.tp.local(cfg.intermediate_size, "n_inner")
        self.c_fc = nn.Linear(cfg.hidden_size, width)
        self.c_proj = nn.Linear(width, cfg.hidden_size)
        self.act = activation(cfg.activation)

    def forward(self, x: torch.Tensor, attn: Attention) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn)
        return x + self.tp.all_reduce(self.c_proj(self.act(self.c_fc(self.ln_2(x)))))


class GPT2LMHeadModel(CausalLM):
    architecture = "GPT2LMHeadModel"
    checkpoint_aliases = (("transformer.", ""),)

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = get_tensor_parallel()
        self.wte = embedding(cfg.vocab_size, cfg.hidden_size, vocab_parallel=True)
        self.wpe = embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, self.tp.vocab_rows(cfg.vocab_size), bias=False)
        )

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> GPT2Config:
        hidden = _get(config, "n_embd", "hidden_size")
        heads = _get(config, "n_head", "num_attention_heads")
        if hidden % heads:
            raise ValueError(f"n_embd={hidden} is not a multiple of n_head={heads}")
        return GPT2Config(
            hidden_size=hidden,
            num_layers=_get(config, "n_layer", "num_hidden_layers"),
            num_heads=heads,
            vocab_size=_get(config, "vocab_size"),
            max_position_embeddings=_get(config, "n_positions", "max_position_embeddings"),
            intermediate_size=config.get("n_inner") or 4 * hidden,
            layer_norm_eps=config.get("layer_norm_epsilon", 1e-5),
            activation=config.get("activation_function", "gelu_new"),
            scale_attn_weights=config.get("scale_attn_weights", True),
            scale_attn_by_inverse_layer_idx=config.get("scale_attn_by_inverse_layer_idx", False),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        x = self.tp.embed(self.wte.weight, input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, attn)
        return self.ln_f(x)

    def vocab_projection_weight(self) -> torch.Tensor:
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_to_vocab(hidden).float()

    def weight_sources(self) -> dict[str, WeightSource]:
        p = "transformer."

        def plain(name: str, shard: Shard | None = None) -> WeightSource:
            return WeightSource((p + name,), shard=shard)

        def conv1d(name: str, shard: Shard) -> WeightSource:
            return WeightSource((p + name,), transposed, shard)

        src = {name: plain(name) for name in ("wpe.weight", "ln_f.weight", "ln_f.bias")}
        src["wte.weight"] = plain("wte.weight", VOCAB)
        if self.lm_head is not None:  # (outside "transformer.")
            src["lm_head.weight"] = WeightSource(("lm_head.weight",), shard=VOCAB)
        # c_attn is q, k and v side by side: each third is cut on its own.
        qkv = Shard(dim=0, parts=3)
        for i in range(self.cfg.num_layers):
            h = f"h.{i}"
            for ln in ("ln_1", "ln_2"):
                src[f"{h}.{ln}.weight"] = plain(f"{h}.{ln}.weight")
                src[f"{h}.{ln}.bias"] = plain(f"{h}.{ln}.bias")
            for ours, theirs, weight_shard, bias_shard in (
                ("attn.c_attn", "attn.c_attn", qkv, qkv),
                ("attn.c_proj", "attn.c_proj", ROW, ROW_BIAS),
                ("c_fc", "mlp.c_fc", COLUMN, COLUMN),
                ("c_proj", "mlp.c_proj", ROW, ROW_BIAS),
            ):
                src[f"{h}.{ours}.weight"] = conv1d(f"{h}.{theirs}.weight", weight_shard)
                src[f"{h}.{ours}.bias"] = plain(f"{h}.{theirs}.bias", bias_shard)
        return src

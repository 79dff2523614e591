"""Tiny random checkpoints of every supported architecture, saved as transformers would.

Each kind is built with transformers' own config and model classes (seeded random weights,
scaled up so greedy generation is not degenerate), saved with ``save_pretrained`` as
safetensors next to a small byte-level BPE tokenizer (vocab 1024, ChatML template) and a
``generation_config.json``. They exist to check our modules against transformers, and to give
the engine tests something real and fast to serve.

Builds are cached under a folder keyed by :data:`VERSION` (bump it when a recipe changes) and
made atomically: each kind is written to a temporary folder and renamed into place, so an
interrupted build is never picked up.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

VERSION = "v4"
KINDS = (
    "llama",
    "llama3",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "gpt2",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "llama_sharded",
)
VOCAB_SIZE = 1024
GEMMA3_SLIDING_WINDOW = 16
MISTRAL_SLIDING_WINDOW = 12
INIT_STD = 0.2
SEED = 1234

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def default_root() -> Path:
    """``$INFER_TEST_CACHE/checkpoints-<VERSION>``, else ``tests/.fixtures/`` of this checkout,
    else ``~/.cache/infer/``."""
    base = os.environ.get("INFER_TEST_CACHE")
    if base:
        root = Path(base).expanduser()
    else:
        repo = Path(__file__).resolve().parents[3]
        if (repo / "pyproject.toml").is_file() and (repo / "tests").is_dir():
            root = repo / "tests" / ".fixtures"
        else:
            root = Path("~/.cache/infer").expanduser()
    return root / f"checkpoints-{VERSION}"


def _llama_config(special: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_TINY, **special, num_hidden_layers=3, tie_word_embeddings=False)


def _llama3_config(special: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    # original_max_position_embeddings is small so the scaling changes positions we test.
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return LlamaConfig(
        **_TINY,
        **special,
        num_hidden_layers=2,
        rope_parameters=rope,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    )


def _mistral_config(special: dict[str, int]) -> Any:
    from transformers import MistralConfig

    return MistralConfig(
        **_TINY, **special, num_hidden_layers=2, sliding_window=MISTRAL_SLIDING_WINDOW
    )


def _qwen2_config(special: dict[str, int]) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        **_TINY, **special, num_hidden_layers=2, rope_theta=1_000_000.0, tie_word_embeddings=True
    )


def _qwen3_config(special: dict[str, int]) -> Any:
    from transformers import Qwen3Config

    # head_dim 32 != hidden / heads: the q/k/v widths must follow the config, not the division.
    return Qwen3Config(
        **_TINY, **special, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False
    )


def _gemma3_config(special: dict[str, int]) -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_TINY,
        **special,
        num_hidden_layers=4,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=GEMMA3_SLIDING_WINDOW,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        },
        final_logit_softcapping=30.0,
    )


def _mixtral_config(special: dict[str, int]) -> Any:
    from transformers import MixtralConfig

    # Every layer sparse: top-2 of 8 experts, each as wide as intermediate_size.
    return MixtralConfig(
        **{**_TINY, "intermediate_size": 64},
        **special,
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    )


def _qwen2_moe_config(special: dict[str, int]) -> Any:
    from transformers import Qwen2MoeConfig

    # Layer 1 stays dense (mlp_only_layers); top-3 of 8 small experts, not renormalised, and a
    # shared expert of its own width (a multiple of 32, as the CPU's packed kernels need).
    return Qwen2MoeConfig(
        **_TINY,
        **special,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    )


def _qwen3_moe_config(special: dict[str, int]) -> Any:
    from transformers import Qwen3MoeConfig

    # q/k norms and head_dim 32 as in qwen3; top-4 of 8 experts, renormalised.
    return Qwen3MoeConfig(
        **_TINY,
        **special,
        num_hidden_layers=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )


def _gpt2_config(special: dict[str, int]) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **special)


_RECIPES: dict[str, tuple[Callable[[dict[str, int]], Any], str]] = {
    "llama": (_llama_config, "LlamaForCausalLM"),
    "llama3": (_llama3_config, "LlamaForCausalLM"),
    "mistral": (_mistral_config, "MistralForCausalLM"),
    "qwen2": (_qwen2_config, "Qwen2ForCausalLM"),
    "qwen3": (_qwen3_config, "Qwen3ForCausalLM"),
    "gemma3": (_gemma3_config, "Gemma3ForCausalLM"),
    "gpt2": (_gpt2_config, "GPT2LMHeadModel"),
    "mixtral": (_mixtral_config, "MixtralForCausalLM"),
    "qwen2_moe": (_qwen2_moe_config, "Qwen2MoeForCausalLM"),
    "qwen3_moe": (_qwen3_moe_config, "Qwen3MoeForCausalLM"),
    "llama_sharded": (_llama_config, "LlamaForCausalLM"),
}


def _randomize(model: Any, seed: int) -> None:
    """Seeded weights, larger than transformers' init so outputs depend on every layer."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm = "norm" in name or ".ln_" in name or name.endswith("ln_f.weight")
            if is_norm and name.endswith("weight"):
                # Gemma norms scale by (1 + w): centre them on 0; everyone else's on 1.
                centre = 0.0 if "Gemma" in type(model).__name__ else 1.0
                param.copy_(centre + 0.1 * noise)
            elif "Gemma" in type(model).__name__ and "embed_tokens" in name:
                # Gemma multiplies embeddings by sqrt(hidden); undo that so the residual stream
                # is not just the current token's embedding (which makes greedy output repeat it).
                param.copy_(INIT_STD / model.config.hidden_size**0.5 * noise)
            else:
                param.copy_(INIT_STD * noise)


def _tokenizer(root: Path) -> Path:
    """Train the shared tokenizer once per cache folder."""
    from infer.data.train_tokenizer import train_bpe_tokenizer

    final = root / "tokenizer"
    if not final.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-tokenizer-", dir=root))
        train_bpe_tokenizer(tmp, vocab_size=VOCAB_SIZE)
        _publish(tmp, final)
    return final


def build_once(final: Path, write: Callable[[Path], None]) -> Path:
    """The folder ``final``, unless it is there already: ``write`` fills a temporary folder
    beside it, published whole (:func:`_publish`), removed if ``write`` fails."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        write(tmp)
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _publish(tmp: Path, final: Path) -> None:
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any build output
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first


def build_tiny_checkpoint(kind: str, root: Path) -> Path:
    """The folder ``root/kind`` holding a tiny checkpoint of ``kind``; built if absent."""
    if kind not in _RECIPES:
        raise ValueError(f"unknown checkpoint kind {kind!r} (kinds: {', '.join(KINDS)})")
    root = Path(root)
    final = root / kind
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tok_dir = _tokenizer(root)

    import torch
    import transformers
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    eos = tokenizer.eos_token_id
    special = {"vocab_size": VOCAB_SIZE, "bos_token_id": eos, "eos_token_id": eos}
    special["pad_token_id"] = eos
    make_config, arch = _RECIPES[kind]
    config = make_config(special)
    config.architectures = [arch]
    torch.manual_seed(SEED)
    model = getattr(transformers, arch)(config).to(torch.float32)
    # Seeded by name so adding a kind never changes the others; "_sharded" shares the weights.
    _randomize(model, SEED + zlib.crc32(kind.removesuffix("_sharded").encode()) % 10_000)

    def write(tmp: Path) -> None:
        shard = {"max_shard_size": "100KB"} if kind.endswith("_sharded") else {}
        model.save_pretrained(tmp, safe_serialization=True, **shard)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(tmp)

    return build_once(final, write)


def build_classifier(kind: str, root: Path, num_labels: int = 1) -> Path:
    """The folder ``root/<kind>-classifier-<num_labels>``: ``kind``'s architecture as a
    transformers sequence classifier (``LlamaForSequenceClassification``, ...: the decoder and a
    ``score`` head, no vocabulary projection) with ``num_labels`` labels; built if absent."""
    from infer.model.registry import CLASSIFIERS, model_class

    root = Path(root)
    final = root / f"{kind}-classifier-{num_labels}"
    if final.is_dir():
        return final
    source = build_tiny_checkpoint(kind, root)

    import torch
    import transformers
    from transformers import AutoTokenizer

    make_config, arch = _RECIPES[kind]
    name = next(
        n for n, cls in CLASSIFIERS.items() if cls is model_class({"architectures": [arch]})[1]
    )
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    eos = tokenizer.eos_token_id
    config = make_config({"vocab_size": VOCAB_SIZE, "bos_token_id": eos, "eos_token_id": eos,
                          "pad_token_id": eos})  # fmt: skip
    config.architectures = [name]
    config.num_labels = num_labels
    config.id2label = {i: f"label_{chr(ord('a') + i)}" for i in range(num_labels)}
    config.label2id = {v: k for k, v in config.id2label.items()}
    torch.manual_seed(SEED)
    model = getattr(transformers, name)(config).to(torch.float32)
    _randomize(model, SEED + zlib.crc32(final.name.encode()) % 10_000)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return build_once(final, write)


def build_all(root: Path | None = None) -> dict[str, Path]:
    """Every kind in :data:`KINDS` under ``root`` (default :func:`default_root`)."""
    root = Path(root) if root is not None else default_root()
    return {kind: build_tiny_checkpoint(kind, root) for kind in KINDS}

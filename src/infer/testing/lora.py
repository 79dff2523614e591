"""LoRA adapters for the tiny checkpoints, made with PEFT (the test extra) as a user would.

PEFT starts ``lora_B`` at zero (an adapter that changes nothing); :func:`build_lora_adapter`
fills both matrices with seeded noise so each adapter moves the logits, then saves the folder
with ``save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_adapter(
    base: Path,
    out: Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ALL_PROJECTIONS,
    seed: int = 0,
    std: float = 0.1,
    use_rslora: bool = False,
    **lora_options,
) -> Path:
    """A PEFT LoRA adapter of ``base`` (a transformers folder) at ``out``; built if absent."""
    out = Path(out)
    if out.is_dir():
        return out
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        use_rslora=use_rslora, lora_dropout=0.0, **lora_options)  # fmt: skip
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(std * torch.randn(param.shape, generator=gen))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        peft_model.save_pretrained(str(tmp))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not out.is_dir():
            raise
    return out

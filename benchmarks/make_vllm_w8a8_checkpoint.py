"""Write a Llama checkpoint as vLLM's own int8 W8A8 format (compressed-tensors: int8 weights
with a scale per output channel, activations quantized per token at run time), so that
`infer bench vs-vllm --infer-args="--quantization w8a8" --vllm-model OUT` compares the two
engines at the same numerics: infer quantizes the bf16 folder at load, vLLM reads the same
integers from OUT. The weights are quantized by infer's own `quantize_int8`; the vocabulary
projection stays bf16 in OUT (vLLM does not take it quantized), while infer's w8a8 quantizes it.

    python benchmarks/make_vllm_w8a8_checkpoint.py [--model DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from infer.runner.quant import quantize_int8
from infer.testing.bench_models import llama_100m

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def convert(src: Path, dst: Path) -> int:
    """Write ``src`` (a bf16 Llama folder, one safetensors file) as W8A8 into ``dst``; returns
    how many weights were quantized."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    tensors = {}
    count = 0
    for name, value in load_file(src / "model.safetensors").items():
        if name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS):
            q, scale = quantize_int8(value)
            tensors[name] = q.contiguous()
            tensors[name.removesuffix("weight") + "weight_scale"] = (
                scale[:, None].to(value.dtype).contiguous()
            )
            count += 1
        else:
            tensors[name] = value
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "dynamic": False},
                "input_activations": {**int8, "strategy": "token", "dynamic": True},
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="bf16 Llama folder (default: the bench model)")
    p.add_argument("--out", default=None, help="default: the model folder's name + -w8a8")
    a = p.parse_args()
    src = llama_100m(a.model)
    dst = Path(a.out) if a.out else src.with_name(src.name + "-w8a8")
    print(f"quantized {convert(src, dst)} weights -> {dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

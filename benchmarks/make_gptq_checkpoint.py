"""Write a bf16 Llama-family folder as a 4-bit GPTQ checkpoint (what `*-GPTQ-Int4` folders hold),
to serve the same 4-bit weights from infer and from engines that read GPTQ (vLLM).

    python benchmarks/make_gptq_checkpoint.py SRC DST [--group-size 128] [--asymmetric]

Each decoder linear (q/k/v/o, gate/up/down) is quantized with infer's own group-wise
round-to-nearest (:func:`infer.runner.int4.quantize_int4`; no calibration, so not GPTQ's error
feedback: the format is GPTQ's, the rounding is plain), then packed as AutoGPTQ stores it:
``qweight`` [in / 8, out] int32 (8 input rows per int32, lowest nibble first), ``qzeros``
[groups, out / 8] int32 holding zero - 1 (the "gptq" checkpoint format), ``scales`` [groups,
out] float16, ``g_idx`` [in] int32. The embedding, norms and vocabulary projection stay bf16.
Symmetric by default (zero 8, ``sym: true``: what most GPTQ checkpoints are); with
``--asymmetric`` a group whose zero is 0 cannot be written in this format (0 - 1 wraps), and the
script says so.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from infer.runner.int4 import quantize_int4

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _int32(x: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns (< 2^32) as the int32s a checkpoint stores."""
    return torch.from_numpy(x.numpy().astype(np.uint32).view(np.int32))


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[in, out] 4-bit values -> [in / 8, out] int32, value k of row r = q[8 r + k]."""
    out = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for k in range(8):
        out |= q[k::8].long() << (4 * k)
    return _int32(out)


def pack_cols(q: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit values -> [R, C / 8] int32, value k of column c = q[:, 8 c + k]."""
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for k in range(8):
        out |= q[:, k::8].long() << (4 * k)
    return _int32(out)


def convert(src: Path, dst: Path, group_size: int, symmetric: bool) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and f.name != "model.safetensors.index.json"
        ):
            shutil.copy(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and layer.split(".")[-1] in LINEARS):
            out[name] = t
            continue
        q, scales, zeros = quantize_int4(t, group_size, symmetric)  # [out, in], [out, G]
        in_features = t.shape[1]
        group = in_features if group_size == -1 else group_size
        out[layer + ".qweight"] = pack_rows(q.t().contiguous())
        if int(zeros.min()) == 0:
            raise SystemExit(f"{layer}: a group with zero 0 (all its weights >= 0) cannot be "
                             "stored in the gptq format (zero - 1); use the symmetric default")  # fmt: skip
        out[layer + ".qzeros"] = pack_cols((zeros.t().long() - 1).contiguous())  # "gptq": zero - 1
        out[layer + ".scales"] = scales.t().contiguous()
        out[layer + ".g_idx"] = (torch.arange(in_features) // group).int()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
        "sym": symmetric, "checkpoint_format": "gptq", "true_sequential": True,
        "damp_percent": 0.01, "static_groups": False,
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asymmetric", action="store_true")
    args = p.parse_args()
    convert(args.src, args.dst, args.group_size, not args.asymmetric)
    print(f"wrote {args.dst}")


if __name__ == "__main__":
    main()

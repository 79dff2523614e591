"""`infer plan`: KV-cache capacity planning without loading weights.

    bytes_per_token = 2 x layers x kv_heads x (head_dim x dtype_bytes + scale_bytes)
                      (K and V, every layer; int8 / fp8 caches keep a 2-byte scale per row)
    kv_budget       = memory - weights
    context/user    = kv_budget / concurrency / bytes_per_token
    users           = kv_budget / (context x bytes_per_token)

Reads the shape from a model folder's config.json and the weight count from the safetensors
headers (no tensor is loaded), or takes a published shape from flags, e.g. Llama 3.1 70B:
``infer plan --layers 80 --kv-heads 8 --heads 64 --head-dim 128 --weights 140GB --memory 320GB
--concurrency 50``.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infer.engine.args import byte_size
from infer.kv_cache.sizing import kv_bytes_per_token, kv_value_bytes
from infer.model.gguf_folder import FLOAT_TYPES, gguf_source, gguf_tensors

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "int8": 1, "fp8": 1}  # fmt: skip


@dataclass(frozen=True)
class CapacityPlan:
    num_layers: int
    num_kv_heads: int
    num_heads: int | None
    head_dim: int
    kv_dtype_bytes: int
    weights_bytes: int
    memory_bytes: int
    concurrency: int
    context_len: int
    block_size: int = 16
    kv_scale_bytes: int = 0  # per row of head_dim values (int8 / fp8 caches)
    encoder: bool = False  # a BERT-family encoder: it embeds, and holds no KV cache

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype_bytes,
            self.kv_scale_bytes,
        )  # fmt: skip

    @property
    def bytes_per_sequence(self) -> int:
        return self.bytes_per_token * self.context_len

    @property
    def mha_bytes_per_sequence(self) -> int | None:
        """The same sequence without GQA (one KV head per query head)."""
        if self.num_heads is None:
            return None
        mha = kv_bytes_per_token(
            self.num_layers, self.num_heads, self.head_dim, self.kv_dtype_bytes,
            self.kv_scale_bytes,
        )  # fmt: skip
        return mha * self.context_len

    @property
    def kv_budget_bytes(self) -> int:
        return max(self.memory_bytes - self.weights_bytes, 0)

    @property
    def kv_tokens(self) -> int:
        return self.kv_budget_bytes // self.bytes_per_token

    @property
    def kv_blocks(self) -> int:
        return self.kv_tokens // self.block_size

    @property
    def max_context_per_user(self) -> int:
        return self.kv_budget_bytes // self.concurrency // self.bytes_per_token

    @property
    def max_users_at_context(self) -> int:
        return self.kv_budget_bytes // self.bytes_per_sequence


def safetensors_num_params(model_dir: Path) -> int:
    """Parameter count from safetensors headers only (8-byte length + JSON), no tensor data.

    A GPTQ / AWQ folder counts each packed ``qweight`` as the weights it unpacks to and leaves
    out its zeros, scales and group indices."""
    qc = _quantization_config(model_dir)
    per_int32 = 32 // int(qc.get("bits", qc.get("w_bit", 4))) if qc else 1
    total = 0
    for name, count in _tensor_sizes(model_dir):
        if qc and name.endswith((".qzeros", ".scales", ".g_idx")):
            continue
        total += count * per_int32 if qc and name.endswith(".qweight") else count
    return total


def safetensors_weight_bytes(
    model_dir: Path,
    dtype_bytes: int,
    gguf_int8: bool | None = None,
    gguf_int8_activations: bool = True,
    gguf_kernels: bool | None = None,
) -> int:
    """Bytes of the weights as the engine holds them, from the safetensors headers: every tensor
    at ``dtype_bytes`` per value, but a 4-bit GPTQ / AWQ layer as it stays (half a byte per
    weight, and per group and output a float16 scale and a one-byte zero); 8-bit GPTQ layers
    are dequantized at load, so they count as the weights they unpack to. A GGUF file's
    folder: :func:`_gguf_weight_bytes` (``gguf_int8``: ``--gguf-int8``, None as the engine
    decides: :func:`~infer.runner.quant.gguf_int8_default` on this machine's CPU;
    ``gguf_int8_activations``: ``--gguf-int8-activations``; ``gguf_kernels``: whether the CPU
    kernels that hold a GGUF file's layers as stored run, None: those of this machine's CPU,
    as the engine asks; without them every weight is held dequantized)."""
    gguf_file = gguf_source(model_dir)
    if gguf_file is not None:
        import torch

        cpu = torch.device("cpu")
        if gguf_int8 is None:
            from infer.model.loader import load_model_spec
            from infer.runner.quant import gguf_int8_default

            gguf_int8 = gguf_int8_default(load_model_spec(model_dir).is_encoder, cpu)
        if gguf_kernels is None:
            from infer.runner.int4 import int4_kernel_available

            gguf_kernels = int4_kernel_available(cpu)
            gguf_int8_activations &= int4_kernel_available(cpu, int8_activations=True)
        if not gguf_kernels:  # (held dequantized: every value at the model's dtype)
            return _gguf_weight_bytes(gguf_file, dtype_bytes, dequantized=True)
        return _gguf_weight_bytes(gguf_file, dtype_bytes, gguf_int8, gguf_int8_activations)
    qc = _quantization_config(model_dir)
    if not qc or int(qc.get("bits", qc.get("w_bit", 4))) != 4:
        return (safetensors_num_params(model_dir) - _unused_encoder_values(model_dir)) * dtype_bytes
    total = 0
    for name, count in _tensor_sizes(model_dir):
        if name.endswith(".qweight"):
            total += count * 4  # an int32 holds 8 weights: 4 bytes, as held
        elif name.endswith(".scales"):
            total += count * 3  # float16 scale + uint8 zero per group and output
        elif not name.endswith((".qzeros", ".g_idx")):
            total += count * dtype_bytes
    return total


def _unused_encoder_values(model_dir: Path) -> int:
    """Values of a BERT's tensors it never runs (``loader.BERT_POSITION_IDS``, and an
    embedding model's ``loader.BERT_POOLER``: its pooling is the sentence-transformers files')."""
    from infer.model.loader import BERT_POOLER, BERT_POSITION_IDS, load_model_spec

    spec = load_model_spec(model_dir)
    if not spec.is_encoder:
        return 0
    unused = BERT_POSITION_IDS if spec.is_classifier else BERT_POOLER + BERT_POSITION_IDS
    return sum(n for name, n in _tensor_sizes(model_dir) if name.endswith(unused))


# Bytes a quantized linear weight [n, k] takes, by --quantization (the scales and zeros too).
QUANTIZED_WEIGHT_BYTES = {
    "int8": lambda n, k: n * k + 4 * n,
    "w8a8": lambda n, k: n * k + 8 * n,
    "fp8": lambda n, k: n * k + 4 * n,
    "int4": lambda n, k: n * k // 2 + 3 * n * (k // 32),
    "w4a8": lambda n, k: n * k // 2 + 3 * n * (k // 32),
}
_NOT_LINEAR = ("embed", "wte", "wpe", "lm_head", "norm", "ln_", "score.weight")


def quantized_weight_bytes(model_dir: Path, dtype_bytes: int, method: str) -> int:
    """Bytes of a plain folder's weights under ``--quantization method``, from the headers:
    every linear layer's 2-D weight as the method holds it (int4: groups of 32), everything else
    (embeddings, norms, biases, the vocabulary projection) at ``dtype_bytes``, plus the
    vocabulary projection's quantized copy (int8 for the 4-bit methods), which the engine keeps
    beside the embedding table (not for a sequence classifier: its ``score`` head, kept in the
    model's dtype, is its only output)."""
    if method not in QUANTIZED_WEIGHT_BYTES:
        raise SystemExit(
            f"--quantization {method!r}: choose one of {', '.join(QUANTIZED_WEIGHT_BYTES)}"
        )
    total, vocab, classifier = 0, None, False
    for name, shape in _tensor_shapes(model_dir):
        is_linear = len(shape) == 2 and name.endswith(".weight")
        if is_linear and not any(part in name for part in _NOT_LINEAR):
            total += QUANTIZED_WEIGHT_BYTES[method](*shape)
            continue
        total += math.prod(shape) * dtype_bytes
        if is_linear and ("lm_head" in name or (vocab is None and "embed" in name)):
            vocab = shape
        classifier = classifier or name == "score.weight"
    if vocab is not None and not classifier:
        vocab_method = "int8" if method in ("int4", "w4a8") else method
        total += QUANTIZED_WEIGHT_BYTES[vocab_method](*vocab)
    return total


def _quantization_config(model_dir: Path) -> dict | None:
    from infer.model.loader import quantization_config

    if not (model_dir / "config.json").is_file():
        return None
    qc = quantization_config(model_dir)
    return qc if isinstance(qc, dict) else None


# The GGUF types the engine keeps in their own bits (model/gguf_checkpoint.py: FOUR_BIT_TYPES,
# and WIDE_TYPES with int8 activations), as (bits, bytes of a group's zero): per group of 32
# and output a float16 scale and a uint8 (integer) or float16 zero. Q6_K (int8 activations
# only) has its own records instead: per 16 inputs an int8 scale, per 256 a float16 d; it is
# kept fused only with Q6_K parts (its groups of 16 match no other type's).
_GGUF_KEPT = {
    "Q4_0": (4, 1),
    "Q4_1": (4, 2),
    "Q4_K": (4, 2),
    "Q5_0": (5, 1),
    "Q5_1": (5, 2),
    "Q5_K": (5, 2),
    "Q6_K": (6, 0),
}
# K-quants the w4a8 kernel reads with their own scales (int8 activations): per 32 inputs a
# uint8 scale and min, per 256 a float16 d and dmin.
_GGUF_KQUANTS = ("Q4_K", "Q5_K")
# Parameters fused from several GGUF tensors: kept only when every part is (at the widest
# part's bits, the wider zero; with their own scales when every part is a K-quant).
_GGUF_FUSED = (
    ("attn_q", "attn_k", "attn_v"),
    ("ffn_gate", "ffn_up"),
    ("ffn_gate_exps", "ffn_up_exps"),  # each expert's gate / up, stacked
    ("ffn_gate_shexp", "ffn_up_shexp"),  # Qwen2-MoE's shared expert
)


def _gguf_weight_bytes(
    file: Path,
    dtype_bytes: int,
    int8: bool = True,
    int8_activations: bool = True,
    dequantized: bool = False,
) -> int:
    """Bytes of a GGUF file's weights as the engine holds them. float32: every weight
    dequantized. 16-bit: a 4-bit layer (with ``int8_activations``, which assumes a CPU with
    AVX-512 VNNI, a 5- or 6-bit one too and K-quants and Q6_K with their own scales;
    a fused q/k/v or gate/up only when each part is) at its bits per weight plus its groups'
    scales and zeros; with ``int8`` (``--gguf-int8``; by default a decoder's where the int8
    kernel runs) a layer stored in
    another quantized type as int8 per channel; beside the
    embedding table a copy of the vocabulary projection if it was stored quantized: as stored
    where a layer of its type would be kept, else in int8 (with ``int8``); the rest at
    ``dtype_bytes`` per value. ``dequantized`` (no kernel holds the layers as stored): every
    weight at ``dtype_bytes``."""
    tensors = {name: (shape, kind) for name, shape, kind in gguf_tensors(file)}

    def parts(name: str) -> list[str]:
        """``name``, or each part of the fused parameter it is one of."""
        block, _, rest = name.rpartition(".")[0].rpartition(".")
        for fused in _GGUF_FUSED:
            if rest in fused:
                return [f"{block}.{p}.weight" for p in fused]
        return [name]

    def stored(names: list[str], kinds: Callable[[str], bool]) -> bool:
        """Whether every one of ``names`` is of one of ``kinds``."""
        return all(n in tensors and kinds(tensors[n][1]) for n in names)

    def quantized(kind: str) -> bool:
        return kind not in FLOAT_TYPES

    def kept(kind: str) -> bool:
        return kind in _GGUF_KEPT and (int8_activations or _GGUF_KEPT[kind][0] == 4)

    def all_kept(names: list[str]) -> bool:
        q6k = [tensors[n][1] == "Q6_K" for n in names if n in tensors]
        return stored(names, kept) and (all(q6k) or not any(q6k))

    def kept_bytes(names: list[str], count: int) -> int:
        kinds = [tensors[n][1] for n in names]
        bits = max(_GGUF_KEPT[k][0] for k in kinds)
        zero = max(_GGUF_KEPT[k][1] for k in kinds)
        if kinds[0] == "Q6_K":
            return count * bits // 8 + count // 16 + 2 * count // 256
        if int8_activations and all(k in _GGUF_KQUANTS for k in kinds):
            return count * bits // 8 + 2 * count // 32 + 4 * count // 256
        return count * bits // 8 + (2 + zero) * count // 32

    total = 0
    for name, (shape, _) in tensors.items():
        if name == "rope_freqs.weight":
            continue  # (derived state, not a weight)
        count = math.prod(shape)
        layer = len(shape) in (2, 3) and name.startswith("blk.") and name.endswith(".weight")
        layer = layer and "ffn_gate_inp" not in name  # (a router stays in the model's dtype)
        if dtype_bytes == 4 or dequantized or not layer:
            total += count * dtype_bytes
        elif all_kept(parts(name)):
            total += kept_bytes(parts(name), count)
        elif int8 and stored(parts(name), quantized):
            total += QUANTIZED_WEIGHT_BYTES["int8"](math.prod(shape[:-1]), shape[-1])
        else:
            total += count * dtype_bytes
    vocab = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    if dequantized:
        return total
    if dtype_bytes != 4 and vocab in tensors and all_kept([vocab]):
        total += kept_bytes([vocab], math.prod(tensors[vocab][0]))
    elif int8 and dtype_bytes != 4 and vocab in tensors and quantized(tensors[vocab][1]):
        total += QUANTIZED_WEIGHT_BYTES["int8"](*tensors[vocab][0])
    return total


def _tensor_shapes(model_dir: Path) -> list[tuple[str, list[int]]]:
    """(name, shape) of every tensor in the folder's safetensors files, from their headers; a
    GGUF file's tensors, its embedding and vocabulary projection named as in a folder."""
    gguf_file = gguf_source(model_dir)
    if gguf_file is not None:
        rename = {"token_embd.weight": "embed_tokens.weight", "output.weight": "lm_head.weight"}
        return [(rename.get(name, name), list(shape)) for name, shape, _ in gguf_tensors(gguf_file)]
    out = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out += [(name, meta["shape"]) for name, meta in header.items() if name != "__metadata__"]
    return out


def _tensor_sizes(model_dir: Path) -> list[tuple[str, int]]:
    """(name, number of values) of every tensor in the folder's safetensors files."""
    return [(name, math.prod(shape)) for name, shape in _tensor_shapes(model_dir)]


def plan_from_folder(
    model_dir: Path,
    memory: int,
    concurrency: int,
    context_len: int | None,
    dtype: str = "auto",
    kv_dtype: str | None = None,
    block_size: int = 16,
    quantization: str | None = None,
) -> CapacityPlan:
    from infer.model.loader import load_model_spec

    spec = load_model_spec(model_dir)
    weights_dtype = spec.torch_dtype if dtype == "auto" else dtype
    wbytes = DTYPE_BYTES.get(weights_dtype or "float32", 4)
    return CapacityPlan(
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        num_heads=spec.num_heads,
        head_dim=spec.head_dim,
        kv_dtype_bytes=DTYPE_BYTES[kv_dtype] if kv_dtype else wbytes,
        kv_scale_bytes=_scale_bytes(kv_dtype),
        weights_bytes=(
            quantized_weight_bytes(model_dir, wbytes, quantization)
            if quantization and not _quantization_config(model_dir)
            else safetensors_weight_bytes(model_dir, wbytes)
        ),
        memory_bytes=memory,
        concurrency=concurrency,
        context_len=context_len or spec.max_position_embeddings,
        block_size=block_size,
        encoder=spec.is_encoder,
    )


def _scale_bytes(kv_dtype: str | None) -> int:
    return kv_value_bytes(kv_dtype, 0)[1] if kv_dtype else 0


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def render(p: CapacityPlan) -> str:
    if p.encoder:  # (its inputs run whole and keep nothing: there is no KV to plan)
        left = max(p.memory_bytes - p.weights_bytes, 0)
        lines = [
            f"an encoder ({p.num_layers} layers): it embeds; inputs of up to {p.context_len} "
            "tokens run whole, no KV cache is held",
            f"memory {_gb(p.memory_bytes)} - weights {_gb(p.weights_bytes)} = {_gb(left)} for "
            "activations",
        ]
        if left == 0:
            lines.append("WARNING: the weights alone exceed the memory given")
        return "\n".join(lines)
    row = f"{p.head_dim} x {p.kv_dtype_bytes}"
    if p.kv_scale_bytes:
        row = f"({row} + {p.kv_scale_bytes} scale)"
    lines = [
        f"shape: {p.num_layers} layers x {p.num_kv_heads} KV heads x head_dim {p.head_dim}, "
        f"{p.kv_dtype_bytes} bytes per value"
        + (f" + a {p.kv_scale_bytes}-byte scale per row" if p.kv_scale_bytes else ""),
        f"KV bytes per token: 2 x {p.num_layers} x {p.num_kv_heads} x {row} = "
        f"{p.bytes_per_token:,} bytes ({p.bytes_per_token / 2**10:.1f} KiB)",
        f"KV per {p.context_len}-token sequence: {_gb(p.bytes_per_sequence)}",
    ]
    mha = p.mha_bytes_per_sequence
    if mha is not None and p.num_heads != p.num_kv_heads:
        lines.append(
            f"  without GQA ({p.num_heads} KV heads): {_gb(mha)} "
            f"({p.num_heads // p.num_kv_heads}x more)"
        )
    lines += [
        f"memory {_gb(p.memory_bytes)} - weights {_gb(p.weights_bytes)} = KV budget {_gb(p.kv_budget_bytes)}",
        f"KV capacity: {p.kv_tokens:,} tokens = {p.kv_blocks:,} blocks of {p.block_size}",
        f"max context per user at {p.concurrency} concurrent users: {p.max_context_per_user:,} tokens",
        f"max concurrent users at {p.context_len} tokens of context: {p.max_users_at_context:,}",
    ]
    if p.kv_budget_bytes == 0:
        lines.append("WARNING: the weights alone exceed the memory given; nothing is left for KV")
    return "\n".join(lines)


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="KV-cache capacity plan (no weights loaded)")
    p.add_argument("--model", default=None, help="model folder (or give the shape flags)")
    p.add_argument("--memory", required=True, type=byte_size, help="device memory, e.g. 16GiB")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument(
        "--context", type=int, default=None, help="tokens per sequence (default: model max)"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPE_BYTES)],
                   help="weights dtype (default: the checkpoint's)")  # fmt: skip
    p.add_argument(
        "--kv-dtype", default=None, choices=sorted(DTYPE_BYTES), help="default: weights dtype"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--quantization",
        default=None,
        help="weights quantized at load: int8 | w8a8 | fp8 | int4 | w4a8 (a GPTQ / AWQ folder "
        "is counted as it is held either way)",
    )
    p.add_argument("--hf-overrides", default=None,
                   help="JSON of config.json fields set or replaced, as infer serve takes it")  # fmt: skip
    g = p.add_argument_group("shape without a folder")
    g.add_argument("--layers", type=int)
    g.add_argument("--kv-heads", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--head-dim", type=int)
    g.add_argument("--weights", type=byte_size, help="weights bytes, e.g. 140GB")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for flag, value in (("concurrency", args.concurrency), ("context", args.context),
                        ("block-size", args.block_size)):  # fmt: skip
        if value is not None and value < 1:
            raise SystemExit(f"infer plan: --{flag} must be at least 1, got {value}")
    if args.model:
        from infer.engine.model_source import resolve_model_path
        from infer.model.folders import ModelLoadError

        try:
            plan = plan_from_folder(
                resolve_model_path(args.model, args.hf_overrides),
                args.memory,
                args.concurrency,
                args.context,
                args.dtype,
                args.kv_dtype,
                args.block_size,
                args.quantization,
            )
        except (ModelLoadError, ValueError) as e:
            raise SystemExit(f"infer plan: {e}") from None
    else:
        missing = [
            f
            for f in ("layers", "kv_heads", "head_dim", "weights", "context")
            if getattr(args, f) is None
        ]
        if missing:
            raise SystemExit(
                "without --model, give: " + ", ".join("--" + m.replace("_", "-") for m in missing)
            )
        dtype_bytes = DTYPE_BYTES.get(args.dtype, 2)
        plan = CapacityPlan(
            args.layers,
            args.kv_heads,
            args.heads,
            args.head_dim,
            DTYPE_BYTES[args.kv_dtype] if args.kv_dtype else dtype_bytes,
            args.weights,
            args.memory,
            args.concurrency,
            args.context,
            args.block_size,
            _scale_bytes(args.kv_dtype),
        )
    print(render(plan))
    return 0

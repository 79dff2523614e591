"""Find a model folder, read its config, and load its safetensors weights into our modules.

A model is a folder with ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), as ``save_pretrained`` writes it. It is found as a local
path or as a model id in the local Hugging Face cache (never downloaded). Built-in names are
resolved a layer up, in :mod:`infer.engine.model_source`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from infer.model.folders import ModelLoadError, read_config, read_json
from infer.model.gguf_checkpoint import GGUFCheckpoint
from infer.model.gguf_folder import RANK_HEAD, gguf_source
from infer.model.layers import CausalLM, ClassifierHead, WeightSource
from infer.model.llava import LlavaConfig
from infer.model.parallel import TensorParallel
from infer.model.quantized_checkpoint import (
    QuantizedCheckpointError,
    QuantizedFormat,
    UnpackedLayer,
    checkpoint_int4_parts,
    layer_weight,
    read_format,
    unpack,
)
from infer.model.registry import (
    UnsupportedArchitectureError,
    classifier_from_tokens,
    classifier_labels,
    cross_encoder_activation,
    model_class,
    rerank_template,
    token_classifier_labels,
)
from infer.model.spec import ModelSpec, config_dtype, token_ids

logger = logging.getLogger(__name__)

# A BERT's tensors it may not run: an embedding model's pooler (a cross-encoder's head runs
# it), and the position ids older exports saved.
BERT_POOLER = ("pooler.dense.weight", "pooler.dense.bias")
BERT_POSITION_IDS = ("embeddings.position_ids",)
# Checkpoint tensors that are derived state or tied copies, never weights we lack a place for.
_IGNORABLE_SUFFIXES = (
    "rotary_emb.inv_freq",
    ".attn.bias",
    ".attn.masked_bias",
    "lm_head.weight",
    *BERT_POOLER,
    *BERT_POSITION_IDS,
)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


# --------------------------------------------------------------------------- config and spec


def _parse(model_dir: Path) -> tuple[type[CausalLM], Any, ModelSpec, dict[str, Any]]:
    config = read_config(model_dir)
    original = config
    try:
        arch, cls = model_class(config)
        labels = classifier_labels(arch, config)
        token_labels = token_classifier_labels(arch, config)
        activation = cross_encoder_activation(config) if len(labels) == 1 else "sigmoid"
        template = rerank_template(config) if labels else None
        if labels:  # a classifier has no vocabulary projection (no lm_head tensor to read)
            config = {**config, "tie_word_embeddings": True}
        parsed = cls.parse_config(config)
    except UnsupportedArchitectureError as exc:
        raise ModelLoadError(f"{model_dir / 'config.json'}: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{model_dir / 'config.json'}: {exc}") from exc
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    eos = token_ids(config.get("eos_token_id", text.get("eos_token_id")))
    bos = config.get("bos_token_id", text.get("bos_token_id"))
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        gen = read_json(gen_path, what="generation config")
        eos = token_ids(gen.get("eos_token_id")) or eos
        bos = gen.get("bos_token_id", bos)
    spec = ModelSpec(
        architecture=arch,
        model_type=str(config.get("model_type") or ""),
        num_layers=parsed.num_layers,
        num_heads=parsed.num_heads,
        num_kv_heads=parsed.num_kv_heads,
        head_dim=parsed.head_dim,
        hidden_size=parsed.hidden_size,
        vocab_size=parsed.vocab_size,
        max_position_embeddings=parsed.max_position_embeddings,
        eos_token_ids=eos,
        bos_token_id=bos,
        torch_dtype=config_dtype(config),
        labels=labels,
        token_labels=token_labels,
        score_activation=activation,
        rerank_template=template,
        is_encoder=cls.is_encoder,
        **_image_fields(parsed),
    )
    return cls, parsed, spec, original


def _image_fields(parsed: Any) -> dict[str, Any]:
    """A vision-language model's :class:`ModelSpec` fields (none for any other)."""
    return {"images": parsed.layout} if isinstance(parsed, LlavaConfig) else {}


def load_model_spec(model_dir: Path) -> ModelSpec:
    """The :class:`ModelSpec` of a model folder; reads ``config.json`` only, no weights."""
    return _parse(Path(model_dir))[2]


# --------------------------------------------------------------------------- weights


def checkpoint_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it.

    ``model.safetensors`` alone, else the shards of ``model.safetensors.index.json``, else every
    ``*.safetensors`` in the folder.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    if (model_dir / SINGLE_FILE).is_file():
        files = [model_dir / SINGLE_FILE]
    elif (model_dir / INDEX_FILE).is_file():
        return _read_shard_index(model_dir)
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt")
        )
        hint = f" (found {', '.join(other)}: only safetensors are supported)" if other else ""
        raise ModelLoadError(f"no *.safetensors in {model_dir}{hint}")
    index: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                index.update((name, file) for name in f.keys())  # noqa: SIM118 - not a dict
        except Exception as exc:  # noqa: BLE001 - safetensors raises several error types
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    return index


def _read_shard_index(model_dir: Path) -> dict[str, Path]:
    path = model_dir / INDEX_FILE
    data = read_json(path, what="shard index")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"bad shard index {path}: no 'weight_map' object")
    index: dict[str, Path] = {}
    for name, file in weight_map.items():
        shard = model_dir / str(file)
        if not shard.is_file():
            raise ModelLoadError(
                f"bad shard index {path}: tensor {name!r} is mapped to {file}, which does not exist"
            )
        index[name] = shard
    return index


def resolve_dtype(dtype: torch.dtype | str | None, spec: ModelSpec) -> torch.dtype:
    """``None``/``"auto"`` -> the checkpoint's dtype (float32 if unknown); names -> torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return DTYPES.get(spec.torch_dtype or "float32", torch.float32)
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    return DTYPES[dtype]


@torch.no_grad()
def load_model(
    model_dir: Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    gguf_wide: bool = False,
) -> CausalLM:
    """Build the model of ``model_dir`` and fill it from its safetensors, in ``dtype`` on ``device``.

    ``dtype=None`` keeps the checkpoint's dtype. Tensors are read one at a time (memory-mapped)
    and fused/transposed into our layout; the model comes back in eval mode without grads.
    ``gguf_wide``: a GGUF file's 5- and 6-bit layers keep their integers too (beside its
    4-bit ones), for the w4a8 kernel (``--gguf-int8-activations``).
    """

    model_dir = Path(model_dir)
    cls, parsed, spec, config = _parse(model_dir)
    dtype = resolve_dtype(dtype, spec)
    quantized = quantized_format(model_dir)
    gguf_file = gguf_source(model_dir)
    reader: _SafetensorsReader | GGUFCheckpoint
    if gguf_file is not None:
        # float32: every weight dequantized, exactly llama.cpp's values (4-bit layers would
        # only be dequantized again for each product, with float16 zeros)
        keep_4bit = dtype != torch.float32
        reader = GGUFCheckpoint(gguf_file, spec.num_heads, spec.num_kv_heads, keep_4bit,
                                keep_4bit and gguf_wide)  # fmt: skip
    else:
        reader = _SafetensorsReader(model_dir, quantized, cls.checkpoint_aliases)

    with torch.device("meta"):
        model = cls(parsed)
        if spec.is_classifier and spec.is_encoder:  # (a BERT cross-encoder's own head)
            model.classifier = model.make_classifier(len(spec.labels))
        elif spec.is_classifier:
            model.classifier = ClassifierHead(spec.hidden_size, len(spec.labels))
        if spec.token_labels:  # (a token classifier's head, over every row)
            model.token_classifier = model.make_token_classifier(len(spec.token_labels))
    model = model.to(dtype=dtype).to_empty(device=device)
    model.spec = spec

    sources = model.weight_sources()
    if model.classifier is not None and spec.is_encoder:
        sources.update(model.classifier_sources())
    elif model.classifier is not None:
        sources["classifier.weight"] = _classifier_source(model, model_dir, config, sources,
                                                          reader)  # fmt: skip
    if model.token_classifier is not None:
        sources.update(model.token_classifier_sources())
    params = dict(model.named_parameters())
    assert set(sources) == set(params), f"weight plan mismatch: {set(sources) ^ set(params)}"

    # 4-bit layers whose integers a 4-bit linear can take as they are (runner/int4.py), and the
    # parameters read from quantized tensors of other types (GGUF's Q6_K, Q8_0, ...), which
    # the runner may hold in 8 bits instead of the model's dtype (runner/quant.py).
    model.checkpoint_int4 = {}
    model.checkpoint_quantized = set()
    # A GGUF file's tensor types, for the start-up log (its header is parsed once, here).
    model.checkpoint_tensor_types = reader.tensor_types() if gguf_file is not None else {}
    try:
        for pname, source in sources.items():
            tensors = []
            unpacked = []
            for name in source.names:
                tensor, layer = reader.read(name, pname)
                if source.rows is not None:
                    tensor = tensor[list(source.rows)]
                tensors.append(tensor.float() if source.transform is not None else tensor)
                if layer is not None:
                    unpacked.append(layer)
            if all(reader.stored_quantized(name) for name in source.names):
                model.checkpoint_quantized.add(pname)
            _fill(params[pname], pname, source, tensors, model.tp)
            # (a reordered source's 4-bit integers are in the file's row order: computed from
            # the reordered float weights instead)
            if (len(unpacked) == len(source.names) and quantized is not None
                    and source.rows is None):  # fmt: skip
                kept = checkpoint_int4_parts(quantized, unpacked, source, model.tp)
                if kept is not None:
                    model.checkpoint_int4[pname] = kept
    finally:
        reader.close()
    unused = [name for name in reader.unused() if name not in cls.side_tensors]
    if unused:
        # Not fatal (extra heads, vision towers), but a sign of a mislabeled architecture.
        logger.warning(
            "%d checkpoint tensors in %s were not used, e.g. %s",
            len(unused),
            gguf_file or model_dir,
            ", ".join(unused[:3]),
        )
    model.init_buffers(device, dtype)
    model.requires_grad_(False)
    return model.eval()


def _classifier_source(
    model: CausalLM,
    model_dir: Path,
    config: dict[str, Any],
    sources: dict[str, WeightSource],
    reader: _SafetensorsReader | GGUFCheckpoint,
) -> WeightSource:
    """Where a sequence classifier's head comes from: the checkpoint's ``score.weight``, or for
    a causal reranker (``classifier_from_token``) rows of its vocabulary projection: the
    ``lm_head`` it was trained with, else the embedding table it is tied to."""
    if config.get(RANK_HEAD):  # a GGUF reranker's cls.output rows, [true, false]
        return WeightSource(("score.weight",), _true_minus_false, rows=(1, 0))
    from_tokens = classifier_from_tokens(config)
    if from_tokens is None:
        return WeightSource(("score.weight",))
    ids = _token_ids(model_dir, from_tokens.tokens, model.spec.vocab_size)
    vocab = model.vocab_projection_weight()
    tied = next(sources[name] for name, p in model.named_parameters() if p is vocab)
    name = "lm_head.weight" if reader.has("lm_head.weight") else tied.names[0]
    transform = _true_minus_false if from_tokens.two_way else None
    return WeightSource((name,), transform, rows=tuple(ids))


def _true_minus_false(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A two-way head's one label from its rows read as ``[false, true]``: ``W[true] -
    W[false]`` (in float32, then the model's dtype)."""
    return (tensors[0][1] - tensors[0][0])[None]


def _token_ids(model_dir: Path, tokens: tuple[str, ...], vocab_size: int) -> list[int]:
    """Each token's id in the model's tokenizer ("yes" and "Yes" are different tokens)."""
    from infer.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    ids = []
    for token in tokens:
        i = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(i, int) or i >= vocab_size or tokenizer.convert_ids_to_tokens(i) != token:
            raise ModelLoadError(f"classifier_from_token: {token!r} is not a token of the "
                                 f"tokenizer in {model_dir}")  # fmt: skip
        ids.append(i)
    return ids


class _SafetensorsReader:
    """A folder's safetensors by tensor name (GPTQ / AWQ layers unpacked from their parts)."""

    def __init__(
        self,
        model_dir: Path,
        quantized: QuantizedFormat | None,
        aliases: tuple[tuple[str, str], ...],
    ) -> None:
        self.model_dir, self.quantized, self.aliases = model_dir, quantized, aliases
        self.index = checkpoint_index(model_dir)
        self.handles: dict[Path, Any] = {}
        self.used: set[str] = set()

    def read(self, name: str, pname: str) -> tuple[torch.Tensor, UnpackedLayer | None]:
        """Tensor ``name`` (for parameter ``pname``) as stored (a quantized layer: its float32
        weight and integers)."""
        file, found = _lookup(self.index, name, self.aliases)
        if file is None and self.quantized is not None and name.endswith(".weight"):
            layer = _unpacked(
                self.index, name, self.quantized, self.handles, self.used, self.model_dir
            )
            return layer_weight(layer), layer
        if file is None:
            raise ModelLoadError(
                f"tensor {name!r} (for {pname}) is missing from the checkpoint in {self.model_dir}"
            )
        self.used.add(found)
        return _read_tensor(self.handles, file, found), None

    def has(self, name: str) -> bool:
        return _lookup(self.index, name, self.aliases)[0] is not None

    def stored_quantized(self, name: str) -> bool:
        """Whether ``name`` was stored quantized in a type not kept as it is: never here (a GPTQ
        8-bit layer is dequantized, as its format is exact in the model's dtype)."""
        return False

    def close(self) -> None:
        self.handles.clear()

    def unused(self) -> list[str]:
        return sorted(
            n for n in self.index if n not in self.used and not n.endswith(_IGNORABLE_SUFFIXES)
        )


def _read_tensor(handles: dict[Path, Any], file: Path, key: str) -> torch.Tensor:
    """Tensor ``key`` of ``file`` (opened once, kept in ``handles``); a file that is not
    safetensors, or that lacks the tensor its index says it holds, is a ModelLoadError naming
    both."""
    from safetensors import safe_open

    try:
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return handles[file].get_tensor(key)
    except OSError:
        raise
    except Exception as e:  # safetensors' own error type: a damaged file or a wrong index
        raise ModelLoadError(f"cannot read tensor {key!r} from {file}: {e}") from None


def quantization_config(model_dir: Path) -> Any:
    """The checkpoint's quantization settings (None: a plain checkpoint): ``config.json``'s
    ``quantization_config``, else an AutoGPTQ-style ``quantize_config.json`` beside it (GPTQ
    unless it says otherwise)."""
    qc = read_config(model_dir).get("quantization_config")
    separate = Path(model_dir) / "quantize_config.json"
    if qc is None and separate.is_file():
        qc = {"quant_method": "gptq", **read_json(separate, what="quantization config")}
    return qc


def quantized_format(model_dir: Path) -> QuantizedFormat | None:
    """The GPTQ / AWQ format of ``model_dir``'s checkpoint, None for a plain one; a GGUF
    file's folder is ``gguf`` (its 4-bit types in groups of 32, whatever else it holds)."""
    if gguf_source(model_dir) is not None:
        return QuantizedFormat("gguf", 4, 32)
    qc = quantization_config(model_dir)
    try:
        return read_format({} if qc is None else {"quantization_config": qc})
    except QuantizedCheckpointError as e:
        raise ModelLoadError(str(e)) from None


def _unpacked(
    index: dict[str, Path],
    name: str,
    fmt: QuantizedFormat,
    handles: dict[Path, Any],
    used: set[str],
    model_dir: Path,
) -> UnpackedLayer:
    """The integers of weight ``name`` (``X.weight``) of a quantized checkpoint, from
    ``X.qweight``, ``X.qzeros``, ``X.scales`` (and GPTQ's ``X.g_idx``)."""

    prefix = name[: -len("weight")]
    parts = ["qweight", "qzeros", "scales"] + (["g_idx"] if fmt.method == "gptq" else [])
    tensors: dict[str, torch.Tensor] = {}
    for part in parts:
        key = prefix + part
        if key not in index:
            if part == "g_idx" and not fmt.desc_act:
                continue  # optional without act-order: groups follow the input rows
            if part == "qweight":
                raise ModelLoadError(
                    f"tensor {name!r} is missing from the checkpoint in {model_dir} (and so is "
                    f"{key!r}: not a {fmt.method} layer either)"
                )
            raise ModelLoadError(
                f"tensor {key!r} is missing from the {fmt.method} checkpoint in {model_dir}"
            )
        tensors[part] = _read_tensor(handles, index[key], key)
        used.add(key)
    try:
        return unpack(fmt, tensors["qweight"], tensors["qzeros"], tensors["scales"],
                       tensors.get("g_idx"))  # fmt: skip
    except QuantizedCheckpointError as e:
        raise ModelLoadError(f"{prefix[:-1]}: {e}") from None


def _fill(
    param: torch.Tensor,
    pname: str,
    source: WeightSource,
    tensors: list[torch.Tensor],
    tp: TensorParallel,
) -> None:
    """Copy (and convert) checkpoint tensors into ``param``; the pieces of a fused parameter
    go straight into their rows, with no intermediate concatenation."""
    pieces = [source.transform(tensors)] if source.transform is not None else tensors
    if source.shard is not None and source.shard.dim == 1 and tp.size > 1 and param.dim() == 2:
        # A row-parallel shard holds part of each row: the whole row's largest magnitude, for
        # per-channel weight quantization (runner/quant.py) to scale as one rank does.
        param.full_row_absmax = torch.cat(  # type: ignore[attr-defined]
            [t.to(param.dtype).abs().amax(dim=1).float() for t in pieces]
        )
    if source.shard is not None:
        pieces = source.shard.cut(pieces, tp)
    trailing = {tuple(t.shape[1:]) for t in pieces}
    rows = sum(t.shape[0] for t in pieces)
    if len(trailing) != 1 or (rows, *trailing.pop()) != tuple(param.shape):
        got = " + ".join(str(tuple(t.shape)) for t in pieces)
        raise ModelLoadError(
            f"tensor {', '.join(source.names)} has shape {got}, expected "
            f"{tuple(param.shape)} for {pname} (config.json and weights disagree)"
        )
    start = 0
    for t in pieces:
        param[start : start + t.shape[0]].copy_(t)
        start += t.shape[0]


def _lookup(
    index: dict[str, Path], name: str, aliases: tuple[tuple[str, str], ...]
) -> tuple[Path | None, str]:
    if name in index:
        return index[name], name
    for prefix, replacement in aliases:
        if name.startswith(prefix):
            alt = replacement + name[len(prefix) :]
            if alt in index:
                return index[alt], alt
    return None, name

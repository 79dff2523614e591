"""An EmbeddingGemma GGUF file (llama.cpp's ``gemma-embedding`` architecture) as a model folder.

llama.cpp's converter writes google/embeddinggemma-300m as Gemma 3's layers under another
architecture name: the same metadata keys (``gemma-embedding.*`` for ``gemma3.*``), the same
tensors (norms stored plus one), and, converted with ``--sentence-transformers-dense-modules``,
its two bias-free ``Dense`` projections as ``dense_2.weight`` / ``dense_3.weight`` with their
sizes (``dense_2_feat_in`` ...). llama.cpp runs it bidirectionally, a sliding layer seeing keys
at most ``sliding_window / 2`` positions away on either side (the window the converter writes
is the model's ``config.json`` one, before transformers halves it), queries scaled by
``1 / sqrt(head_dim)``; then pools as ``pooling_type`` says (MEAN), projects by the Dense
layers, and normalizes.

transformers reads no ``gemma-embedding`` file, so its config and tokenizer are read from a
copy of the metadata (no tensors) under the ``gemma3`` name, then made the encoder's
(``Gemma3TextModel`` with ``use_bidirectional_attention``: model/gemma3.py). The Dense weights
are written beside it as sentence-transformers' module folders (model/dense.py reads them).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from infer.model.folders import ModelLoadError
from infer.model.gguf_folder import _field, _write_pooling, write_decoder_folder

ARCH = "gemma-embedding"
# The Dense modules llama.cpp holds (in order) and the sentence-transformers folder of each.
DENSE = (("dense_2", "2_Dense"), ("dense_3", "3_Dense"))


def write_embedding_gemma_folder(reader: Any, file: Path, out: Path) -> None:
    """The folder of an EmbeddingGemma GGUF ``file`` (open as ``reader``) into ``out``."""
    from transformers import PreTrainedTokenizerFast

    # Gemma's sentencepiece vocabulary is read as transformers reads a Gemma 3 file's (its
    # Gemma tokenizer); any other (a byte-level BPE "gpt2" one) as the file says, which
    # transformers' Gemma tokenizer class would re-split as sentencepiece.
    spm = _field(reader, "tokenizer.ggml.model") == "llama"
    with tempfile.TemporaryDirectory(prefix="infer-gguf-") as tmp:
        shadow = Path(tmp) / "gemma3.gguf"
        metadata_as(reader, "gemma3", shadow)
        write_decoder_folder(reader, ARCH, file, out, metadata_file=shadow,
                             tokenizer_class=None if spm else PreTrainedTokenizerFast)  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    config.update(
        architectures=["Gemma3TextModel"],
        use_bidirectional_attention=True,
        query_pre_attn_scalar=int(config["head_dim"]),
    )
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str) + "\n")
    dense = write_dense_modules(reader, file, out, int(config["hidden_size"]))
    _write_pooling(reader, ARCH, out, dense, default="MEAN")  # (EmbeddingGemma's own)


def metadata_as(reader: Any, arch: str, out: Path) -> None:
    """A GGUF file ``out`` holding ``reader``'s metadata, none of its tensors, with its
    architecture (and every key under it) renamed to ``arch``."""
    import gguf

    old = str(_field(reader, "general.architecture"))
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # (the writer's own)
        if name.startswith(old + "."):
            name = arch + name[len(old) :]
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def write_dense_modules(reader: Any, file: Path, out: Path, hidden_size: int) -> tuple[str, ...]:
    """The file's Dense projections as sentence-transformers module folders in ``out``
    (``linear.weight`` in ``model.safetensors``, no bias, no activation: as llama.cpp applies
    them); the folders' names, in order. A file whose projections do not chain from the
    hidden size (each from the one before) is a :class:`ModelLoadError` naming the sizes."""
    from gguf import dequantize
    from safetensors.numpy import save_file

    tensors = {t.name: t for t in reader.tensors}
    written: list[str] = []
    width = hidden_size
    for name, folder in DENSE:
        tensor = tensors.get(f"{name}.weight")
        if tensor is None:
            continue
        rows, cols = (int(n) for n in reversed(tensor.shape))
        if cols != width:
            raise ModelLoadError(f"{file}: {name}.weight is [{rows}, {cols}]; it takes {width} "
                                 "values here")  # fmt: skip
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        (out / folder).mkdir()
        save_file({"linear.weight": np.ascontiguousarray(weight.reshape(rows, cols))},
                  str(out / folder / "model.safetensors"))  # fmt: skip
        config = {"in_features": cols, "out_features": rows, "bias": False,
                  "activation_function": "torch.nn.modules.linear.Identity"}  # fmt: skip
        (out / folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        written.append(folder)
        width = rows
    return tuple(written)

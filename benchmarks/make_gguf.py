"""Write a Hugging Face Llama folder as a GGUF file for llama.cpp's `llama-server`, the peer of
`infer bench vs-vllm --peers infer,llamacpp --llamacpp-model OUT.gguf`.

llama.cpp's own converter (`convert_hf_to_gguf.py` in its source tree) does the work. It names
a BPE tokenizer's pre-tokenizer (the regex that splits text before the merges) by hashing how
the tokenizer encodes a test string, and refuses a tokenizer it has never seen: the byte-level
BPE tokenizers of the benchmark models are trained locally, so no hash matches. Their split
pattern is GPT-2's, so this script has the converter write `tokenizer.ggml.pre = gpt-2`
(`--pre-tokenizer` names another) and converts as usual.

    python benchmarks/make_gguf.py LLAMA_CPP_SRC MODEL_DIR OUT.gguf [--outtype bf16]
    LLAMA_CPP_SRC/build/bin/llama-quantize OUT.gguf OUT-q4km.gguf Q4_K_M   # 4-bit, if wanted

LLAMA_CPP_SRC is a llama.cpp checkout or source tree (with `convert_hf_to_gguf.py` and
`gguf-py/`), e.g. `vendor/llama.cpp` of the llama-cpp-python sdist; the converter needs torch,
numpy, safetensors, transformers and sentencepiece in this Python (it tries a SentencePiece
vocabulary first, also for BPE tokenizers; `pip install --target DIR sentencepiece` and
`PYTHONPATH=DIR` keep it out of infer's environment). Seen: ~10 s for the ~100M Llama.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_converter(src: Path) -> ModuleType:
    """``convert_hf_to_gguf.py`` of the llama.cpp tree ``src``, imported (not run), with that
    tree's ``gguf-py`` (and its ``conversion`` package, where it has one) importable."""
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(f"{script} not found: LLAMA_CPP_SRC must be llama.cpp's source tree")
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def force_pre_tokenizer(converter: ModuleType, name: str) -> int:
    """Make every model class of the converter report the pre-tokenizer ``name`` instead of
    guessing it from a hash; returns how many classes define the guess (0: nothing patched)."""
    modules = [converter] + [
        m
        for key, m in list(sys.modules.items())
        if key == "conversion" or key.startswith("conversion.")
    ]
    patched = 0
    for module in modules:
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and "get_vocab_base_pre" in vars(obj):
                obj.get_vocab_base_pre = lambda self, tokenizer, _name=name: _name
                patched += 1
    return patched


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("llama_cpp_src", type=Path, help="llama.cpp's source tree")
    p.add_argument("model", type=Path, help="the Hugging Face model folder")
    p.add_argument("out", type=Path, help="the GGUF file to write")
    p.add_argument("--outtype", default="bf16", help="f32, f16, bf16 or q8_0 (default bf16)")
    p.add_argument("--pre-tokenizer", default="gpt-2", help="tokenizer.ggml.pre to write")
    p.add_argument(
        "--dense-modules",
        action="store_true",
        help="write the sentence-transformers Dense modules too (EmbeddingGemma)",
    )
    a = p.parse_args(argv)
    src = a.llama_cpp_src.expanduser().resolve()
    converter = load_converter(src)
    if not force_pre_tokenizer(converter, a.pre_tokenizer):
        raise SystemExit("no get_vocab_base_pre in this converter: a llama.cpp it does not know")
    sys.argv = [
        str(src / "convert_hf_to_gguf.py"),
        str(a.model.expanduser()),
        "--outfile",
        str(a.out.expanduser()),
        "--outtype",
        a.outtype,
    ] + (["--sentence-transformers-dense-modules"] if a.dense_modules else [])
    converter.main()
    print(f"wrote {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

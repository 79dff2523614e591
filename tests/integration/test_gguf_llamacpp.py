"""GGUF files written by llama.cpp's own tools, where a llama.cpp source tree is at hand.

CI has no llama.cpp, so these skip unless ``INFER_LLAMA_CPP`` names a llama.cpp tree (with
``convert_hf_to_gguf.py`` and ``gguf-py/``; ``build/bin/llama-quantize`` for the quantized
files): e.g. ``vendor/llama.cpp`` of the llama-cpp-python sdist (docs/benchmarks.md). They
repeat, with llama.cpp's converter in place of ``infer.testing.gguf_files``, what
``test_gguf.py`` checks: every architecture's F32 file gives its folder's logits, and a
``llama-quantize``'d file transformers' logits in float32.

    INFER_LLAMA_CPP=~/src/llama.cpp python -m pytest tests/integration/test_gguf_llamacpp.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infer.testing.gguf_files import build_gemma3_for_gguf, build_sparse_qwen2_moe

from .test_gguf import _run

LLAMA_CPP = Path(os.environ.get("INFER_LLAMA_CPP", "/nonexistent")).expanduser()
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
    reason="INFER_LLAMA_CPP does not name a llama.cpp source tree",
)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))


def convert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's converter, run as benchmarks/make_gguf.py runs it (in a child process)."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_gguf.py"), str(LLAMA_CPP),
                    str(folder), str(out), "--outtype", outtype],
                   check=True, capture_output=True)  # fmt: skip
    return out


@pytest.mark.parametrize(
    "kind", ["llama", "llama3", "qwen2", "qwen3", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"]
)
def test_llama_cpps_f32_file_gives_its_folders_logits(kind, tiny_checkpoints, tmp_path):
    folder = tiny_checkpoints.get(kind)
    if kind == "gemma3":  # (one in llama.cpp's layer pattern)
        folder = build_gemma3_for_gguf(tmp_path / "gemma3", tiny_checkpoints["llama"])
    if kind == "qwen2_moe":  # (llama.cpp's has no dense layers between)
        folder = build_sparse_qwen2_moe(tmp_path / "qwen2_moe", tiny_checkpoints["qwen2_moe"])
    file = convert(folder, tmp_path / f"{kind}.gguf")
    prompts = [list(range(5, 140)), [7, 8, 9]]  # past the windows and original contexts
    want_lps, want_tokens, _ = _run(folder, prompts=prompts)
    got_lps, got_tokens, _ = _run(file, prompts=prompts)
    torch.testing.assert_close(got_lps, want_lps, rtol=0, atol=1e-5)
    assert got_tokens == want_tokens


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K"])
def test_llama_quantized_files_give_transformers_logits(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    from infer.testing.checkpoints import build_all
    from infer.testing.gguf_files import build_wide_llama

    quantize = LLAMA_CPP / "build" / "bin" / "llama-quantize"
    if not quantize.is_file():
        pytest.skip("no build/bin/llama-quantize in INFER_LLAMA_CPP")
    wide = build_wide_llama(tmp_path / "wide", build_all()["llama"])
    f16 = convert(wide, tmp_path / "wide-f16.gguf", "f16")
    file = tmp_path / f"wide-{kind}.gguf"
    subprocess.run([str(quantize), str(f16), str(file), kind], check=True, capture_output=True)
    prompts = [list(range(5, 40)), [7, 8, 9]]
    lps, tokens, _ = _run(file, prompts=prompts)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name,
                                                 dtype=torch.float32).eval()  # fmt: skip
    want = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            want += [logits[i, t].item() for i, t in enumerate(ids[1:])]
    torch.testing.assert_close(lps, torch.tensor(want), rtol=0, atol=1e-4)

"""``infer bench kernels``: two builds of the C++ kernels timed side by side, outputs compared."""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from infer.bench.cli import checkout_benchmark
from infer.runner.cpu.kernels import CSRC, build_library, cpu_kernels, find_compiler, kernels_dir

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ kernels on this machine")
kb = checkout_benchmark("kernels")  # benchmarks/kernels.py: outside the package


def _args(out: Path, against: str, **kw) -> argparse.Namespace:
    base = dict(against=against, cases="linear,decode,prefill", rows="1,17", decode="2x40",
                prefill="1x40", step="2x20", step_count=8, model=None, repeats=1, seed=0,
                out=str(out))  # fmt: skip
    return argparse.Namespace(**(base | kw))


def test_the_same_sources_give_the_same_bits_in_every_case(tmp_path):
    assert kb.run(_args(tmp_path, str(CSRC))) == 0
    report = json.loads((tmp_path / "kernels.json").read_text())
    sizes = [(r["case"], r["size"]) for r in report["rows"]]
    assert sizes == [("linear", "1 rows"), ("linear", "17 rows"), ("decode", "2 x 40"),
                     ("prefill", "1 x 40")]  # fmt: skip
    for r in report["rows"]:
        assert r["same_bits"] and r["a_ms"] > 0 and r["b_ms"] > 0
    assert "| linear | 17 rows |" in (tmp_path / "kernels.md").read_text()


def test_bad_revisions_and_cases_are_named(tmp_path):
    with pytest.raises(SystemExit, match="cannot read the kernels at 'no-such-revision'"):
        kb.run(_args(tmp_path, "no-such-revision"))
    with pytest.raises(SystemExit, match=r"unknown case\(s\) gemm"):
        kb.run(_args(tmp_path, str(CSRC), cases="linear,gemm"))
    with pytest.raises(SystemExit, match="bad size '16by128'"):
        kb.parse_pairs("16by128")


def test_a_kernel_that_computes_otherwise_is_reported(tmp_path, monkeypatch, caplog):
    """A changed copy of the sources (decode attention scaling its scores twice) is built: the
    changed file only, the others' objects are this revision's (a cache of its own, holding
    them). Its different outputs are reported and make the command fail."""
    build_library(find_compiler(), CSRC)  # (this revision's objects, in the shared cache)
    cache = tmp_path / "kernels"
    shutil.copytree(kernels_dir() / "objects", cache / "objects")
    monkeypatch.setenv("INFER_KERNELS_DIR", str(cache))
    changed = tmp_path / "csrc"
    shutil.copytree(CSRC, changed)
    src = changed / "paged_attention.cpp"
    # In the dispatcher (every CPU's path goes through it), not in one SIMD variant.
    entry = "                           int64_t max_blocks, float scale, int64_t window, int num_threads) {\n"
    text = src.read_text()
    at = text.index(entry, text.index("int infer_decode_attention(")) + len(entry)
    src.write_text(text[:at] + "  scale *= 2.f;\n" + text[at:])
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="infer.runner"):
        assert kb.run(_args(out, str(changed), cases="decode")) == 1
    (row,) = json.loads((out / "kernels.json").read_text())["rows"]
    assert row["case"] == "decode" and not row["same_bits"]
    sources = len(list(CSRC.glob("*.cpp")))
    built = re.findall(r"compiling the C\+\+ CPU kernels \((\d+) of (\d+) sources", caplog.text)
    assert built == [("0", str(sources)), ("1", str(sources))]  # this revision's, the copy


def test_the_step_case_times_the_real_decode_step_with_each_library(
    tmp_path, tiny_checkpoints, monkeypatch
):
    """Both libraries run the tiny Llama's layer loop, A B B A, and the engine still decodes."""
    from infer.runner.cpu import kernels as rk

    if rk.cpu_kernels().linear_kind < 1:
        pytest.skip("the fast decode path needs the tiled linear kernels")
    calls: list[int] = []
    real = rk.CpuKernels.decode_layers_into

    def counted(self, *args):
        calls.append(id(self))
        return real(self, *args)

    monkeypatch.setattr(rk.CpuKernels, "decode_layers_into", counted)
    out = tmp_path / "out"
    args = _args(out, str(CSRC), cases="step", model=str(tiny_checkpoints["llama"]))
    assert kb.run(args) == 0
    (row,) = json.loads((out / "kernels.json").read_text())["rows"]
    assert row["case"] == "step" and row["size"] == "2 x 20" and row["same_bits"] is None
    assert row["a_ms"] > 0 and row["b_ms"] > 0
    assert "| step | 2 x 20 |" in (out / "kernels.md").read_text()
    timed = calls[-8:]  # the 8 timed steps, after the prompts' prefill and first decode
    assert len(set(timed)) == 2 and timed[0] == timed[3] == timed[4] == timed[7] != timed[1]
    with pytest.raises(SystemExit, match="at least 4"):
        kb.run(_args(out, str(CSRC), cases="step", step_count=3))


def test_a_step_that_fails_its_requests_stops_the_step_case(
    tmp_path, tiny_checkpoints, monkeypatch
):
    """A library whose layer loop fails (here: B raises) gives no timing, not empty steps."""
    from infer.runner.cpu import kernels as rk

    if rk.cpu_kernels().linear_kind < 1:
        pytest.skip("the fast decode path needs the tiled linear kernels")
    real = rk.CpuKernels.decode_layers_into
    seen: list[int] = []

    def b_fails(self, *args):
        seen.append(id(self))
        if len(set(seen)) > 1 and id(self) != seen[0]:
            raise ValueError("B cannot run this loop")
        return real(self, *args)

    monkeypatch.setattr(rk.CpuKernels, "decode_layers_into", b_fails)
    args = _args(tmp_path, str(CSRC), cases="step", model=str(tiny_checkpoints["llama"]))
    with pytest.raises(SystemExit, match="library B failed"):
        kb.run(args)

"""The benchmarks stay apart from the product: their dependencies are the ``bench`` extra."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTRA = ("httpx", "openai", "matplotlib")


def test_product_imports_do_not_load_the_bench_extra():
    """``infer --help``, ``infer serve`` and ``from infer import LLM`` never import the extra."""
    code = (
        "import sys, infer, infer.cli, infer.llm, infer.server.app, infer.server.cli\n"
        "infer.cli.build_parser()\n"
        "print(' '.join(m for m in ('matplotlib', 'openai') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "", f"product import loaded: {out.stdout.strip()}"


def test_every_subcommand_is_registered():
    from infer.cli import SUBCOMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == list(SUBCOMMANDS)


@pytest.mark.parametrize("missing", EXTRA)
def test_bench_without_the_extra_names_it(missing, monkeypatch, capsys, tmp_path):
    from infer.bench.cli import main

    monkeypatch.setitem(sys.modules, missing, None)  # import of it now fails
    with pytest.raises(SystemExit) as exc:
        main(["bench", "micro", "kv-cache", "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert missing in err and 'pip install -e ".[bench]"' in err
    assert not any(tmp_path.iterdir())  # nothing ran


def test_extras_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]}
    assert not names & set(EXTRA), "bench-only packages must not be hard dependencies"
    for extra in ("bench", "test"):
        have = {d.split(">")[0].strip() for d in project["optional-dependencies"][extra]}
        assert set(EXTRA) <= have, extra


def test_default_report_folder_is_outside_the_source_tree():
    from infer.bench import DEFAULT_OUT
    from infer.bench.cli import STUDIES, register, study_module

    assert DEFAULT_OUT == "bench-results"
    assert "bench-results/" in (ROOT / ".gitignore").read_text().splitlines()

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    for argv in (
        ["bench", "serve"],
        ["bench", "client"],
        ["bench", "ablation", "--model", "m"],
        ["bench", "engine"],
        ["bench", "vs-vllm"],
        ["bench", "decode-curve"],
        ["bench", "gpu"],
        ["bench", "results"],
    ):
        args = parser.parse_args(argv)
        assert str(args.out).startswith(DEFAULT_OUT), argv
    for study in STUDIES:  # the checkout's studies too
        parser = study_module(study).build_parser()
        args = parser.parse_args(["all"] if study == "micro" else [])
        assert str(args.out).startswith(DEFAULT_OUT), study


def test_a_study_takes_its_own_flags(capsys):
    """``infer bench <study> ...`` hands every flag to the study's parser in benchmarks/:
    its usage names the command, a bad flag is its error (exit 2), ``-h`` its help."""
    from infer.bench.cli import STUDIES, main, study_module

    assert set(STUDIES) >= {"quant", "int4", "moe", "lora", "spec", "structured", "prefix", "micro"}
    with pytest.raises(SystemExit) as exc:
        main(["bench", "structured", "--runs", "2", "--no-such-flag"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: infer bench structured" in err and "--no-such-flag" in err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "tensor-parallel", "-h"])
    assert exc.value.code == 0
    assert "--sizes" in capsys.readouterr().out
    for study in STUDIES:  # every study is a file there with a parser
        assert study_module(study).build_parser().prog == f"infer bench {study}"


def test_every_benchmark_script_runs_as_a_script(tmp_path):
    """``python benchmarks/bench_<name>.py ...`` runs as ``infer bench <name> ...`` does (the
    README says so), from any folder: each script's ``--help``, all at once."""
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    procs = {
        s.name: subprocess.Popen(
            [sys.executable, str(s), "--help"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for s in scripts
    }
    failed = {}
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=300)
            if proc.returncode != 0 or "usage:" not in out:
                failed[name] = out[-500:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert len(scripts) >= 10 and not failed, failed

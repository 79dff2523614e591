"""``infer generate`` (the README's one-shot command): its text is the engine's greedy text,
and a start-up error is one line naming the problem (exit 1), not a traceback."""

from __future__ import annotations

from infer import LLM, SamplingParams
from infer.cli import main

PROMPTS = ["The quick brown fox", "def main():"]


def test_generate_prints_the_engines_greedy_text(tiny_checkpoints, capsys):
    path = str(tiny_checkpoints["llama"])
    want = [
        o.outputs[0].text
        for o in LLM(path, dtype="float32").generate(
            PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        )
    ]
    args = ["generate", "--model", path, "--dtype", "float32", "--max-tokens", "6",
            "--temperature", "0", "--ignore-eos"]  # fmt: skip
    assert main([*args, "--prompt", PROMPTS[0]]) == 0
    captured = capsys.readouterr()
    assert captured.out == want[0] + "\n"
    assert "[6 tokens in" in captured.err
    # several prompts: each under its own header, in order
    assert main([*args, *(x for p in PROMPTS for x in ("--prompt", p))]) == 0
    out = capsys.readouterr().out
    assert out == "".join(
        f"--- [{i}] {p!r}\n{w}\n" for i, (p, w) in enumerate(zip(PROMPTS, want, strict=True))
    )


def test_a_start_up_error_is_one_line(tiny_checkpoints, capsys):
    path = str(tiny_checkpoints["llama"])
    rc = main(["generate", "--model", path, "--max-model-len", "100000", "--prompt", "x"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "error: the engine could not start: max_model_len 100000 exceeds" in err
    assert "Traceback" not in err


def test_bad_sampling_values_are_said_before_the_model_loads(capsys):
    rc = main(["generate", "--model", "/no/such/model", "--max-tokens", "0", "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: max_tokens must be at least 1, got 0" in err  # (not the folder)


def test_chat_without_a_template_is_one_line(tiny_checkpoints, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama"], model)
    (model / "chat_template.jinja").unlink()
    rc = main(["generate", "--model", str(model), "--chat", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: --chat needs a chat template" in err
    assert "Traceback" not in err

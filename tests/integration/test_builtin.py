"""Built-in models: a few training steps of each recipe, then the saved folder is checked the
way users meet it -- loaded by transformers and by infer, with matching logits.

The toy trains with its real preset (just fewer steps); the Llama path runs the small preset's
recipe at a reduced width so the default suite stays fast. The full ``small`` build is ``slow``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from infer.builtin.presets import SMALL, TOY
from infer.builtin.textdata import CHAR_ALPHABET
from infer.builtin.train import MANIFEST, sha256_file, train
from infer.cli import main as infer_main

TOY_STEPS = 60
# The small recipe (Llama, byte-level BPE, GQA, bf16 autocast) at test size.
MINI_LLAMA = dataclasses.replace(
    SMALL,
    name="mini",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=512,
    context_len=128,
    seq_len=64,
    batch_size=8,
    final_seq_len=128,  # the last steps on full-context windows, as in the real recipe
    sample_tokens=20,
    threads=1,  # tiny matmuls: a second thread only adds sync overhead
)


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    return train(TOY, out, seed=0, steps=TOY_STEPS, progress=False)


@pytest.fixture(scope="module")
def mini_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mini")
    return train(MINI_LLAMA, out, seed=0, steps=25, progress=False)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_toy_loss_falls(toy_run):
    losses = toy_run.losses
    assert len(losses) == TOY_STEPS
    # Starts near uniform over the 120 characters (ln 120 = 4.79), then learns frequencies.
    assert abs(losses[0] - torch.log(torch.tensor(120.0)).item()) < 0.3
    assert _mean(losses[-10:]) < _mean(losses[:5]) - 1.0
    assert toy_run.val_loss < losses[0] - 1.0


def test_toy_has_the_benchmark_models_shape(toy_run):
    from transformers import AutoConfig

    assert toy_run.num_params == 56_768  # the NanoGPT CPU benchmark model reports 0.056769M
    config = AutoConfig.from_pretrained(toy_run.out_dir)
    assert config.model_type == "gpt2"
    assert (config.n_positions, config.n_embd, config.n_layer, config.n_head) == (64, 32, 4, 4)


def test_toy_loads_in_transformers(toy_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = toy_run.out_dir
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 56_768
    assert len(tok) == model.config.vocab_size == 120
    # Character level: one token per character, exact round trip, special tokens intact.
    text = "The “quick” fox — jumps:\n\tx = [1, 2]…"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert set(CHAR_ALPHABET) >= set(text)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert chat_ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.decode(chat_ids) == chat
    assert tok.eos_token_id == 0
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, 2]


def test_unknown_characters_become_unk(toy_run):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_run.out_dir)
    ids = tok("a\u4e2db", add_special_tokens=False)["input_ids"]
    assert ids[1] == tok.unk_token_id and len(ids) == 3
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_manifest_and_sample(toy_run):
    manifest = json.loads((toy_run.out_dir / MANIFEST).read_text())
    assert manifest["preset"] == "toy" and manifest["steps"] == TOY_STEPS
    assert manifest["weights_sha256"] == sha256_file(toy_run.out_dir / "model.safetensors")
    assert manifest["sample"] == toy_run.sample
    assert toy_run.sample.startswith(TOY.sample_prompt)
    assert len(toy_run.sample) > len(TOY.sample_prompt)


def test_same_seed_same_weights_other_seed_differs(toy_run, tmp_path):
    again = train(TOY, tmp_path / "again", seed=0, steps=TOY_STEPS, progress=False)
    assert again.losses == toy_run.losses
    assert again.weights_sha256 == toy_run.weights_sha256
    assert again.sample == toy_run.sample
    other = train(TOY, tmp_path / "other", seed=1, steps=TOY_STEPS, progress=False)
    assert other.weights_sha256 != toy_run.weights_sha256
    assert other.losses != toy_run.losses


def test_llama_recipe_is_deterministic(mini_run, tmp_path):
    # Muon, bf16 autocast, grouped-query attention, the extra API docstrings and the BPE
    # tokenizer: still bit-reproducible.
    again = train(MINI_LLAMA, tmp_path / "again", seed=0, steps=25, progress=False)
    assert again.losses == mini_run.losses
    assert again.weights_sha256 == mini_run.weights_sha256
    assert (again.out_dir / "tokenizer.json").read_bytes() == (
        mini_run.out_dir / "tokenizer.json"
    ).read_bytes()


def test_training_leaves_torch_state_alone(tmp_path):
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    train(TOY, tmp_path / "t", seed=5, steps=2, progress=False)
    assert torch.equal(torch.rand(3), expected)  # caller's RNG stream continues untouched
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()


def _engine_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from infer.model import load_model
    from infer.runner.attention import dense_context

    model = load_model(path, dtype=torch.float32)
    spec = model.spec
    ctx = dense_context(spec.num_layers, spec.num_kv_heads, spec.head_dim, len(ids))
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), ctx)
        return model.compute_logits(hidden)


def _hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("run", ["toy_run", "mini_run"])
def test_engine_logits_match_transformers(run, request):
    from transformers import AutoTokenizer

    result = request.getfixturevalue(run)
    tok = AutoTokenizer.from_pretrained(result.out_dir)
    text = "The import statement combines two operations; it searches for the module."
    ids = tok(text, add_special_tokens=False)["input_ids"][: min(64, tok.model_max_length)]
    ours, theirs = _engine_logits(result.out_dir, ids), _hf_logits(result.out_dir, ids)
    assert ours.shape == theirs.shape == (len(ids), len(tok))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_llama_recipe_folder(mini_run):
    from transformers import AutoConfig, AutoTokenizer

    path = mini_run.out_dir
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "llama"
    assert config.num_key_value_heads == 2 and config.num_attention_heads == 4
    assert config.eos_token_id == 0 and config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(path)
    text = "Unicode: héllo wörld, and a   few spaces.\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.chat_template is not None
    assert _mean(mini_run.losses[-5:]) < _mean(mini_run.losses[:3]) - 0.5
    assert all(torch.isfinite(torch.tensor(mini_run.losses)))


def test_cli_train_into_folder(tmp_path, capsys):
    out = tmp_path / "cli-toy"
    assert infer_main(["train", "--preset", "toy", "--out", str(out), "--steps", "3",
                       "--seed", "2", "--no-progress"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["seed"] == 2 and manifest["steps"] == 3
    assert f"{manifest['final_loss']:.4f}" in printed
    assert manifest["sample"] in printed
    assert not list(tmp_path.glob("cli-toy.tmp-*"))  # the temp build was renamed into place
    with pytest.raises(SystemExit, match="not empty"):
        infer_main(["train", "--preset", "toy", "--out", str(out), "--steps", "3"])


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("INFER_SLOW_TESTS"),
    reason="trains the real small model (2-4 min); set INFER_SLOW_TESTS=1 to run",
)
def test_small_builds_and_writes_english(tmp_path, monkeypatch):
    """The real default model, full recipe (2-4 minutes on 2 quiet cores)."""
    from infer.builtin import ensure_builtin_model

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("INFER_BUILTIN_STEPS", raising=False)
    path = ensure_builtin_model("small", progress=False)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["num_params"] == 4_196_608  # "4.2M", as the preset says
    assert manifest["val_loss"] <= 5.24  # the previous recipe's held-out loss
    words = manifest["sample"].split()
    common = {"the", "a", "is", "of", "to", "and", "in", "be", "that", "it"}
    assert sum(w.lower().strip(".,;:") in common for w in words) >= 5
    ids = list(range(3, 40))
    torch.testing.assert_close(
        _engine_logits(path, ids), _hf_logits(path, ids), atol=1e-4, rtol=1e-4
    )

"""The pieces of the built-in models' training recipe: the held-out measure, the extra
training text, Muon, the schedule and the window phases. No training runs here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from infer.builtin.presets import SMALL, TOY
from infer.builtin.textdata import (
    OVERLAP_NGRAM,
    _word_ngrams,
    batch_windows,
    split_docs,
    training_docs,
)
from infer.builtin.train import (
    RESIDUAL_OUTPUTS,
    Muon,
    _newton_schulz,
    build_model,
    evaluate,
    lr_ratio,
    make_optimizers,
)
from infer.data.corpus import load_corpus

TINY = dataclasses.replace(
    SMALL,
    name="tiny",
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    vocab_size=64,
    context_len=32,
    seq_len=16,
    batch_size=4,
    final_seq_len=32,
    bf16_autocast=False,
)


@pytest.fixture(scope="module")
def corpus_split():
    return split_docs(load_corpus())


def test_held_out_loss_is_a_per_token_mean_over_context_windows():
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(TINY, zero_init_residual=False)).eval()
    stream = torch.randint(0, TINY.vocab_size, (7 * TINY.context_len + 5,))
    # Seven full windows; chunked 2 (64 tokens per step) or 7 at a time: the same number, the
    # per-token mean over the seven windows (the old measure, a mean of equal-sized batch means,
    # is this same number).
    by_two = evaluate(model, TINY, stream)
    by_seven = evaluate(model, dataclasses.replace(TINY, batch_size=14), stream)
    windows = batch_windows(stream, torch.arange(7) * TINY.context_len, TINY.context_len)
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, TINY.vocab_size), windows[:, 1:].reshape(-1)
    ).item()
    assert by_two == pytest.approx(expected, rel=1e-5)
    assert by_seven == pytest.approx(expected, rel=1e-5)
    # val_windows caps the count: the first three windows only.
    capped = evaluate(model, dataclasses.replace(TINY, val_windows=3), stream)
    assert capped == pytest.approx(evaluate(model, TINY, stream[: 3 * 32 + 1]), rel=1e-5)


def test_held_out_measure_of_the_presets_is_unchanged():
    # The previous code averaged 8 batches of ``batch_size`` windows of ``seq_len``: toy
    # 256 x 64 characters, small 32 x 1024 tokens (its held-out split has only 20).
    assert TOY.val_windows == 8 * TOY.batch_size and TOY.context_len == TOY.seq_len == 64
    assert SMALL.val_windows == 8 * 4 and SMALL.context_len == 1024


def test_extra_training_text_keeps_held_out_text_unseen(corpus_split):
    train_docs, val_docs = corpus_split
    extra = training_docs(val_docs)
    assert extra == training_docs(val_docs)  # a fixed function of the running Python
    assert sum(map(len, extra)) > 200_000
    held_out = set().union(*(_word_ngrams(d) for d in val_docs))
    for doc in extra:
        for paragraph in doc.split("\n\n"):
            assert not (_word_ngrams(paragraph) & held_out)
    assert not set(extra) & set(val_docs)
    assert OVERLAP_NGRAM == 13


@pytest.mark.parametrize("bf16", [True, False])
def test_newton_schulz_orthogonalises(bf16):
    """In bf16 where the CPU multiplies it in hardware, else in float32: both near-orthogonal."""
    torch.manual_seed(0)
    for rows, cols in [(64, 32), (32, 64), (48, 48)]:
        # Singular values spread over 1.5 orders of magnitude all come out near 1.
        k = min(rows, cols)
        u, _ = torch.linalg.qr(torch.randn(rows, k))
        v, _ = torch.linalg.qr(torch.randn(cols, k))
        grad = u @ torch.diag(torch.logspace(-1.5, 0, k)) @ v.T
        singular = torch.linalg.svdvals(_newton_schulz(grad, bf16=bf16).float())
        assert singular.min() > 0.5 and singular.max() < 1.3, singular


def test_bf16_matmuls_only_where_the_cpu_multiplies_bf16_unless_forced(monkeypatch, tmp_path):
    """A preset's bf16 (autocast, Muon) runs where the CPU has AVX-512 BF16 or AMX (elsewhere
    torch emulates bf16 matmuls: the default model's build took hours instead of minutes);
    INFER_BUILTIN_BF16=1 / 0 forces it on / off; a preset without it never has it. A float32
    build of a bf16 recipe has a cache folder of its own; a bad value is an error naming it."""
    from infer.builtin import presets
    from infer.builtin.cache import builtin_dir

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(presets.BF16_ENV, raising=False)
    for native in (True, False):
        monkeypatch.setattr(presets, "native_bf16", lambda native=native: native)
        assert presets.bf16_matmuls(SMALL) is native
        assert builtin_dir("small").name.endswith("-fp32") is not native
        for forced, want in (("1", True), ("true", True), ("0", False), ("False", False)):
            monkeypatch.setenv(presets.BF16_ENV, forced)
            assert presets.bf16_matmuls(SMALL) is want
            assert presets.bf16_matmuls(TOY) is False
            assert builtin_dir("small").name.endswith("-fp32") is not want
            assert not builtin_dir("toy").name.endswith("-fp32")
        monkeypatch.delenv(presets.BF16_ENV)
    monkeypatch.setenv(presets.BF16_ENV, "yes")
    with pytest.raises(ValueError, match="INFER_BUILTIN_BF16='yes': use 1 or 0"):
        presets.bf16_matmuls(SMALL)


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ({"avx2", "fma"}, False),
        ({"avx512f", "avx512_bf16"}, True),
        ({"amx_tile", "amx_bf16"}, True),
        (set(), False),
    ],  # fmt: skip
)
def test_native_bf16_reads_the_cpu_flags(flags, native, monkeypatch):
    from infer.builtin import presets
    from infer.runner.cpu import kernels

    monkeypatch.setattr(kernels, "cpu_flags_line", lambda: "flags\t\t: " + " ".join(sorted(flags)))
    assert presets.native_bf16() is native


def test_optimizers_split_hidden_matrices_from_embeddings_and_norms():
    torch.manual_seed(0)
    model = build_model(TINY)
    adamw, muon = make_optimizers(model, TINY)
    assert isinstance(muon, Muon)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    adam_names = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert not muon_names & adam_names
    assert muon_names | adam_names == set(names.values())
    assert all(n.endswith("proj.weight") for n in muon_names)
    assert "model.embed_tokens.weight" in adam_names
    assert muon.param_groups[0]["peak_lr"] == TINY.muon_lr
    (only,) = make_optimizers(model, dataclasses.replace(TINY, muon_lr=None))
    assert sum(len(g["params"]) for g in only.param_groups) == len(names)


def test_residual_outputs_start_at_zero():
    torch.manual_seed(0)
    model = build_model(TINY)
    zeroed = [n for n, p in model.named_parameters() if not p.any()]
    assert zeroed and all(n.endswith(RESIDUAL_OUTPUTS) for n in zeroed)
    assert len(zeroed) == 2 * TINY.num_layers
    toy = build_model(TOY)
    assert all(p.any() for n, p in toy.named_parameters() if n.endswith("weight"))


def test_schedule_and_window_phases():
    steps = SMALL.steps
    ratios = [lr_ratio(SMALL, s, steps) for s in range(steps)]
    assert ratios[0] == pytest.approx(1 / SMALL.warmup_steps)
    assert max(ratios) == pytest.approx(1.0)
    assert ratios[-1] == pytest.approx(SMALL.min_lr_ratio, abs=0.01)
    decay = ratios[SMALL.warmup_steps :]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    shapes = [SMALL.window_shape(s, steps) for s in range(steps)]
    assert shapes[0] == (SMALL.batch_size, SMALL.seq_len)
    assert shapes[-1] == (SMALL.tokens_per_step // 1024, 1024)
    assert all(b * n == SMALL.tokens_per_step for b, n in shapes)
    long = sum(n == 1024 for _, n in shapes)
    assert long == round(steps * SMALL.final_frac)
    assert TOY.window_shape(steps - 1, steps) == (TOY.batch_size, TOY.seq_len)
    cosine = [lr_ratio(TOY, s, TOY.steps) for s in range(TOY.steps)]
    assert cosine[-1] == pytest.approx(TOY.min_lr_ratio, abs=1e-4)


def test_preset_checks_the_final_windows():
    with pytest.raises(ValueError, match="final_seq_len"):
        dataclasses.replace(TINY, final_seq_len=64)
    with pytest.raises(ValueError, match="divide"):
        dataclasses.replace(TINY, final_seq_len=24)

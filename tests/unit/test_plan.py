from __future__ import annotations

import pytest

from infer.cli import main
from infer.plan import CapacityPlan

LLAMA_70B = dict(num_layers=80, num_kv_heads=8, num_heads=64, head_dim=128, kv_dtype_bytes=2)


def test_llama_31_70b_published_shape():
    p = CapacityPlan(
        **LLAMA_70B,
        weights_bytes=140 * 10**9,
        memory_bytes=320 * 10**9,
        concurrency=50,
        context_len=4096,
    )
    assert p.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert round(p.bytes_per_sequence / 1e9, 2) == 1.34  # Llama 3.1 70B, fp16, 4096 tokens: 1.34 GB
    assert round(p.mha_bytes_per_sequence / 1e9, 1) == 10.7  # without GQA
    # (320 - 140) GB / 50 users / 327,680 bytes per token: ~11,000 tokens of context per user
    assert p.max_context_per_user == 180 * 10**9 // 50 // 327_680 == 10_986
    assert p.max_users_at_context == 180 * 10**9 // (327_680 * 4096) == 134


def test_int8_kv_doubles_capacity():
    fp16 = CapacityPlan(
        **LLAMA_70B, weights_bytes=0, memory_bytes=327_680 * 1000, concurrency=1, context_len=4096
    )
    int8 = CapacityPlan(
        **{**LLAMA_70B, "kv_dtype_bytes": 1},
        weights_bytes=0,
        memory_bytes=327_680 * 1000,
        concurrency=1,
        context_len=4096,
    )
    assert int8.kv_tokens == 2 * fp16.kv_tokens


def test_cli_prints_the_plan(capsys):
    rc = main(
        [
            "plan",
            "--layers",
            "80",
            "--kv-heads",
            "8",
            "--heads",
            "64",
            "--head-dim",
            "128",
            "--weights",
            "140GB",
            "--memory",
            "320GB",
            "--concurrency",
            "50",
            "--context",
            "4096",
            "--dtype",
            "fp16",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "327,680 bytes" in out and "1.34 GB" in out and "10,986 tokens" in out


def test_cli_reads_a_model_folder_without_loading_weights(tiny_checkpoints, capsys):
    from infer.model.loader import load_model_spec

    path = tiny_checkpoints["llama"]
    spec = load_model_spec(path)
    rc = main(["plan", "--model", str(path), "--memory", "1GiB", "--concurrency", "4"])
    out = capsys.readouterr().out
    bpt = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    assert rc == 0 and f"{bpt:,} bytes" in out


def test_cli_reads_the_folder_with_hf_overrides(tiny_checkpoints, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    path = str(tiny_checkpoints["llama"])
    rc = main(["plan", "--model", path, "--memory", "1GiB", "--hf-overrides",
               '{"max_position_embeddings": 96}'])  # fmt: skip
    assert rc == 0 and "KV per 96-token sequence" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--hf-overrides must be a JSON object"):
        main(["plan", "--model", path, "--memory", "1GiB", "--hf-overrides", "[1]"])


SHAPE = ["plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--weights", "1GB",
         "--memory", "16GiB", "--context", "100"]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--context", "-5"], "--context must be at least 1, got -5"),
        (["--block-size", "0"], "--block-size must be at least 1, got 0"),
        (["--model", "/nowhere"], "model folder /nowhere does not exist"),
        (["--dtype", "fp77"], "invalid choice: 'fp77'"),
        (["--memory", "lots"], "cannot parse a byte size from 'lots'"),
    ],
)
def test_bad_input_is_one_line_naming_it(extra, message, capsys):
    """No wrong plan printed with exit 0, no traceback: a line naming the flag, exit non-zero."""
    with pytest.raises(SystemExit) as e:
        main(SHAPE + extra)
    said = str(e.value.code) if isinstance(e.value.code, str) else capsys.readouterr().err
    assert message in said and e.value.code != 0
    assert "Traceback" not in said


def test_byte_sizes_take_what_their_message_offers():
    from infer.config import parse_bytes

    assert [parse_bytes(t) for t in ("1e9", "2GiB", "1.5e3KB", "512")] == [
        10**9, 2 * 2**30, 1_500_000, 512]  # fmt: skip

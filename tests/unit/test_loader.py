"""Loader behaviour: shard handling, config dialects, model resolution, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.engine.model_source import resolve_model_path
from infer.model import ModelLoadError, load_model, load_model_spec
from infer.runner.attention import dense_context

IDS = torch.tensor(
    [5, 99, 321, 7, 1000, 42, 42, 8, 600, 13, 77, 250, 3, 900, 64, 511, 128, 2, 19, 20]
)


def logits_of(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    spec = model.spec
    ctx = dense_context(spec.num_layers, spec.num_kv_heads, spec.head_dim, len(ids))
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), ctx))


def copy_checkpoint(src: Path, tmp_path: Path, name: str = "model") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg


# --------------------------------------------------------------------------- weights


def test_sharded_checkpoint_loads_like_single_file(tiny_checkpoints):
    sharded_dir = tiny_checkpoints["llama_sharded"]
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(list(sharded_dir.glob("*.safetensors"))) > 1
    single = load_model(tiny_checkpoints["llama"], torch.float32)
    sharded = load_model(sharded_dir, torch.float32)
    a, b = single.state_dict(), sharded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(logits_of(single), logits_of(sharded))


def test_shards_without_index_are_scanned(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints["llama_sharded"], tmp_path)
    (path / "model.safetensors.index.json").unlink()
    reference = load_model(tiny_checkpoints["llama"], torch.float32)
    assert torch.equal(logits_of(load_model(path, torch.float32)), logits_of(reference))


def test_fused_projections_hold_the_checkpoint_tensors(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    tensors = load_file(str(path / "model.safetensors"))
    model = load_model(path, torch.float32)
    p = "model.layers.1"
    qkv = model.layers[1].attn.qkv_proj.weight
    expected = torch.cat([tensors[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(qkv, expected)
    gate_up = model.layers[1].mlp.gate_up_proj.weight
    expected = torch.cat([tensors[f"{p}.mlp.{x}_proj.weight"] for x in ("gate", "up")])
    assert torch.equal(gate_up, expected)


def test_gpt2_loads_without_transformer_prefix(tiny_checkpoints, tmp_path):
    """NanoGPT-style exports name tensors ``h.0...`` rather than ``transformer.h.0...``."""
    path = copy_checkpoint(tiny_checkpoints["gpt2"], tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    save_file(
        {k.removeprefix("transformer."): v for k, v in tensors.items()},
        str(path / "model.safetensors"),
    )
    reference = load_model(tiny_checkpoints["gpt2"], torch.float32)
    assert torch.equal(logits_of(load_model(path, torch.float32)), logits_of(reference))


def test_unused_checkpoint_tensors_are_reported(tiny_checkpoints, tmp_path, caplog):
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["vision_tower.proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(path / "model.safetensors"))
    with caplog.at_level("WARNING", logger="infer.model.loader"):
        load_model(path)
    assert "vision_tower.proj.weight" in caplog.text


def test_bf16_load_converts_every_tensor(tiny_checkpoints):
    model = load_model(tiny_checkpoints["gemma3"], "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.bfloat16}


# --------------------------------------------------------------------------- config dialects


def test_legacy_llama3_rope_scaling_config(tiny_checkpoints, tmp_path):
    """Checkpoints in the wild spell rope as ``rope_theta`` + ``rope_scaling``."""
    path = copy_checkpoint(tiny_checkpoints["llama3"], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    rope = dict(cfg["rope_parameters"])
    theta = rope.pop("rope_theta")
    edit_config(path, rope_parameters=None, rope_theta=theta, rope_scaling=rope)
    reference = load_model(tiny_checkpoints["llama3"], torch.float32)
    legacy = load_model(path, torch.float32)
    assert torch.equal(logits_of(legacy), logits_of(reference))
    # ...and the scaling is really applied: dropping it changes the output.
    edit_config(path, rope_scaling=None)
    assert not torch.allclose(logits_of(load_model(path, torch.float32)), logits_of(reference))


def test_legacy_gemma3_config(tiny_checkpoints, tmp_path):
    """Old Gemma 3 configs: sliding_window_pattern, rope_local_base_freq, global rope_scaling."""
    path = copy_checkpoint(tiny_checkpoints["gemma3"], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    full = dict(cfg["rope_parameters"]["full_attention"])
    local = cfg["rope_parameters"]["sliding_attention"]["rope_theta"]
    theta = full.pop("rope_theta")
    edit_config(
        path,
        layer_types=None,
        _sliding_window_pattern=None,
        sliding_window_pattern=2,  # layers 1, 3 global; 0, 2 sliding, as in the fixture
        rope_parameters=None,
        rope_theta=theta,
        rope_local_base_freq=local,
        rope_scaling=full,
    )
    reference = load_model(tiny_checkpoints["gemma3"], torch.float32)
    legacy = load_model(path, torch.float32)
    ids = torch.arange(3, 3 + 40)  # longer than the sliding window
    assert torch.equal(logits_of(legacy, ids), logits_of(reference, ids))


def test_spec_reads_config_and_generation_config(tiny_checkpoints, tmp_path):
    spec = load_model_spec(tiny_checkpoints["qwen3"])
    assert (spec.architecture, spec.model_type) == ("Qwen3ForCausalLM", "qwen3")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size) == (4, 2, 32, 64)
    assert spec.torch_dtype == "float32"
    gpt2 = load_model_spec(tiny_checkpoints["gpt2"])
    assert gpt2.num_kv_heads == gpt2.num_heads == 4 and gpt2.max_position_embeddings == 512

    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    edit_config(path, eos_token_id=0)
    assert load_model_spec(path).eos_token_ids == (1, 2)
    (path / "generation_config.json").unlink()
    assert load_model_spec(path).eos_token_ids == (0,)


# --------------------------------------------------------------------------- errors


def test_missing_tensor_is_named(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path)


def test_untied_model_without_lm_head_is_an_error(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_model(path)


def test_gpt2_with_its_own_output_projection(tiny_checkpoints, tmp_path):
    """A GPT-2 fine-tune saved with ``tie_word_embeddings: false`` projects with its
    ``lm_head.weight`` (it was dropped unread, and the embeddings used): transformers'
    logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from infer.testing.checkpoints import _randomize

    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1024, n_positions=64,
                        tie_word_embeddings=False)  # fmt: skip
    hf = GPT2LMHeadModel(config).eval()
    _randomize(hf, 7)
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))
    with torch.no_grad():
        want = hf(IDS[None]).logits[0]
    assert torch.allclose(logits_of(load_model(tmp_path, torch.float32)), want, atol=1e-4)


def test_shape_mismatch_is_named(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    edit_config(path, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"gate_proj\.weight.*shape"):
        load_model(path)


def test_missing_config_is_named(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_spec(path)
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(path)


def test_missing_weights_file_is_named(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors in .*model"):
        load_model(path)


def test_unknown_architecture_is_named_with_the_supported_ones(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    edit_config(path, architectures=["MambaForCausalLM"], model_type="mamba")
    with pytest.raises(ModelLoadError) as info:
        load_model_spec(path)
    message = str(info.value)
    assert "MambaForCausalLM" in message
    for supported in (
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
        "GPT2LMHeadModel",
    ):
        assert supported in message


def test_unsupported_rope_type_is_named(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints["llama"], tmp_path)
    edit_config(path, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match="longrope"):
        load_model_spec(path)


def test_bad_shard_index_is_named(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints["llama_sharded"], tmp_path)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.norm.weight"
    index["weight_map"][name] = "model-99999-of-00007.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*model-99999-of-00007"):
        load_model(path)
    # an existing shard that does not hold the tensor (was safetensors' own error)
    other = next(f for f in sorted(set(index["weight_map"].values())) if "99999" not in f)
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    assert name not in load_file(str(path / other))
    with pytest.raises(ModelLoadError, match=rf"cannot read tensor '{name}' from .*{other}"):
        load_model(path)
    index_path.write_text("{not json")
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json"):
        load_model(path)
    index_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ModelLoadError, match="weight_map"):
        load_model(path)


# --------------------------------------------------------------------------- resolution


def fake_hub_cache(cache: Path, repo_id: str, source: Path, commit: str = "0123abcd" * 5) -> Path:
    """Lay ``source`` out as huggingface_hub does: blobs, a snapshot of links, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return monkeypatch


def test_model_id_resolves_from_hf_hub_cache(tiny_checkpoints, tmp_path, offline_hub):
    cache = tmp_path / "hub"
    snapshot = fake_hub_cache(cache, "acme/tiny-llama", tiny_checkpoints["llama"])
    offline_hub.setenv("HF_HUB_CACHE", str(cache))
    path = resolve_model_path("acme/tiny-llama")
    assert path == snapshot
    reference = load_model(tiny_checkpoints["llama"], torch.float32)
    assert torch.equal(logits_of(load_model(path, torch.float32)), logits_of(reference))


def test_model_id_resolves_from_hf_home(tiny_checkpoints, tmp_path, offline_hub):
    snapshot = fake_hub_cache(tmp_path / "hf" / "hub", "acme/tiny-qwen", tiny_checkpoints["qwen3"])
    offline_hub.setenv("HF_HOME", str(tmp_path / "hf"))
    assert resolve_model_path("acme/tiny-qwen") == snapshot
    assert resolve_model_path("acme/tiny-qwen@" + "0123abcd" * 5) == snapshot
    assert load_model_spec(resolve_model_path("acme/tiny-qwen")).model_type == "qwen3"


def test_uncached_model_id_is_an_error_not_a_download(tmp_path, offline_hub):
    offline_hub.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match=r"acme/absent.*not in the local Hugging Face cache"):
        resolve_model_path("acme/absent")


def test_local_folder_and_missing_folder(tiny_checkpoints, tmp_path):
    assert resolve_model_path(str(tiny_checkpoints["gpt2"])) == tiny_checkpoints["gpt2"].resolve()
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere"))
    file = tmp_path / "weights.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        resolve_model_path(str(file))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ROPE_CASES = {  # id: (rope_scaling, config.json fields beside it)
    "linear": ({"rope_type": "linear", "factor": 4.0}, {}),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, {}),
    "llama3": ({**LLAMA3, "original_max_position_embeddings": 256}, {}),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, {}),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                     "beta_fast": 16, "mscale": 0.7, "mscale_all_dim": 1.0}, {}),
    # Phi-3 style: the pretraining length beside rope_scaling (transformers prefers that one);
    # without one anywhere it is max_position_embeddings (it was 8192 for llama3)
    "yarn-top-level": ({"rope_type": "yarn", "factor": 4.0},
                       {"original_max_position_embeddings": 64}),
    "llama3-top-level": (LLAMA3, {"original_max_position_embeddings": 32}),
    "llama3-both": ({**LLAMA3, "original_max_position_embeddings": 128},
                    {"original_max_position_embeddings": 32}),
    "llama3-none": (LLAMA3, {}),
}  # fmt: skip


@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_variants_match_transformers(case):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from infer.model.rope import inverse_frequencies, rope_config_from_dict, rope_params

    scaling, beside = ROPE_CASES[case]
    raw = {"rope_theta": 50_000.0, "rope_scaling": dict(scaling), "max_position_embeddings": 2048,
           **beside}  # fmt: skip
    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=4, **raw)
    hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    ours = rope_config_from_dict(rope_params(raw), head_dim=64, max_position_embeddings=2048)
    inv_freq, scale = inverse_frequencies(ours)
    assert torch.allclose(inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(hf_scale)


WINDOW_CASES = [  # (architecture, config.json fields besides the shape, without layer_types)
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    ("Qwen2ForCausalLM", {"sliding_window": 8}),  # no switch: Qwen's default is off
    ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("Qwen2MoeForCausalLM", {"use_sliding_window": True, "sliding_window": 8,
                             "max_window_layers": 3}),
    ("Qwen3MoeForCausalLM", {"use_sliding_window": True, "sliding_window": 8,
                             "max_window_layers": 2}),
    ("Qwen3MoeForCausalLM", {"sliding_window": 8}),
    ("MistralForCausalLM", {"sliding_window": 8}),
    ("MistralForCausalLM", {"sliding_window": None}),
    ("MistralForCausalLM", {}),  # no key: transformers' 4096
    ("MixtralForCausalLM", {"sliding_window": 8}),
    ("MixtralForCausalLM", {}),
    ("LlamaForCausalLM", {"sliding_window": 8}),  # Llama never slides
]  # fmt: skip


@pytest.mark.parametrize("arch,fields", WINDOW_CASES, ids=lambda v: str(v)[:40])
def test_sliding_windows_are_the_layers_transformers_slides(arch, fields):
    """Each family's own reading of a config.json without ``layer_types`` (Qwen2-MoE slid the
    wrong layers, Qwen3-MoE too few; a Qwen config without ``use_sliding_window`` slid), and
    the defaults transformers gives a config that leaves a field out (Mixtral's rope base
    1e6 and norm eps 1e-5)."""
    import transformers

    from infer.model.registry import ARCHITECTURES

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
             "max_position_embeddings": 256, "num_experts": 4, "num_local_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 32}  # fmt: skip
    config = {"architectures": [arch], **shape, **fields}
    ours = ARCHITECTURES[arch].parse_config(dict(config))
    hf = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**config)
    if getattr(hf, "layer_types", None):
        want = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    elif arch == "LlamaForCausalLM":
        want = [None] * 4
    else:  # every layer with the config's window
        want = [hf.sliding_window or None] * 4
    assert list(ours.sliding_windows) == want
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.ropes[0].theta == hf.rope_parameters["rope_theta"]

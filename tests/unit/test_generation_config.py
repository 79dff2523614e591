"""The sampling defaults a model's generation_config.json recommends: which fields are read
(vLLM's), ``none``, another folder, the override, and a bad value refused naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer.model.generation_config import parse_override, sampling_defaults


def _folder(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_the_models_recommended_fields_become_sampling_defaults(tmp_path):
    model = _folder(tmp_path, "model", {
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": None,
        "repetition_penalty": 1.05, "max_new_tokens": 512, "max_length": 4096,
        "eos_token_id": [1, 2], "transformers_version": "4.51.0",
    })  # fmt: skip
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                        "repetition_penalty": 1.05, "max_tokens": 512}  # fmt: skip
    assert sampling_defaults(model, "none") == sampling_defaults(model, "vllm") == {}
    other = _folder(tmp_path, "other", {"temperature": 0.2})
    assert sampling_defaults(model, str(other)) == {"temperature": 0.2}
    override = parse_override('{"temperature": 0.3, "max_new_tokens": 8}')
    assert sampling_defaults(model, "auto", override)["temperature"] == 0.3
    assert sampling_defaults(model, "none", override) == {"temperature": 0.3, "max_tokens": 8}
    assert sampling_defaults(tmp_path) == {}  # no file: infer's own
    # transformers' own defaults are no recommendation (vLLM reads the difference from them);
    # an integral float where an integer belongs is that integer
    hf = _folder(tmp_path, "hf", {"top_k": 50, "temperature": 1.0, "max_new_tokens": 64.0})
    assert sampling_defaults(hf) == {"max_tokens": 64}
    assert isinstance(sampling_defaults(hf)["max_tokens"], int)


def test_a_value_no_request_could_take_is_refused_naming_the_file(tmp_path):
    model = _folder(tmp_path, "model", {"top_p": 0.0})
    with pytest.raises(ValueError, match=r"model/generation_config.json: top_p must be in"):
        sampling_defaults(model)
    assert sampling_defaults(model, "none") == {}
    with pytest.raises(ValueError, match="--generation-config /no/such: .* does not exist"):
        sampling_defaults(model, "/no/such")
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_override("[1]")
    nan = _folder(tmp_path, "nan", {"temperature": float("nan")})  # (json writes NaN)
    with pytest.raises(ValueError, match="temperature must be a finite number, got nan"):
        sampling_defaults(nan)
    with pytest.raises(ValueError, match="top_k must be a finite number, got 'x'"):
        sampling_defaults(model, "none", {"top_k": "x"})

"""A request's unset sampling fields take the model's generation_config.json (vLLM's
``--generation-config auto``), with ``--override-generation-config`` over it; a request's own
values win. The model here recommends top_k 1 (greedy) at temperature 0.7 and 9 new tokens;
the override makes it 4."""

from __future__ import annotations

import json
import shutil

import pytest
from tests.server.conftest import start_server

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def server(llama_checkpoint, server_logs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("genconfig") / "model"
    shutil.copytree(llama_checkpoint, folder)
    path = folder / "generation_config.json"
    recommended = {"top_k": 1, "temperature": 0.7, "max_new_tokens": 9}
    path.write_text(json.dumps({**json.loads(path.read_text()), **recommended}))
    yield from start_server(folder, server_logs, "--served-model-name", "tiny",
                            "--override-generation-config", '{"max_new_tokens": 4}')  # fmt: skip


def test_unset_fields_take_the_models_recommended_values(server):
    assert "default sampling parameters from the model's generation config: temperature=0.7, " \
        "top_k=1, max_tokens=4" in server.log()  # fmt: skip
    with server.client() as c:

        def chat(**fields):
            body = {"model": "tiny", "messages": MESSAGES, "ignore_eos": True, **fields}
            return c.post("/v1/chat/completions", json=body).json()

        def complete(**fields):
            body = {"model": "tiny", "prompt": "The sea", "ignore_eos": True, **fields}
            return c.post("/v1/completions", json=body).json()

        # top_k 1 from the model: sampled at its temperature, the greedy reply; 4 tokens
        unset = chat()
        assert unset["usage"]["completion_tokens"] == 4
        greedy = chat(temperature=0, max_tokens=4)
        assert unset["choices"][0]["message"] == greedy["choices"][0]["message"]
        # the request's own values win
        assert chat(max_tokens=6)["usage"]["completion_tokens"] == 6
        assert chat(max_completion_tokens=2)["usage"]["completion_tokens"] == 2
        assert chat(max_tokens=None)["usage"]["completion_tokens"] == 4  # null is unset
        assert complete()["usage"]["completion_tokens"] == 4  # (not OpenAI's 16)
        two = complete(prompt=["The sea", "A much longer prompt about the sea and its depths"])
        assert two["usage"]["completion_tokens"] == 8  # each prompt its own 4
        assert complete(max_tokens=7)["usage"]["completion_tokens"] == 7
        greedy = complete(temperature=0, max_tokens=4)["choices"][0]["text"]
        assert complete(seed=5)["choices"][0]["text"] == greedy
        texts = {complete(top_k=0, temperature=1.0, seed=s)["choices"][0]["text"]
                 for s in range(4)}  # fmt: skip
        assert len(texts) > 1  # top_k 0 given: sampled, not greedy

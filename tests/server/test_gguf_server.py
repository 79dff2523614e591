"""`infer serve FILE.gguf`: a llama.cpp user's file served over the OpenAI API as it is, its
chat template and stop token from the file's metadata."""

from __future__ import annotations

import openai
import pytest
from tests.server.conftest import start_server

from infer import LLM, SamplingParams
from infer.testing.gguf_files import write_gguf

pytest.importorskip("gguf")

MESSAGES = [{"role": "user", "content": "Write a for loop in Python"}]


@pytest.fixture(scope="module")
def gguf_file(llama_checkpoint, tmp_path_factory):
    return write_gguf(llama_checkpoint, tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf", "Q8_0")


@pytest.fixture(scope="module")
def gguf_server(gguf_file, server_logs, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    yield from start_server(gguf_file, server_logs, "--dtype", "float32",
                            env={"INFER_CACHE_DIR": str(cache)})  # fmt: skip


def test_a_gguf_file_serves_chat_as_the_engine_reads_it(gguf_server, gguf_file, tmp_path,
                                                         monkeypatch):  # fmt: skip
    """The chat completion (template, tokens, stop) is what the offline engine gives for the same
    file: the server takes the file path as its model, like llama-server's -m."""
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    client = openai.OpenAI(base_url=gguf_server.base_url, api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                         temperature=0)  # fmt: skip
    with LLM(str(gguf_file), dtype="float32") as llm:
        want = llm.chat([MESSAGES], SamplingParams(max_tokens=12, temperature=0))[0]
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)

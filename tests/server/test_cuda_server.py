"""A server whose engine process runs on a CUDA GPU: it streams the offline engine's tokens,
answers chat and structured-output requests, returns every KV block, reports the GPU's cache in
its metrics, and drains on SIGTERM with exit code 0. Skips without CUDA."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI
from tests.server.conftest import ServerProcess
from tests.server.test_structured_outputs import SCHEMA

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = ["The quick brown fox", "def main():", "In Python, a list is a mutable sequence"]


def test_cuda_server_streams_the_offline_tokens(llama_checkpoint, server_logs):
    from infer import LLM, SamplingParams

    with LLM(str(llama_checkpoint), device="cuda", kv_cache_memory="512MiB") as llm:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        want = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]

    server = ServerProcess(llama_checkpoint, "--device", "cuda", "--kv-cache-memory", "512MiB",
                           log_dir=server_logs)  # fmt: skip
    try:
        client = OpenAI(base_url=server.base_url, api_key="unused")
        for prompt, text in zip(PROMPTS, want, strict=True):
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})  # fmt: skip
            assert "".join(c.choices[0].text for c in stream if c.choices) == text
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert chat.usage.completion_tokens == 8
        structured = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "A person, as JSON"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
            temperature=1.0, seed=3, max_tokens=120,
        )  # fmt: skip
        assert structured.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(structured.choices[0].message.content), SCHEMA)
        stats = server.wait_idle()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        metrics = httpx.get(f"{server.url}/metrics").text
        total = float(stats["num_total_blocks"])
        assert f'infer:kv_cache_total_blocks{{model_name="tiny"}} {total}' in metrics
        assert " on cuda" in server.log()
    finally:
        assert server.terminate() == 0, server.log()

"""A server with int8 (or w8a8) weights and an int8 KV cache answers like any other, returns every block,
and bad quantization options stop it at start-up with a message that names them."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from tests.server.conftest import assert_start_fails, start_server

from infer.runner.quant import w8a8_available


@pytest.fixture(scope="module", params=["int8", "w8a8"])
def quantized_server(request, llama_checkpoint, server_logs):
    if request.param == "w8a8" and not w8a8_available(torch.device("cpu")):
        pytest.skip("w8a8 needs a CPU with AVX-512 VNNI")
    yield from start_server(llama_checkpoint, server_logs, "--dtype", "bfloat16",
                            "--quantization", request.param, "--kv-cache-dtype", "int8")  # fmt: skip


def test_quantized_server_streams_and_frees_every_block(quantized_server):
    client = OpenAI(base_url=quantized_server.base_url, api_key="unused")
    stream = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    whole = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert whole.usage.completion_tokens == 12 and whole.choices[0].text == text
    stats = quantized_server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    log = quantized_server.log()
    assert "quantized" in log and "KV cache (int8)" in log


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--kv-cache-dtype", "int4"], "--kv-cache-dtype 'int4' is not supported (choices: auto, int8, fp8)"),
        (["--quantization", "int3"], "--quantization 'int3' is not supported (choices: int8, w8a8, fp8, int4, w4a8, gptq, awq, gguf)"),
        (["--quantization", "fp8"], "--quantization fp8 needs a CUDA GPU with fp8 matmuls"),
    ],
)  # fmt: skip
def test_bad_quantization_options_stop_the_server_with_a_clear_message(
    flags, message, llama_checkpoint
):
    assert_start_fails(llama_checkpoint, flags, message)

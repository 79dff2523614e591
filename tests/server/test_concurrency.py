"""64 simultaneous streams against one engine: all complete, each with its own correct text."""

from __future__ import annotations

import asyncio

import openai
import pytest

from infer import SamplingParams

NUM_STREAMS = 64
MAX_TOKENS = 16
PROMPTS = [
    f"Request {i}: the {'quick ' * (i % 5)}brown fox number {i * 7}" for i in range(NUM_STREAMS)
]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def test_64_simultaneous_streams_get_correct_independent_outputs(server, offline_llm):
    async def run() -> list[tuple[str, str | None, int]]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0,
                                    timeout=300)  # fmt: skip

        async def one(prompt: str) -> tuple[str, str | None, int]:
            stream = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            text, finish, usage = "", None, 0
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.text
                    finish = choice.finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            return text, finish, usage

        try:
            return await asyncio.gather(*[one(p) for p in PROMPTS])
        finally:
            await client.close()

    results = asyncio.run(run())
    want = offline_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for (text, finish, usage), expected in zip(results, want, strict=True):
        out = expected.outputs[0]
        assert text == out.text
        assert finish == out.finish_reason
        assert usage == len(out.token_ids)
    assert len({text for text, _, _ in results}) > NUM_STREAMS // 2  # independent, not one echo
    stats = server.wait_idle()
    assert stats["step_failures"] == 0

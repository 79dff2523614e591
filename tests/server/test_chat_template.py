"""``--chat-template``: a template file replaces the model's (in process, over ASGI)."""

from __future__ import annotations

import asyncio

import httpx

from infer.server.app import build_app
from infer.server.serving import ServerSettings

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
TEMPLATE += "{% if add_generation_prompt %}[assistant]{% endif %}"
MESSAGES = [{"role": "user", "content": "hello there"}]


def call(engine, settings: ServerSettings, path: str, body: dict) -> httpx.Response:
    app = build_app(engine, settings)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await client.post(path, json=body)

    return asyncio.run(main())


def test_a_template_file_replaces_the_models(tiny_engine):
    settings = ServerSettings(served_model_names=("tiny",), chat_template=TEMPLATE)
    got = call(tiny_engine, settings, "/tokenize", {"messages": MESSAGES})
    want = tiny_engine.tokenizer.encode("[user] hello there\n[assistant]", add_special_tokens=False)
    assert got.json()["tokens"] == want
    default = call(tiny_engine, ServerSettings(served_model_names=("tiny",)), "/tokenize",
                   {"messages": MESSAGES})  # fmt: skip
    assert default.json()["tokens"] != want


def test_chat_completion_uses_the_template(tiny_engine):
    settings = ServerSettings(served_model_names=("tiny",), chat_template=TEMPLATE)
    got = call(tiny_engine, settings, "/v1/chat/completions",
               {"messages": MESSAGES, "max_tokens": 3, "temperature": 0})  # fmt: skip
    prompt = tiny_engine.tokenizer.encode(
        "[user] hello there\n[assistant]", add_special_tokens=False
    )
    assert got.status_code == 200 and got.json()["usage"]["prompt_tokens"] == len(prompt)


def test_a_template_that_raises_is_a_400(tiny_engine):
    settings = ServerSettings(served_model_names=("tiny",),
                              chat_template="{{ raise_exception('roles must alternate') }}")  # fmt: skip
    got = call(tiny_engine, settings, "/v1/chat/completions", {"messages": MESSAGES})
    assert got.status_code == 400 and "roles must alternate" in got.json()["error"]["message"]


def test_the_reasoning_switches_reach_the_template(tiny_engine):
    """Chat's ``reasoning_effort``, the Responses API's ``reasoning.effort`` and Anthropic's
    ``thinking`` type reach the template as ``reasoning_effort`` / ``enable_thinking`` (the
    prompt's token count tells which text it wrote)."""
    template = ("{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}"
                "{% if reasoning_effort is defined %}[effort {{ reasoning_effort }}]{% endif %}"
                + TEMPLATE)  # fmt: skip
    settings = ServerSettings(served_model_names=("tiny",), chat_template=template)

    def tokens(text: str) -> int:
        return len(tiny_engine.tokenizer.encode(text + "[user] hello there\n[assistant]",
                                                add_special_tokens=False))  # fmt: skip

    cases = [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                  "reasoning_effort": "high"}, "[effort high]"),
        ("/v1/responses", {"input": "hello there", "max_output_tokens": 1,
                           "reasoning": {"effort": "none"}}, "[no-think]"),
        ("/v1/messages", {"messages": MESSAGES, "max_tokens": 1,
                          "thinking": {"type": "disabled"}}, "[no-think]"),
    ]  # fmt: skip
    for path, body, text in cases:
        got = call(tiny_engine, settings, path, body).json()
        usage = got["usage"]
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        if path == "/v1/messages":
            prompt += usage["cache_read_input_tokens"]
        assert prompt == tokens(text), (path, got)

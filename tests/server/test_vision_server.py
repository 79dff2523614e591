"""``infer serve`` on a LLaVA: ``POST /v1/chat/completions`` with ``image_url`` parts (a data URL,
an http address) through the ``openai`` SDK answers transformers' greedy reply, streamed or
not, requests with different images in flight together; a bad image or an image for a
text-only model is a 400 naming the part; every KV block comes back."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import pytest
import torch
from tests.server.conftest import concurrently, start_server

from infer.testing.checkpoints import default_root
from infer.testing.vision import build_llava, random_image

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llava():
    return build_llava(default_root())


@pytest.fixture(scope="module")
def server(llava, server_logs):
    yield from start_server(llava, server_logs, "--max-num-seqs", "4")


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def ask(url: str, text: str = "What is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]  # fmt: skip


@pytest.fixture(scope="module")
def expected(llava):
    """transformers' greedy reply (text) to :func:`ask` about an image."""
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(llava)
    processor = AutoImageProcessor.from_pretrained(llava)
    model = LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    per_image = model.config.image_seq_length

    def reply(image, text: str = "What is this?") -> str:
        prompt = f"USER: <image>\n{text}\nASSISTANT:"
        ids = tok.encode(prompt.replace("<image>", "<image>" * per_image),
                         add_special_tokens=False)  # fmt: skip
        pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None)  # fmt: skip
        # (a reply ending inside a character: the server holds its incomplete bytes back)
        return tok.decode(out[0, len(ids) :], skip_special_tokens=True).rstrip("\ufffd")

    return reply


def test_openai_sdk_chat_with_images_gets_transformers_reply(server, expected):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    images = [random_image(20 + i) for i in range(3)]

    def chat(image) -> str:
        resp = client.chat.completions.create(model="tiny", messages=ask(data_url(image)),
                                              max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})  # fmt: skip
        assert resp.usage.prompt_tokens > 16  # (an image is 16 tokens)
        return resp.choices[0].message.content

    # several requests with different images in the same steps: each gets its own reply
    replies = concurrently(chat, images)
    assert replies == [expected(im) for im in images]
    assert len(set(replies)) == 3
    # streamed: the same text
    stream = client.chat.completions.create(model="tiny", messages=ask(data_url(images[0])),
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == replies[0]
    server.wait_idle()


def test_an_image_from_a_web_address(server, expected, tmp_path):
    image = random_image(30)
    (tmp_path / "cat.png").write_bytes(png_bytes(image))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{web.server_address[1]}"
        with server.client() as c:
            r = c.post("/v1/chat/completions", json={
                "messages": ask(f"{base}/cat.png"), "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True})  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == expected(image)
            missing = c.post("/v1/chat/completions", json={"messages": ask(f"{base}/none.png")})
    finally:
        web.shutdown()
    assert missing.status_code == 400
    assert "answered HTTP 404" in missing.json()["error"]["message"]
    assert missing.json()["error"]["param"] == "messages[0].content[0].image_url"


def test_bad_images_are_400_naming_the_part(server, tmp_path):
    cat = tmp_path / "cat.png"  # (a file of the server's machine: a client never reads it)
    cat.write_bytes(png_bytes(random_image(3)))
    with server.client() as c:
        for url, message in [
            ("data:image/png;base64,@@@@", "not valid base64"),
            ("data:image/png;base64," + base64.b64encode(b"not an image").decode(),
             "not an image file"),
            ("ftp://example.com/x.png", "is not a data:, http(s):// URL"),
            (str(cat), "is not a data:, http(s):// URL"),
        ]:  # fmt: skip
            r = c.post("/v1/chat/completions", json={"messages": ask(url), "max_tokens": 2})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert message in error["message"] and "or a file" not in error["message"]
            assert error["param"] == "messages[0].content[0].image_url"
        cut = c.post(
            "/v1/chat/completions",
            json={"messages": ask(data_url(random_image(1))), "truncate_prompt_tokens": 8},
        )
        assert cut.status_code == 400 and cut.json()["error"]["param"] == "truncate_prompt_tokens"
        many = c.post(
            "/v1/chat/completions",
            json={
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": data_url(random_image(1))}}
                        ]
                        * 17,
                    }
                ]
            },
        )
        assert many.status_code == 400 and "at most 16" in many.json()["error"]["message"]
        embed = c.post("/v1/embeddings", json={"messages": ask(data_url(random_image(1)))})
        assert embed.status_code == 400 and "images are not served" in embed.text
        counted = c.post("/tokenize", json={"messages": ask(data_url(random_image(1)))})
        usage = c.post(
            "/v1/chat/completions",
            json={"messages": ask(data_url(random_image(1))), "max_tokens": 1},
        ).json()["usage"]
        assert counted.json()["count"] == usage["prompt_tokens"] > 16
        beam = c.post("/v1/chat/completions", json={
            "messages": ask(data_url(random_image(1))), "max_tokens": 2, "n": 2,
            "use_beam_search": True})  # fmt: skip
        assert beam.status_code == 400 and beam.json()["error"]["param"] == "use_beam_search"
        # the server goes on serving
        ok = c.post("/v1/chat/completions", json={"messages": ask(data_url(random_image(1))),
                                                  "max_tokens": 2})  # fmt: skip
        assert ok.status_code == 200
    server.wait_idle()


def test_a_text_model_refuses_images(shared_server):
    with shared_server.client() as c:  # (its API key in the client's headers)
        r = c.post("/v1/chat/completions",
                   json={"messages": ask(data_url(random_image(2))), "max_tokens": 2})  # fmt: skip
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"] == "an image_url part: this model reads no images"
    assert error["param"] == "messages[0].content[0]"


def test_responses_and_messages_apis_take_images(server, expected):
    """OpenAI's Responses API (``input_image``) and Anthropic's Messages API (an ``image``
    block, base64) reach the same chat prompt: transformers' reply."""
    import anthropic
    from openai import OpenAI

    image = random_image(40)
    openai_client = OpenAI(base_url=server.base_url, api_key="none")
    response = openai_client.responses.create(
        model="tiny", max_output_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(image)},
                                            {"type": "input_text", "text": "What is this?"}]}],
    )  # fmt: skip
    assert response.output_text == expected(image)
    claude = anthropic.Anthropic(base_url=server.url, api_key="none")
    source = {"type": "base64", "media_type": "image/png",
              "data": base64.b64encode(png_bytes(image)).decode()}  # fmt: skip
    message = claude.messages.create(
        model="tiny", max_tokens=MAX_TOKENS, extra_body={"temperature": 0, "ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image", "source": source},
                                               {"type": "text", "text": "What is this?"}]}],
    )  # fmt: skip
    assert message.content[0].text == expected(image)
    server.wait_idle()


def test_llava_next_over_http_is_the_offline_reply(server_logs):
    """LLaVA-NeXT's runs follow each image's size, which crosses to the engine with its
    pixels: a wide and a tall image over HTTP answer what ``LLM.chat`` (transformers' tokens,
    tests/integration/test_vision.py) answers."""
    from infer import LLM, SamplingParams

    folder = build_llava(default_root(), next_=True)
    images = [random_image(70, (200, 60)), random_image(71, (40, 160))]
    llm = LLM(str(folder), dtype="float32")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    offline = [llm.chat(ask(data_url(im)), params).outputs[0].text for im in images]
    llm.shutdown()
    for server in start_server(folder, server_logs, "--dtype", "float32"):
        with server.client() as c:
            for image, want in zip(images, offline, strict=True):
                r = c.post("/v1/chat/completions", json={
                    "messages": ask(data_url(image)), "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True})  # fmt: skip
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == want
        server.wait_idle()

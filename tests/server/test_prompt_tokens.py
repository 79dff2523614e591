"""The token ids a request's prompt becomes, as vLLM makes them, on a model whose tokenizer adds
a BOS (as Llama's do): completions get it (``add_special_tokens``, default true), chat does not
get a second one, ``/tokenize`` counts what generation feeds, ``truncate_prompt_tokens`` keeps
the last tokens, and chat's ``echo`` puts the continued message before the reply."""

from __future__ import annotations

import shutil

import httpx
import pytest
from tests.server.conftest import start_server
from transformers import AutoTokenizer

PROMPT = "The quick brown fox"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (loop.last and m['role'] == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def bos_model(llama_checkpoint, tmp_path_factory):
    from tokenizers.processors import TemplateProcessing

    folder = tmp_path_factory.mktemp("bos-model") / "model"
    shutil.copytree(llama_checkpoint, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    bos = (tok.bos_token, tok.bos_token_id)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos[0]} $A", pair=f"{bos[0]} $A $B", special_tokens=[bos]
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def http(bos_model, server_logs):
    for server in start_server(bos_model, server_logs):
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client


def _prompt_ids(http: httpx.Client, path: str, body: dict) -> list[int]:
    """The ids the engine was fed: its prompt logprobs' tokens (the first has none)."""
    r = http.post(path, json={"model": "tiny", "max_tokens": 1, "prompt_logprobs": 0, **body})
    assert r.status_code == 200, r.text
    out = r.json()
    lps = out["prompt_logprobs"] if "prompt_logprobs" in out else out["choices"][0][
        "prompt_logprobs"]  # fmt: skip
    assert out["usage"]["prompt_tokens"] == len(lps)
    return [None if lp is None else int(next(iter(lp))) for lp in lps]


def test_completions_get_the_tokenizers_bos_and_tokenize_agrees(http, bos_model):
    tok = AutoTokenizer.from_pretrained(bos_model)
    plain = tok.encode(PROMPT, add_special_tokens=False)
    fed = _prompt_ids(http, "/v1/completions", {"prompt": PROMPT})
    assert len(fed) == len(plain) + 1 and fed[1:] == plain  # (the first id is the BOS)
    counted = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert counted["tokens"] == [tok.bos_token_id, *plain]
    without = _prompt_ids(http, "/v1/completions", {"prompt": PROMPT, "add_special_tokens": False})
    assert len(without) == len(plain)
    last3 = _prompt_ids(http, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 3})
    assert last3[1:] == plain[-2:] and len(last3) == 3


def test_chat_has_one_bos_and_tokenize_counts_what_chat_feeds(http, bos_model):
    tok = AutoTokenizer.from_pretrained(bos_model)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    cont = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    fed = _prompt_ids(http, "/v1/chat/completions", cont)
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    want = tok.encode(text, add_special_tokens=False)
    assert want[0] == tok.bos_token_id and want[1] != tok.bos_token_id
    assert fed[1:] == want[1:] and len(fed) == len(want)
    counted = http.post("/tokenize", json=cont).json()
    assert counted["tokens"] == want
    doubled = _prompt_ids(http, "/v1/chat/completions", {**cont, "add_special_tokens": True})
    assert len(doubled) == len(want) + 1  # asked for: the tokenizer's BOS too


def test_chat_echo_puts_the_continued_message_first(http):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    body = {"model": "tiny", "messages": messages, "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 4, "temperature": 0}  # fmt: skip
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "Hello the" + plain["content"]
    with http.stream("POST", "/v1/chat/completions",
                     json={**body, "echo": True, "stream": True}) as r:  # fmt: skip
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(httpx.Response(200, content=e).json()["choices"][0]["delta"].get("content")
                   or "" for e in events)  # fmt: skip
    assert text == "Hello the" + plain["content"]


def test_a_template_in_the_request_is_refused_by_name(http):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                  "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"

"""The completions fields that used to be refused: echo with logprobs, vLLM's prompt_logprobs
(checked against transformers), best_of, and suffix (fill-in-the-middle, or a clear 400)."""

from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI

from infer.server.fim import fim_prompt, fim_tokens

PROMPT = "The import statement combines two operations"


@pytest.fixture(scope="module")
def client(shared_server) -> OpenAI:
    return OpenAI(base_url=shared_server.base_url, api_key=shared_server.api_key)


@pytest.fixture(scope="module")
def hf_prompt_logprobs(llama_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)
    ids = tok.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_with_logprobs_scores_the_prompt_too(client, hf_prompt_logprobs):
    ids, ref = hf_prompt_logprobs
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                    echo=True, logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    choice = out.choices[0]
    lps = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lps.tokens) == len(ids) + 3
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.token_logprobs[1 : len(ids)] == pytest.approx(ref, abs=1e-4)
    assert "".join(lps.tokens) == choice.text
    assert lps.text_offset == sorted(lps.text_offset)


def test_prompt_logprobs_in_vllm_shape(client, hf_prompt_logprobs, shared_server):
    ids, ref = hf_prompt_logprobs
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3}
    r = httpx.post(f"{shared_server.base_url}/completions", headers=shared_server.headers,
                   json=body).json()  # fmt: skip
    block = r["choices"][0]["prompt_logprobs"]
    assert block[0] is None and len(block) == len(ids)
    for i, entry in enumerate(block[1:], start=1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(ref[i - 1], abs=1e-4)
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        assert 3 <= len(entry) <= 4  # the token itself and its top 3
    streamed = []
    with httpx.stream("POST", f"{shared_server.base_url}/completions",
                      headers=shared_server.headers, json={**body, "stream": True}) as s:  # fmt: skip
        for line in s.iter_lines():
            if line.startswith("data: {"):
                import json

                choice = json.loads(line[6:])["choices"]
                if choice and choice[0].get("prompt_logprobs"):
                    streamed.append(choice[0]["prompt_logprobs"])
    assert streamed == [block]
    chat = httpx.post(f"{shared_server.base_url}/chat/completions", headers=shared_server.headers,
                      json={"model": "tiny", "max_tokens": 1, "prompt_logprobs": 0,
                            "messages": [{"role": "user", "content": "hi"}]}).json()  # fmt: skip
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3


def test_best_of_returns_the_most_likely_candidates(client, shared_server):
    body = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11,
                extra_body={"ignore_eos": True})  # fmt: skip
    candidates = client.completions.create(**body, n=5, logprobs=0)
    ranked = sorted(candidates.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(**body, n=2, best_of=5)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 5 * 6  # every candidate is generated
    for extra, message in [({"n": 3, "best_of": 2}, "must be at least n"),
                           ({"best_of": 3, "stream": True}, "cannot stream")]:  # fmt: skip
        r = httpx.post(f"{shared_server.base_url}/completions", headers=shared_server.headers,
                       json={"model": "tiny", "prompt": PROMPT, **extra})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
        assert message in r.json()["error"]["message"]


def test_suffix_needs_a_fill_in_the_middle_model(shared_server):
    r = httpx.post(f"{shared_server.base_url}/completions", headers=shared_server.headers,
                   json={"model": "tiny", "prompt": "def f(", "suffix": "    return x\n"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "fill-in-the-middle" in r.json()["error"]["message"]


def test_fim_prompts_follow_the_tokenizer_s_fim_tokens(llama_checkpoint, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_checkpoint)
    assert fim_tokens(tok) is None
    tok.add_special_tokens({"additional_special_tokens": ["<|fim_prefix|>", "<|fim_suffix|>",
                                                          "<|fim_middle|>"]})  # fmt: skip
    ids = fim_tokens(tok)
    assert ids is not None
    prompt = fim_prompt(ids, tok.encode("def f(", add_special_tokens=False),
                        tok.encode("return x", add_special_tokens=False))  # fmt: skip
    assert tok.decode(prompt) == "<|fim_prefix|>def f(<|fim_suffix|>return x<|fim_middle|>"


def test_beam_search_returns_the_offline_beams(client, shared_server, offline_llm):
    """vLLM's use_beam_search (it was refused): the n likeliest continuations, best first, the
    offline ``LLM.beam_search``'s; chat too; what needs sampled tokens is refused by name."""
    from infer import BeamSearchParams

    ids = offline_llm.tokenizer.encode(PROMPT)
    want = offline_llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=5,
                                                           ignore_eos=True))[0]  # fmt: skip
    got = client.completions.create(model="tiny", prompt=ids, n=3, max_tokens=5,
                                    extra_body={"use_beam_search": True, "ignore_eos": True})  # fmt: skip
    assert [c.text for c in got.choices] == [s.text for s in want.sequences]
    assert [c.finish_reason for c in got.choices] == ["length"] * 3
    assert got.usage.completion_tokens == 15 and got.usage.prompt_tokens == len(ids)
    messages = [{"role": "user", "content": "Name a prime number."}]
    chat_ids = httpx.post(shared_server.url + "/tokenize", headers=shared_server.headers,
                          json={"model": "tiny", "messages": messages}).json()["tokens"]  # fmt: skip
    want = offline_llm.beam_search([chat_ids], BeamSearchParams(beam_width=2, max_tokens=4,
                                                                ignore_eos=True))[0]  # fmt: skip
    chat = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=4,
                                          extra_body={"use_beam_search": True,
                                                      "ignore_eos": True})  # fmt: skip
    assert [c.message.content for c in chat.choices] == [s.text for s in want.sequences]
    for field, value in (("stream", True), ("logprobs", 2), ("stop", ["x"])):
        r = httpx.post(shared_server.url + "/v1/completions", headers=shared_server.headers,
                       json={"model": "tiny", "prompt": PROMPT, "n": 2, "use_beam_search": True,
                             field: value})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text

"""A server with LoRA adapters, driven as vLLM users drive one: adapters from --lora-modules and
/v1/load_lora_adapter, picked by the request's model field, listed by /v1/models with their
parent; bad adapters and unknown names answered with the name and the reason while everyone
else is served; every KV block back; vLLM's lora_requests_info metric."""

from __future__ import annotations

import shutil

import httpx
import pytest
from openai import NotFoundError, OpenAI
from tests.server.conftest import assert_start_fails, concurrently, start_server

from infer.testing.lora import build_lora_adapter

pytest.importorskip("peft")

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapters(llama_checkpoint, tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    made = {f"a{i}": build_lora_adapter(llama_checkpoint, root / f"a{i}", rank=4 + 2 * i, seed=i)
            for i in range(1, 4)}  # fmt: skip
    made["rank32"] = build_lora_adapter(llama_checkpoint, root / "rank32", rank=32, seed=9)
    made["qwen3"] = build_lora_adapter(tiny_checkpoints["qwen3"], root / "qwen3", rank=4, seed=8)
    made["corrupt"] = shutil.copytree(made["a1"], root / "corrupt")
    (made["corrupt"] / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    return made


@pytest.fixture(scope="module")
def lora_server(llama_checkpoint, server_logs, adapters):
    yield from start_server(
        llama_checkpoint, server_logs, "--enable-lora", "--max-loras", "2", "--max-cpu-loras",
        "2", "--lora-modules", f"a1={adapters['a1']}",
        f'{{"name": "a2", "path": "{adapters["a2"]}", "base_model_name": "tiny-base"}}',
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )  # fmt: skip


def _complete(client: OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.usage.completion_tokens == 12
    return out.choices[0].text


def test_adapters_are_listed_with_their_parent(lora_server, adapters):
    models = {m.id: m for m in OpenAI(base_url=lora_server.base_url, api_key="x").models.list()}
    assert {"tiny", "a1", "a2"} <= set(models)
    assert models["a1"].parent == "tiny" and models["a1"].root == str(adapters["a1"])
    assert models["a2"].parent == "tiny-base"  # the JSON form's base_model_name
    assert getattr(models["tiny"], "parent", None) is None


def test_requests_pick_adapters_by_model_and_match_the_offline_api(lora_server, adapters,
                                                                   llama_checkpoint):  # fmt: skip
    from infer import LLM, LoRARequest, SamplingParams

    client = OpenAI(base_url=lora_server.base_url, api_key="x")
    names = ["tiny", "a1", "a2", "a1", "tiny", "a2"]
    # adapters and the base model in the same steps
    texts = concurrently(lambda m: _complete(client, m), names)
    assert texts[0] == texts[4] and texts[1] == texts[3] and texts[2] == texts[5]
    assert len({texts[0], texts[1], texts[2]}) == 3  # each adapter changes the output
    llm = LLM(str(llama_checkpoint), enable_lora=True, max_loras=2)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for name, text in zip(names[:3], texts[:3], strict=True):
        lora = None if name == "tiny" else LoRARequest(name, 0, str(adapters[name]))
        assert llm.generate([PROMPT], params, lora_request=lora)[0].outputs[0].text == text
    chat = client.chat.completions.create(model="a2", max_tokens=5, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert chat.model == "a2" and chat.usage.completion_tokens >= 1
    lora_server.wait_idle()


def test_unknown_adapter_is_a_404_naming_it(lora_server):
    client = OpenAI(base_url=lora_server.base_url, api_key="x")
    with pytest.raises(NotFoundError, match="'a9' does not exist"):
        _complete(client, "a9")
    assert _complete(client, "a1")  # still serving


def test_runtime_load_and_unload(lora_server, adapters):
    client = OpenAI(base_url=lora_server.base_url, api_key="x")
    http = lora_server.client()

    def load(name: str, path) -> httpx.Response:
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

    r = load("a3", adapters["a3"])
    assert r.status_code == 200 and "a3" in r.text
    # three adapters, two slots: all complete
    texts = concurrently(lambda m: _complete(client, m), ["a3", "a1", "a2"])
    assert texts[0] != texts[1]
    assert {m.id for m in client.models.list()} >= {"a1", "a2", "a3"}
    bad = {
        "again": (load("a3", adapters["a3"]), 400, "already been loaded"),
        "missing": (load("gone", "/no/such/folder"), 400, "/no/such/folder is not a folder"),
        "rank": (load("big", adapters["rank32"]), 400, "rank 32"),
        "shape": (load("q3", adapters["qwen3"]), 400, "another base model"),
        "served name": (load("tiny", adapters["a3"]), 400, "'tiny' is the served model's name"),
        "corrupt": (
            load("c", adapters["corrupt"]),
            400,
            f"LoRA adapter 'c': {adapters['corrupt']}/adapter_model.safetensors cannot be read",
        ),
    }
    for why, (resp, status, message) in bad.items():
        assert resp.status_code == status, why
        assert message in resp.json()["error"]["message"], why
    assert "big" not in {m.id for m in client.models.list()}
    # load_inplace: the name gets the other adapter's weights (a bad one leaves the old)
    before = _complete(client, "a3")
    r = http.post("/v1/load_lora_adapter",
                  json={"lora_name": "a3", "lora_path": "/no/such", "load_inplace": True})  # fmt: skip
    assert r.status_code == 400 and _complete(client, "a3") == before
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "load_inplace": True,
                                                 "lora_path": str(adapters["a1"])})  # fmt: skip
    assert r.status_code == 200 and _complete(client, "a3") == _complete(client, "a1") != before
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 200
    with pytest.raises(NotFoundError):
        _complete(client, "a3")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    assert _complete(client, "a2")
    stats = lora_server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_metrics_report_lora_requests_info(lora_server):
    text = httpx.get(lora_server.url + "/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line


def test_runtime_routes_need_the_switch(llama_checkpoint, server_logs, adapters):
    gen = start_server(llama_checkpoint, server_logs, "--enable-lora", "--lora-modules",
                       f"a1={adapters['a1']}")  # fmt: skip
    server = next(gen)
    try:
        r = httpx.post(server.url + "/v1/load_lora_adapter",
                       json={"lora_name": "a3", "lora_path": str(adapters["a3"])})  # fmt: skip
        assert r.status_code == 404
    finally:
        gen.close()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--enable-lora", "--lora-modules", "x=/no/such"], "LoRA adapter 'x': /no/such is not a folder"),
        (["--lora-modules", "x=/no/such"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "oops"], "'oops' is not name=path"),
        (["--enable-lora", "--served-model-name", "tiny", "base", "--lora-modules", "base=/no/such"],
         "'base' is a served model name"),
    ],
)  # fmt: skip
def test_bad_lora_options_stop_the_server_with_a_clear_message(flags, message, llama_checkpoint):
    assert_start_fails(llama_checkpoint, flags, message)

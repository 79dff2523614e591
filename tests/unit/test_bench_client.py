"""The streaming client, the serving run and the openai-SDK client tests against a fake server.

The fake is a tiny OpenAI-compatible SSE server (FastAPI + uvicorn on 127.0.0.1, a free port, in
a thread). It streams one chunk per "token" and counts prompt tokens as whitespace-separated
words, so every count the client reports can be checked exactly. Prompts containing FAIL500 get
an HTTP 500; ERROREVENT gets an error event mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from infer.bench.client import (  # noqa: E402
    RequestRecord,
    api_base,
    build_payload,
    new_client,
    run_workload,
    stream_request,
)
from infer.bench.workloads import (  # noqa: E402
    LengthBand,
    TextSource,
    WorkloadSpec,
    build_requests,
)


class FakeServer:
    """Behaviour switches and the request bodies it received."""

    def __init__(self) -> None:
        self.send_done = True
        self.send_usage = True
        self.token_delay_s = 0.001
        self.tokenize_routes = False  # /tokenize and /detokenize, one token per word
        self.vocab: dict[str, int] = {}
        self.bodies: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.hold_until = 0  # streams wait (up to 5 s) until this many are in flight
        self.fail_all = False  # every generation request a 500
        self.app = self._make_app()
        self.url = ""

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "max_model_len": 4096}]}

        async def handle(request: Request, chat: bool):
            body = await request.json()
            self.bodies.append(body)
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]
            if "FAIL500" in prompt or self.fail_all:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            n = int(body.get("max_tokens") or 16)
            kind = "chat.completion.chunk" if chat else "text_completion"

            def event(text: str | None, finish: str | None = None) -> str:
                if chat:
                    delta = (
                        {"role": "assistant", "content": ""} if text is None else {"content": text}
                    )
                    choice = {"index": 0, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": text or "", "finish_reason": finish}
                return "data: " + json.dumps({"object": kind, "choices": [choice]}) + "\n\n"

            async def gen():
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                for _ in range(1000):
                    if self.in_flight >= self.hold_until:
                        break
                    await asyncio.sleep(0.005)
                try:
                    async for part in tokens():
                        yield part
                finally:
                    self.in_flight -= 1

            async def tokens():
                if chat:
                    yield event(None)  # role-only chunk: not a token
                for i in range(n):
                    await asyncio.sleep(self.token_delay_s)
                    if "ERROREVENT" in prompt and i == 1:
                        yield "data: " + json.dumps({"error": {"message": "engine died"}}) + "\n\n"
                        return
                    if "CUTSHORT" in prompt and i == 2:
                        return  # the stream ends: no finish_reason, usage or [DONE]
                    text = "" if "EMPTYTEXT" in prompt else f" t{i}"
                    if "ABORT" in prompt and i == 1:  # a server timeout ends the request
                        yield event(text, "abort")
                        break
                    yield event(text, "length" if i == n - 1 else None)
                if self.send_usage:
                    usage = {
                        "prompt_tokens": len(prompt.split()),
                        "completion_tokens": n,
                        "total_tokens": len(prompt.split()) + n,
                    }
                    yield (
                        "data: "
                        + json.dumps({"object": kind, "choices": [], "usage": usage})
                        + "\n\n"
                    )
                if self.send_done:
                    yield "data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")

        @app.post("/tokenize")
        async def tokenize(request: Request):
            if not self.tokenize_routes:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            text = (await request.json())["prompt"]
            ids = [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]
            return {"tokens": ids, "count": len(ids), "max_model_len": 4096}

        @app.post("/detokenize")
        async def detokenize(request: Request):
            words = {i: w for w, i in self.vocab.items()}
            return {"prompt": " ".join(words[t] for t in (await request.json())["tokens"])}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await handle(request, chat=True)

        return app


@pytest.fixture(scope="module")
def fake():
    srv = FakeServer()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(srv.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started
    srv.url = f"http://127.0.0.1:{port}"
    yield srv
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture(autouse=True)
def reset(fake):
    fake.send_done = True
    fake.send_usage = True
    fake.tokenize_routes = False
    fake.fail_all = False
    fake.bodies.clear()


def _one(fake, prompt: str, max_tokens: int = 5, endpoint: str = "completions") -> RequestRecord:
    async def go():
        async with new_client(30) as client:
            payload = build_payload("fake-model", prompt, max_tokens, endpoint)  # type: ignore[arg-type]
            rec = RequestRecord(0, 0, max_tokens, 0.0)
            return await stream_request(client, api_base(fake.url), payload, rec, endpoint)  # type: ignore[arg-type]

    return asyncio.run(go())


def test_api_base_accepts_both_forms():
    assert api_base("http://h:1") == "http://h:1/v1"
    assert api_base("http://h:1/v1/") == "http://h:1/v1"


def test_completions_stream_records_every_token(fake):
    rec = _one(fake, "one two three four", max_tokens=6)
    assert rec.success and rec.error is None
    assert len(rec.chunk_times_s) == 6
    assert rec.chunk_times_s == sorted(rec.chunk_times_s)
    assert rec.ttft_s == rec.chunk_times_s[0]
    assert rec.e2e_s is not None and rec.e2e_s >= rec.chunk_times_s[-1]
    assert (rec.prompt_tokens, rec.output_tokens, rec.usage_reported) == (4, 6, True)
    assert rec.finish_reason == "length"
    assert len(rec.itls_s) == 5 and all(g >= 0 for g in rec.itls_s)
    assert rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / 5)
    body = fake.bodies[-1]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_chat_stream_skips_role_chunk(fake):
    rec = _one(fake, "hello there", max_tokens=3, endpoint="chat")
    assert rec.success
    assert len(rec.chunk_times_s) == 3 and rec.output_tokens == 3
    assert fake.bodies[-1]["messages"] == [{"role": "user", "content": "hello there"}]


def test_stream_without_done_or_usage_still_completes(fake):
    fake.send_done = False
    fake.send_usage = False
    rec = _one(fake, "a b c", max_tokens=4)
    assert rec.success
    assert rec.usage_reported is False
    assert rec.output_tokens == 4  # counted from chunks
    assert rec.prompt_tokens is None


def test_http_error_and_error_event_fail_the_request(fake):
    rec = _one(fake, "please FAIL500 now")
    assert not rec.success and rec.error.startswith("HTTP 500")
    rec = _one(fake, "ERROREVENT soon", max_tokens=5)
    assert not rec.success and "engine died" in rec.error


def test_requests_the_server_ended_or_cut_short_are_lost(fake):
    """A stream ending with finish_reason abort (the server's --request-timeout) or cut short
    before any finish_reason is a lost request, not a short completed one."""
    rec = _one(fake, "ABORT me", max_tokens=6)
    assert not rec.success and "finish_reason abort" in rec.error
    rec = _one(fake, "CUTSHORT me", max_tokens=6)
    assert not rec.success and rec.error == "stream ended before a finish_reason"
    pytest.importorskip("openai")
    import openai

    from infer.bench.client_suite import single_request

    sdk = openai.OpenAI(base_url=fake.url + "/v1", api_key="x")
    for prompt in ("ABORT me", "CUTSHORT me"):
        assert "finish_reason" in single_request(sdk, "fake-model", prompt, 6, "completions").error
    assert single_request(sdk, "fake-model", "fine", 6, "completions").error is None


def test_a_concurrent_batch_is_in_flight_at_once(fake):
    """All of a "concurrent" batch at once: asyncio's default thread pool (cores + 4 threads)
    ran a batch of 12 six at a time on two cores."""
    pytest.importorskip("openai")
    import random

    import openai

    from infer.bench.client_suite import concurrent_batch

    fake.hold_until, fake.most_in_flight = 40, 0
    sdk = openai.OpenAI(base_url=fake.url + "/v1", api_key="x")
    try:
        got = concurrent_batch(sdk, "fake-model", "hello", 40, 5, "completions", random.Random(0))
    finally:
        fake.hold_until = 0
    assert got.success_rate == 1.0 and fake.most_in_flight == 40


def test_tokens_without_visible_text_still_have_a_first_token_time(fake):
    rec = _one(fake, "EMPTYTEXT please", max_tokens=3)
    assert rec.success and rec.output_tokens == 3
    assert rec.ttft_s is not None and rec.chunk_times_s == [rec.ttft_s]
    fake.send_usage = False
    rec = _one(fake, "EMPTYTEXT again", max_tokens=3)
    assert not rec.success and rec.error == "stream ended without any output text"


def test_unreachable_server_is_an_error_not_a_crash():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there

    async def go():
        async with new_client(5) as client:
            payload = build_payload("m", "x", 2)
            return await stream_request(
                client, f"http://127.0.0.1:{port}/v1", payload, RequestRecord(0, 0, 2, 0.0)
            )

    rec = asyncio.run(go())
    assert not rec.success and rec.error


def test_serve_and_client_refuse_an_unreachable_server(capsys):
    from infer.bench.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "serve", "--server", f"http://127.0.0.1:{port}", "--no-save"]) == 2
    assert "cannot reach a server" in capsys.readouterr().err
    assert main(["bench", "client", "--server", f"http://127.0.0.1:{port}", "--no-save"]) == 2
    err = capsys.readouterr().err
    assert "infer bench client: cannot reach a server" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--slo", "foo=1"], "argument --slo: bad SLO term 'foo=1'"),
        (["serve", "--slo", "ttft_ms=nan"], "argument --slo: SLO bound ttft_ms must be a positive"),
        (["serve", "--scale", "0"], "argument --scale: must be a positive number, got 0"),
        (["ablation", "--rate-scale", "-1"], "argument --rate-scale: must be a positive number"),
        (["ablation", "--model", "toy", "--rungs", "foo"], "unknown rung(s) foo (the rungs: "),
    ],
)
def test_bad_bench_options_are_one_line_naming_them(argv, message, capsys, tmp_path: Path):
    """Before any server is reached or started (a bad --slo was a traceback after the first
    ablation rung's server had started; an unknown rung ran nothing and exited 0)."""
    from infer.bench.cli import main

    try:
        rc = main(["bench", *argv, "--out", str(tmp_path)])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())


def _tiny_workload(arrival: str, n: int = 4, rate: float | None = None):
    spec = WorkloadSpec(
        f"t_{arrival}",
        n,
        (LengthBand(5, 9),),
        LengthBand(3, 5),
        arrival,
        rate=rate,  # type: ignore[arg-type]
    )
    source = TextSource(words=[f"w{i}" for i in range(200)], words_per_token=1.0)
    return build_requests(spec, seed=1, source=source)


def test_sequential_requests_never_overlap(fake):
    wl = _tiny_workload("sequential")
    run = asyncio.run(run_workload(wl, fake.url, "fake-model", progress=False))
    recs = sorted(run.records, key=lambda r: r.start_s)
    assert all(r.success for r in recs)
    for a, b in zip(recs, recs[1:], strict=False):
        assert b.start_s >= a.start_s + a.e2e_s
    assert [r.output_tokens for r in run.records] == [r.max_tokens for r in wl.requests]


def test_uniform_arrivals_are_not_sent_early(fake):
    wl = _tiny_workload("uniform", n=4, rate=20.0)
    run = asyncio.run(
        run_workload(wl, fake.url, "fake-model", warmup_prompts=("w1 w2", "w3"), progress=False)
    )
    assert len(run.warmup) == 2 and all(r.success for r in run.warmup)
    assert all(r.success for r in run.records)
    for rec, req in zip(run.records, wl.requests, strict=True):
        assert rec.start_s >= req.arrival_s - 1e-3  # the event loop may wake a hair early
    ends = max(r.start_s + r.e2e_s for r in run.records)
    assert run.duration_s == pytest.approx(ends - min(r.start_s for r in run.records))


def test_lost_requests_are_counted(fake):
    wl = _tiny_workload("burst", n=3)
    bad = wl.requests[1].__class__(**{**wl.requests[1].__dict__, "prompt": "FAIL500"})
    wl = wl.__class__(wl.spec, (wl.requests[0], bad, wl.requests[2]), wl.seed)
    run = asyncio.run(run_workload(wl, fake.url, "fake-model", progress=False))
    from infer.bench.metrics import summarize

    m = summarize(run.records, run.duration_s)
    assert (m.configured, m.completed, m.errors, m.lost) == (3, 2, 1, 1)


def test_serve_cli_end_to_end_against_fake(fake, tmp_path: Path):
    from infer.bench.cli import main
    from infer.bench.report import load_report

    rc = main(
        ["bench", "serve", "--server", fake.url, "--workload", "all", "--scale", "0.04",
         "--seed", "7", "--out", str(tmp_path), "--no-progress", "--slo", "ttft_ms=60000"]
    )  # fmt: skip
    assert rc == 0
    (folder,) = tmp_path.iterdir()
    report = load_report(folder / "report.json")
    assert report["config"]["model"] == "fake-model"
    assert report["config"]["words_per_token"] == pytest.approx(1.0)  # the fake counts words
    assert report["config"]["max_model_len"] == 4096
    assert set(report["environment"]) >= {"cpu", "torch", "gpu", "python", "infer"}
    assert list(report["workloads"]) == [
        "baseline", "continuous_batching", "paged_attention", "chunked_prefill", "prefix_caching"
    ]  # fmt: skip
    for w in report["workloads"].values():
        m = w["metrics"]
        assert m["completed"] == m["configured"] == len(w["requests"]) == w["spec"]["num_requests"]
        assert m["errors"] == 0 and m["slo_met"] == m["completed"]
        for r in w["requests"]:
            # words-per-token calibrated to 1.0: the server saw exactly the targeted length
            assert r["prompt_tokens"] == r["prompt_len_target"]
            assert r["output_tokens"] == r["max_tokens"] == len(r["chunk_times_s"])
    md = (folder / "report.md").read_text()
    assert "## Cross-workload comparison" in md and "### chunked_prefill" in md
    for png in ("ttft_cdf.png", "itl_cdf.png", "throughput.png", "timeline_baseline.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_uses_the_server_tokenizer_when_it_has_one(fake, tmp_path: Path):
    from infer.bench.serve import ServeBenchConfig, run_serving_benchmark_sync

    fake.tokenize_routes = True
    cfg = ServeBenchConfig(
        server=fake.url, workload="prefix_caching", scale=0.05, progress=False, verbose=False
    )
    report = run_serving_benchmark_sync(cfg)
    assert report["config"]["tokenizer"] == f"{fake.url} /tokenize"
    assert report["config"]["words_per_token"] is None
    for r in report["workloads"]["prefix_caching"]["requests"]:
        assert r["prompt_tokens"] == r["prompt_len_target"]
    # without the routes the same run falls back to words calibrated by usage
    fake.tokenize_routes = False
    report = run_serving_benchmark_sync(cfg)
    assert report["config"]["tokenizer"] is None
    assert report["config"]["words_per_token"] == pytest.approx(1.0)


def test_client_suite_through_openai_sdk(fake):
    pytest.importorskip("openai")
    from infer.bench.client_suite import run_client_suite

    out = run_client_suite(
        fake.url, None, endpoint="chat", prefix_tokens=64, num_warm=2, batch_sizes=(1, 3),
        max_tokens=7, seed=3,
    )  # fmt: skip
    assert out["model"] == "fake-model"
    cache = out["caching"]
    assert cache["status"] == "ok" and cache["cold_ttft_ms"] > 0
    assert len(cache["warm_ttfts_ms"]) == 2
    assert cache["speedup"] == pytest.approx(1 - cache["avg_warm_ttft_ms"] / cache["cold_ttft_ms"])
    assert cache["cache_buster"].startswith("[UNIQUE-ID-")
    # cold prompt carries the buster in front; warm prompts do not
    chat_prompts = [b["messages"][0]["content"] for b in fake.bodies if "messages" in b]
    assert chat_prompts[0].startswith(cache["cache_buster"])
    assert not chat_prompts[1].startswith("[UNIQUE-ID-")
    assert all(b["max_tokens"] == 1 for b in fake.bodies[:4])
    kinds = [(b["kind"], b["batch_size"]) for b in out["batching"]]
    assert kinds == [("sequential", 1), ("sequential", 3), ("concurrent", 1), ("concurrent", 3)]
    for b in out["batching"]:
        assert b["success_rate"] == 1.0 and b["tps"] > 0 and b["avg_ttft_ms"] > 0
    batch_prompts = chat_prompts[4:]
    assert len(batch_prompts) == 8 and len(set(batch_prompts)) == 8  # unique ID suffixes
    assert "Cache speed-up" in out["markdown"] and "concurrent" in out["markdown"]


def test_client_cli_saves_json_and_markdown(fake, tmp_path: Path, capsys):
    from infer.bench.cli import main

    rc = main(
        ["bench", "client", "--server", fake.url, "--test", "batching", "--batch-sizes", "1,2",
         "--max-tokens", "4", "--out", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    (js,) = tmp_path.glob("client_*.json")
    data = json.loads(js.read_text())
    assert data["model"] == "fake-model" and "caching" not in data
    assert [b["batch_size"] for b in data["batching"]] == [1, 2, 1, 2]
    assert data["environment"]["cpu"]
    assert js.with_suffix(".md").read_text().startswith("# Client-side tests: fake-model")
    assert "Sequential vs concurrent batches" in capsys.readouterr().out
    fake.fail_all = True  # lost requests fail the run, as bench serve's do (it exited 0)
    rc = main(["bench", "client", "--server", fake.url, "--test", "batching", "--batch-sizes",
               "2", "--max-tokens", "4", "--no-save"])  # fmt: skip
    assert rc == 1 and "some requests failed" in capsys.readouterr().err

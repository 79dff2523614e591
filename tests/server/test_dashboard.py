"""The live view: /dashboard's event stream over HTTP, its key rules, and the page in Chromium."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.server.conftest import start_server

KEY = "dash-key"
NUM_BLOCKS = 8  # 128 tokens of KV: two 20 + 100-token requests cannot both finish without one
# of them being preempted (each alone fits).
PROMPT_TOKENS, MAX_TOKENS = 20, 100


@pytest.fixture(scope="module")
def dash_server(llama_checkpoint, server_logs):
    # Every step sleeps 10 ms (the test hook), so a run of ~200 steps provably lasts seconds:
    # long enough for a viewer polling every 100 ms to see it step by step.
    yield from start_server(llama_checkpoint, server_logs, "--num-kv-blocks", str(NUM_BLOCKS),
                            "--max-num-seqs", "4", api_key=KEY,
                            env={"INFER_TEST_STEP_DELAY": "0.01"})  # fmt: skip


def _force_preemption(server) -> list[threading.Thread]:
    """Two requests that cannot both keep their KV: the newer one is preempted once."""
    results: list[dict] = []

    def one(i: int) -> None:
        with server.client() as c:
            body = {"model": "tiny", "prompt": [5 + i] * PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "temperature": 0}  # fmt: skip
            results.append(c.post("/v1/completions", json=body).json())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    threads[0].start()
    server.wait_running(1)  # the second arrives while the first runs, however loaded the box
    threads[1].start()
    threads[0].results = results  # type: ignore[attr-defined]
    return threads


def _events(server, until, timeout: float = 60.0) -> list[dict]:
    """Read /dashboard/events until ``until(events)`` holds."""
    events: list[dict] = []
    params = {"interval": "0.1", "api_key": KEY}
    deadline = time.monotonic() + timeout
    with httpx.stream("GET", server.url + "/dashboard/events", params=params, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if until(events):
                    return events
            assert time.monotonic() < deadline, f"gave up after {len(events)} events"
    raise AssertionError("the event stream ended")


def test_event_stream_shows_steps_blocks_queues_and_a_forced_preemption(dash_server):
    first = _events(dash_server, lambda ev: len(ev) >= 1)[0]
    assert len(first["snapshot"]["blocks"]) == NUM_BLOCKS
    assert first["snapshot"]["requests"] == [] and set(first["snapshot"]["blocks"]) <= {".", "c"}
    threads = _force_preemption(dash_server)

    def saw_preemption(events: list[dict]) -> bool:
        return any(s["preempted"] for ev in events for s in ev["steps"])

    events = _events(dash_server, saw_preemption)
    for t in threads:
        t.join(60)
    steps = [s for ev in events for s in ev["steps"]]
    numbers = [s["step"] for s in steps]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers) and len(numbers) > 5
    assert all(s["num_prefill_tokens"] + s["num_decode_tokens"] <= s["token_budget"] for s in steps)
    preempting = next(s for s in steps if s["preempted"])
    assert len(preempting["preempted"]) == 1
    # While both ran, the snapshot showed both with their blocks, each 'u' block owned.
    busy = next(ev["snapshot"] for ev in events
                if sum(r["state"] == "running" for r in ev["snapshot"]["requests"]) == 2)  # fmt: skip
    assert busy["blocks"].count("u") == sum(r["num_blocks"] for r in busy["requests"])
    assert {busy["block_owner"][i] for i, c in enumerate(busy["blocks"]) if c == "u"} == {0, 1}
    assert events[-1]["server"]["preemptions_total"] >= 1
    # Nothing is lost: both requests got every token, and every block came back.
    results = threads[0].results  # type: ignore[attr-defined]
    assert [r["usage"]["completion_tokens"] for r in results] == [MAX_TOKENS, MAX_TOKENS]
    dash_server.wait_idle()
    after = _events(dash_server, lambda ev: ev[-1]["latency"]["num_finished"] >= 0)[-1]
    assert after["snapshot"]["requests"] == [] and "u" not in after["snapshot"]["blocks"]


def test_dashboard_takes_the_api_key_as_a_header_or_a_query_parameter(dash_server):
    url = dash_server.url
    assert httpx.get(url + "/dashboard").status_code == 401
    assert httpx.get(url + "/dashboard", params={"api_key": "wrong"}).status_code == 401
    assert httpx.get(url + "/dashboard/events").status_code == 401
    page = httpx.get(url + "/dashboard", params={"api_key": KEY})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "uPlot.iife.min.js" in page.text and "dashboard.js" in page.text
    assert httpx.get(url + "/dashboard", headers=dash_server.headers).status_code == 200
    # Static assets (page code, the vendored chart library) need no key.
    for asset in ("dashboard.js", "dashboard.css", "vendor/uplot/uPlot.iife.min.js"):
        assert httpx.get(f"{url}/dashboard/static/{asset}").status_code == 200, asset
    # The page is not part of the API schema.
    paths = httpx.get(url + "/openapi.json", headers=dash_server.headers).json()["paths"]
    assert not any(p.startswith("/dashboard") for p in paths)


def test_no_dashboard_switches_the_view_off(llama_checkpoint, server_logs):
    for server in start_server(llama_checkpoint, server_logs, "--no-dashboard"):
        assert httpx.get(server.url + "/dashboard").status_code == 404
        assert httpx.get(server.url + "/dashboard/events").status_code == 404
        assert "dashboard" not in httpx.get(server.url + "/").json()


def test_steps_are_recorded_only_while_someone_polls(tiny_engine):
    from infer.core.sampling_params import SamplingParams
    from infer.engine.trace import VIEWER_IDLE_SECONDS

    engine = tiny_engine
    assert engine.trace is None
    engine.add_request("t1", [3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.trace is None  # nobody polled: nothing recorded
    poll = engine.poll_trace(0)
    assert poll.steps == () and [r.request_id for r in poll.snapshot.requests] == ["t1"]
    engine.step()
    poll = engine.poll_trace(0)
    assert len(poll.steps) == 1 and poll.steps[0].num_decode_tokens == 1
    assert engine.poll_trace(poll.steps[-1].step).steps == ()
    engine.trace.last_poll -= VIEWER_IDLE_SECONDS + 1  # the viewer went away
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.trace is None


# ---- the page in a real browser -------------------------------------------------------------

CHROMIUM = os.environ.get("INFER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the test extra has playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip("no Chromium: install Debian's 'chromium' package or set INFER_CHROMIUM")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def test_page_shows_live_steps_the_block_map_and_a_preemption(browser, dash_server):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{dash_server.url}/dashboard?api_key={KEY}")
    page.wait_for_function("document.getElementById('mode').textContent === 'live'")
    page.wait_for_function("document.getElementById('blocks').dataset.blocks !== undefined")
    assert page.get_attribute("#blocks", "data-blocks") == str(NUM_BLOCKS)
    start = int(page.inner_text("#steps"))
    threads = _force_preemption(dash_server)
    page.wait_for_function(f"Number(document.getElementById('steps').textContent) > {start}")
    page.wait_for_function("document.querySelectorAll('#q-running li.req').length === 2",
                           timeout=60_000)  # fmt: skip
    assert int(page.get_attribute("#blocks", "data-used")) > 0
    page.wait_for_function("Number(document.getElementById('preemptions').textContent) >= 1",
                           timeout=60_000)  # fmt: skip
    assert "preempted" in page.inner_text("#events")
    for t in threads:
        t.join(60)
    dash_server.wait_idle()
    page.wait_for_function("document.getElementById('blocks').dataset.used === '0'")
    assert errors == []
    page.close()


def test_page_replays_a_recorded_trace(browser, dash_server, tiny_engine, tmp_path):
    from infer.core.sampling_params import SamplingParams

    path = tmp_path / "run.jsonl"
    with path.open("w") as sink:
        tiny_engine.record_trace(sink)
        for i in range(3):
            tiny_engine.add_request(
                f"r{i}", [3 + i] * 6, SamplingParams(max_tokens=4, ignore_eos=True)
            )
        while tiny_engine.has_unfinished_requests():
            tiny_engine.step()
        tiny_engine.record_trace(None)
    num_steps = len(path.read_text().splitlines())
    page = browser.new_page()
    page.goto(f"{dash_server.url}/dashboard?api_key={KEY}")
    page.set_input_files("#trace-file", str(path))
    page.wait_for_function("document.getElementById('mode').textContent.startsWith('replay')")
    page.click("#play")  # pause, then scrub to the first step
    page.evaluate("window.inferDashboard.showFrame(0)")
    assert page.inner_text("#mode") == f"replay 1/{num_steps}"
    assert page.inner_text("#q-running-n") == "(3)"
    assert page.get_attribute("#blocks", "data-blocks") == str(
        tiny_engine.kv_manager.num_total_blocks
    )
    page.close()

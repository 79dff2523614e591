"""Prefill/decode disaggregation's torch-free parts: the scheduler's held and imported KV
(with fake runner outputs), the payload's fit checks, and the router's request split."""

from __future__ import annotations

import json

import pytest

from infer.cluster.asgi import ForwardedRequest
from infer.cluster.disagg import KVTicket, split_request
from infer.core.kv_transfer import KVPayload
from infer.core.request import RequestStatus

from ._factories import fake_sample, make_request, make_scheduler, run_to_completion


def payload_for(prompt: list[int], block_size: int = 4) -> KVPayload:
    return KVPayload(tuple(prompt[:-1]), block_size, (), ())


def test_a_request_with_a_payload_computes_only_its_last_prompt_token():
    s = make_scheduler(num_blocks=64, block_size=4)
    r = make_request("d", prompt_len=11, max_tokens=3)
    r.kv_payload = payload_for(r.prompt_token_ids)
    s.add_request(r)
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.num_computed_tokens == 10 and len(chunk.token_ids) == 1 and chunk.sample
    # The payload's 10 tokens fill blocks 0..2 of the request's 3 (11 tokens + room).
    (imp,) = out.kv_imports
    assert imp.first_block == 0 and imp.block_ids == chunk.block_table[:3]
    assert r.num_transferred_tokens == 10 and r.num_cached_tokens == 0
    assert r.kv_payload is None  # the import holds it for this step only
    s.update_from_output(out, fake_sample(out))
    run_to_completion(s)
    assert r.num_output_tokens == 3 and s.counters.transferred_tokens == 10
    assert s.kv.num_free_blocks == 64


def test_a_payload_fills_past_the_prefix_hit_only():
    s = make_scheduler(num_blocks=64, block_size=4, prefix=True)
    s.add_request(make_request("warm", prompt_len=9, max_tokens=1))
    run_to_completion(s)  # caches the shared first 2 blocks
    r = make_request("d", prompt_len=13, max_tokens=2)
    r.kv_payload = payload_for(r.prompt_token_ids)
    s.add_request(r)
    out = s.schedule()
    (imp,) = out.kv_imports
    assert r.num_cached_tokens == 8 and r.num_transferred_tokens == 4
    assert imp.first_block == 2 and imp.block_ids == out.chunks[0].block_table[2:3]
    assert out.chunks[0].num_computed_tokens == 12
    # A payload no longer than the hit has nothing to copy.
    again = make_request("again", prompt_len=9, max_tokens=1)
    again.kv_payload = payload_for(again.prompt_token_ids)
    s.add_request(again)
    s.update_from_output(out, fake_sample(out))
    out = s.schedule()
    assert again.num_cached_tokens == 8 and not out.kv_imports


def test_preempted_before_its_step_gives_the_payload_back():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    low = make_request("low", prompt_len=9, max_tokens=4, priority=5)
    low.kv_payload = payload_for(low.prompt_token_ids)
    s.add_request(low)
    s.add_request(make_request("high", prompt_len=5, max_tokens=2, priority=0, arrival=1.0))
    out = s.schedule()  # "high" is first in priority order; "low" waits for the slot
    assert [c.request_id for c in out.chunks] == ["high"] and not out.kv_imports
    assert low.kv_payload is not None
    run_to_completion(s)
    assert low.num_transferred_tokens == 8 and low.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_held_blocks_stay_until_released_and_only_after_a_normal_finish():
    s = make_scheduler(num_blocks=64, block_size=4)
    kept = make_request("kept", prompt_len=10, max_tokens=1)
    kept.export_kv = True
    s.add_request(kept)
    run_to_completion(s)
    assert list(s.held) == ["kept"] and s.kv.num_free_blocks == 61
    assert s.kv.block_table(kept) != []
    assert s.release_held("kept") and not s.release_held("kept")
    assert s.kv.num_free_blocks == 64
    aborted = make_request("gone", prompt_len=10, max_tokens=1)
    aborted.export_kv = True
    s.add_request(aborted)
    s.finish_request("gone", RequestStatus.FINISHED_ABORTED)
    assert not s.held and s.kv.num_free_blocks == 64


def test_payload_fit_checks_name_the_problem():
    prompt = [5, 6, 7, 8, 9]
    p = payload_for(prompt)
    assert p.usable_for(prompt, 4) is None
    assert "block size" in p.usable_for(prompt, 8)
    assert "not this prompt" in p.usable_for([5, 6, 7, 0, 9], 4)
    assert "tokens for a prompt" in p.usable_for(prompt[:4], 4)  # nothing left to compute
    assert p.num_blocks == 1
    assert KVTicket(None, 0, num_tokens=8, block_size=4).num_blocks == 3  # + the last token


def fwd(body: dict | str, path: str = "/v1/completions") -> ForwardedRequest:
    raw = body if isinstance(body, str) else json.dumps(body)
    return ForwardedRequest("POST", path, headers=((b"content-length", b"99"),
                                                   (b"x-a", b"1")), body=raw.encode())  # fmt: skip


def test_the_prefill_half_asks_one_token_without_stream_or_decode_options():
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "min_tokens": 5,
            "stream_options": {"include_usage": True}, "stop": ["x"], "temperature": 0.7,
            "logprobs": 2}  # fmt: skip
    half = split_request(fwd(body))
    assert half is not None
    got = json.loads(half.body)
    assert got == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False,
                   "temperature": 0.7}  # fmt: skip
    assert half.headers == ((b"x-a", b"1"),)
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 9, "tools": [{"type": "function"}]}  # fmt: skip
    got = json.loads(split_request(fwd(chat, "/v1/chat/completions")).body)
    assert got["max_completion_tokens"] == 1 and got["tools"] == chat["tools"]  # same prompt
    assert split_request(fwd({"prompt": ["one prompt"]})) is not None


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "n": 2},
        {"prompt": "x", "best_of": 3},
        {"prompt": ["a", "b"]},
        {"prompt": "x", "prompt_logprobs": 1},
        {"prompt": "x", "echo": True},
        "not json",
        "[1, 2]",
    ],
)
def test_requests_that_are_not_split(body):
    assert split_request(fwd(body)) is None

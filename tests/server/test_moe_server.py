"""A mixture-of-experts model served over HTTP: /metrics says which experts ran, on how many
rows (``infer:moe_expert_rows_total{layer, expert}``), counting every row each sparse layer saw
(k experts per row), from the requests' steps only."""

from __future__ import annotations

import re

import httpx
import pytest
from tests.server.conftest import start_server

KIND, LAYERS, EXPERTS, TOP_K = "qwen3_moe", 2, 8, 4  # infer.testing.checkpoints' tiny recipe


@pytest.fixture(scope="module")
def moe_server(tiny_checkpoints, server_logs):
    yield from start_server(tiny_checkpoints[KIND], server_logs, "--dtype", "bfloat16")


def _expert_rows(server) -> dict[tuple[int, int], float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    pattern = r"^infer:moe_expert_rows_total\{([^}]*)\} (\S+)$"
    out = {}
    for labels, value in re.findall(pattern, text, flags=re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        assert fields["model_name"] == "tiny"
        out[int(fields["layer"]), int(fields["expert"])] = float(value)
    return out


def test_metrics_count_the_rows_each_expert_ran_on(moe_server):
    before = _expert_rows(moe_server)
    assert set(before) == {(layer, e) for layer in range(LAYERS) for e in range(EXPERTS)}
    assert all(v == 0 for v in before.values())  # start-up runs no request's rows
    body = {"model": "tiny", "prompt": "The quick brown fox jumps over", "max_tokens": 9,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    usage = httpx.post(moe_server.base_url + "/completions", json=body, timeout=120).json()["usage"]
    moe_server.wait_idle()
    after = _expert_rows(moe_server)
    # Every token went through each sparse layer once (the last sampled token is never fed
    # back), each to its top k experts.
    rows = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    for layer in range(LAYERS):
        per_expert = [after[layer, e] - before[layer, e] for e in range(EXPERTS)]
        assert sum(per_expert) == rows * TOP_K, (layer, per_expert)
        assert max(per_expert) <= rows  # an expert sees a row at most once
        assert sum(n > 0 for n in per_expert) >= TOP_K

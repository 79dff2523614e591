"""LoRA pieces on their own: the batched update kernel against float math, the step grouping,
the scheduler's adapter limit (fake runner), the slot pool's LRU, and option parsing."""

from __future__ import annotations

import pytest
import torch

from infer.config import EngineConfig, LoRAConfig, parse_lora_module
from infer.core.request import RequestStatus
from infer.runner.cpu.kernels import cpu_kernels
from infer.runner.lora.layers import LoRABatch, LoRALinear, LoRAState

from ._factories import fake_sample, make_request, make_scheduler


def _random_layer(dtype: torch.dtype, parts=(48, 16, 16), k=40, slots=3, rank=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.nn.Linear(k, sum(parts), bias=False).to(dtype)
    state = LoRAState()
    layer = LoRALinear(base, k, parts, slots, rank, dtype, torch.device("cpu"), state)
    from infer.runner.lora.adapter import LoRAModule

    for s in range(slots):
        modules = []
        for p, width in enumerate(parts):
            r = [rank, 3, 0][(s + p) % 3]  # full rank, a smaller one, and a part not adapted
            if r == 0:
                modules.append(None)
                continue
            a = torch.randn(r, k, generator=gen) * 0.3
            b = torch.randn(width, r, generator=gen) * 0.3
            modules.append(LoRAModule(a, b, scale=0.5 + s))
        layer.load_slot(s, modules)
    return layer, state


def _float_reference(layer: LoRALinear, x: torch.Tensor, y: torch.Tensor, slots: list[int]):
    """Each row's update in float32 from the layer's (bf16) weights, rounded once."""
    out = y.float().clone()
    for row, s in enumerate(slots):
        if s < 0:
            continue
        for p in range(len(layer.parts)):
            r = int(layer.rank[s, p])
            if not r:
                continue
            lo, hi = layer.offsets[p], layer.offsets[p + 1]
            xa = layer.lora_a(s, p, r).float() @ x[row].float()
            out[row, lo:hi] += float(layer.scale[s, p]) * (
                xa @ layer.lora_b(s)[lo:hi, :r].float().t()
            )
    return out.to(y.dtype)


class _RowByRow(torch.nn.Module):
    """A projection applied to one row at a time: the same bits whatever else is in the batch."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.inner = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.inner(row) for row in x.split(1)])


@pytest.mark.skipif(cpu_kernels() is None, reason="the C++ kernels do not build here")
@pytest.mark.parametrize(("rows", "k", "rank"), [(1, 40, 8), (7, 41, 8), (64, 40, 24)])
def test_kernel_matches_float_math_and_leaves_other_rows_alone(rows, k, rank):
    layer, state = _random_layer(torch.bfloat16, k=k, rank=rank)
    # The base projection row by row: torch's bf16 matmul may round one row differently from
    # seven (a CI run on another CPU saw one element 1 ulp apart), and what is checked here is
    # the adapter update's promise, not the base GEMM's.
    layer.base = _RowByRow(layer.base)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, layer.in_features, generator=gen).to(torch.bfloat16)
    slots = [[-1, 2, 0, 1, 0][i % 5] for i in range(rows)]
    state.batch = LoRABatch.build(slots, torch.device("cpu"))
    base = layer.base(x)
    y = layer(x)
    want = _float_reference(layer, x, base, slots)
    for row, s in enumerate(slots):
        if s < 0:
            assert torch.equal(y[row], base[row])  # no adapter: the base output, bit for bit
        else:
            torch.testing.assert_close(y[row].float(), want[row].float(), atol=2e-2, rtol=1e-2)
    # Each row's result is the same whatever else is in the step.
    for row in range(min(rows, 5)):
        state.batch = LoRABatch.build([slots[row]], torch.device("cpu"))
        assert torch.equal(layer(x[row : row + 1])[0], y[row])


def test_torch_path_matches_float_math():
    layer, state = _random_layer(torch.float32)
    x = torch.randn(9, layer.in_features)
    slots = [0, -1, 1, 2, 2, -1, 0, 1, 0]
    state.batch = LoRABatch.build(slots, torch.device("cpu"))
    base = layer.base(x)
    torch.testing.assert_close(layer(x), _float_reference(layer, x, base, slots))
    state.batch = None
    assert torch.equal(layer(x), base)


def test_batch_groups_rows_by_slot_in_row_order():
    batch = LoRABatch.build([2, -1, 0, 2, 0, -1], torch.device("cpu"))
    assert batch is not None
    assert batch.rows.tolist() == [2, 4, 0, 3]
    assert batch.slots == ((0, 0, 2), (2, 2, 2))
    assert batch.groups.tolist() == [[0, 2], [0, 2], [2, 2]]
    assert LoRABatch.build([-1, -1], torch.device("cpu")) is None


def _lora_request(rid: str, name: str | None, **kw):
    r = make_request(rid, **kw)
    r.lora_name = name  # (one load per name here)
    r.lora_id = None if name is None else ord(name)
    return r


def test_scheduler_never_runs_more_adapters_than_slots():
    s = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    s.max_loras = 2
    names = ["a", "b", "c", None, "a", "d", "b", None, "c", "d"]
    reqs = [_lora_request(f"r{i}", n, prompt_len=5, max_tokens=3 + i % 3)
            for i, n in enumerate(names)]  # fmt: skip
    for r in reqs:
        s.add_request(r)
    first = True
    while s.has_unfinished_requests():
        out = s.schedule()
        running = {r.lora_name for r in s.running} - {None}
        assert len(running) <= 2
        step = {s.requests[c.request_id].lora_name for c in out.chunks} - {None}
        assert len(step) <= 2
        if first:  # "c" waits for a slot; the base-model request behind it does not
            assert reqs[2].status == RequestStatus.WAITING
            assert reqs[3].status == RequestStatus.RUNNING
            first = False
        s.update_from_output(out, fake_sample(out))
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert s.kv.num_free_blocks == 256


def test_skipped_requests_keep_their_place_in_line():
    s = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    s.max_loras = 1
    for i, name in enumerate(["a", "b", "c", "a"]):
        s.add_request(_lora_request(f"r{i}", name, prompt_len=4, max_tokens=2))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["r0", "r3"]
    assert [r.request_id for r in s.waiting] == ["r1", "r2"]


def test_lora_options_parse_like_vllm():
    assert parse_lora_module("sql=/a/b").lora_path == "/a/b"
    r = parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}')
    assert (r.lora_name, r.lora_path, r.base_model_name) == ("x", "/p", "m")
    with pytest.raises(ValueError, match="is not name=path"):
        parse_lora_module("nameonly")
    with pytest.raises(ValueError, match='needs "name" and "path"'):
        parse_lora_module('{"name": "x"}')
    with pytest.raises(ValueError, match="--max-cpu-loras .* must be at least --max-loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="names 'a' twice"):
        EngineConfig.from_kwargs(enable_lora=True, lora_modules=["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        EngineConfig.from_kwargs(lora_modules=["a=/x"])
    cfg = EngineConfig.from_kwargs(enable_lora=True, max_loras=3)
    assert cfg.lora == LoRAConfig(max_loras=3) and cfg.lora.host_capacity == 3

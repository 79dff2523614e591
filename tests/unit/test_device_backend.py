"""The device seam: what differs by device is the backend's (runner/backend.py)."""

import pytest
import torch

from infer.core.messages import RunnerSetup
from infer.runner.backend import WeightsConfig, device_backend
from infer.runner.cpu.backend import DEFAULT_CPU_KV_BYTES, CpuBackend


def test_cpu_backend_runs_fp16_checkpoints_in_bf16_unless_asked():
    backend = device_backend("cpu")
    assert isinstance(backend, CpuBackend)
    assert backend.resolve_dtype("auto", "float16") == torch.bfloat16
    assert backend.resolve_dtype("float16", "bfloat16") == torch.float16
    assert backend.resolve_dtype("auto", None) == torch.float32
    assert backend.resolve_dtype("auto", "not-a-dtype") == torch.float32


def test_cpu_kv_budget_is_every_slot_at_full_length_capped():
    backend = device_backend("cpu")
    assert backend.kv_budget(1 << 20, 0.9, reserve=1 << 19) == 1 << 20
    assert backend.kv_budget(DEFAULT_CPU_KV_BYTES * 3, 0.9) == DEFAULT_CPU_KV_BYTES


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="--device cuda was given but CUDA is not available"):
        device_backend("cuda")


def test_an_unknown_device_is_named():
    with pytest.raises(ValueError, match="--device meta: infer runs on cpu or cuda"):
        device_backend("meta")


def test_build_runner_allocates_the_kv_cache_for_the_loaded_model(tiny_checkpoints):
    backend = device_backend("cpu", seed=3)
    model = backend.load_model(WeightsConfig(tiny_checkpoints["llama"], torch.float32))
    runner = backend.build_runner(RunnerSetup(num_blocks=5, block_size=4, max_num_seqs=2))
    cache = runner.kv_cache
    spec = model.spec
    assert runner.model is model
    assert cache.num_blocks == 5 and cache.block_size == 4 and cache.dtype == torch.float32
    assert tuple(cache.tensor.shape) == (2, spec.num_layers, 20, spec.num_kv_heads, spec.head_dim)


def test_build_runner_needs_a_loaded_model():
    with pytest.raises(AssertionError, match="load_model first"):
        device_backend("cpu").build_runner(RunnerSetup(num_blocks=1, block_size=4))


def test_a_draft_is_loaded_in_the_models_dtype_and_gets_a_runner_of_its_own(tiny_checkpoints):
    backend = device_backend("cpu")
    target = backend.load_model(WeightsConfig(tiny_checkpoints["llama"], torch.bfloat16))
    draft = backend.load_draft(tiny_checkpoints["qwen2"])
    runner = backend.build_runner(RunnerSetup(num_blocks=3, block_size=4), model=draft)
    spec = draft.spec
    assert backend.model is target and runner.model is draft
    assert (
        runner.kv_cache.dtype == torch.bfloat16
        and draft.embed_tokens.weight.dtype == torch.bfloat16
    )
    assert tuple(runner.kv_cache.tensor.shape) == (
        2,
        spec.num_layers,
        12,
        spec.num_kv_heads,
        spec.head_dim,
    )


def test_a_draft_needs_the_target_loaded_first(tiny_checkpoints):
    with pytest.raises(AssertionError, match="load_model first"):
        device_backend("cpu").load_draft(tiny_checkpoints["llama"])


def test_what_a_tensor_parallel_driver_asks_before_any_rank_is_built():
    from infer.runner.backend import backend_class
    from infer.runner.gpu.backend import CudaBackend

    cpu = backend_class("cpu")
    assert cpu is CpuBackend and cpu.collectives == "gloo" and cpu.pins_cores
    assert cpu.rank_device(torch.device("cpu"), 1) == torch.device("cpu")
    cuda = backend_class("cuda:0")
    assert cuda is CudaBackend and cuda.collectives == "nccl" and not cuda.pins_cores
    n = torch.cuda.device_count()
    if n:
        assert cuda.rank_device(torch.device("cuda", 0), n - 1) == torch.device("cuda", n - 1)
    with pytest.raises(ValueError, match=f"rank {n} needs cuda:{n}, but only {n} CUDA devices"):
        cuda.rank_device(torch.device("cuda", 0), n)

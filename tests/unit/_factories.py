"""Small factories for scheduler tests: requests, schedulers and a fake runner."""

from __future__ import annotations

from infer.config import CacheConfig, SchedulerConfig
from infer.core.messages import SampledToken, SchedulerOutput
from infer.core.request import Request
from infer.core.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler
from infer.kv_cache.manager import ContiguousKVManager, PagedKVManager

EOS = 0


def make_request(
    rid: str,
    prompt_len: int = 8,
    max_tokens: int = 4,
    *,
    priority: int = 0,
    arrival: float = 0.0,
    prompt: list[int] | None = None,
    salt: str | None = None,
    ignore_eos: bool = True,
) -> Request:
    tokens = prompt if prompt is not None else [1 + (i % 97) for i in range(prompt_len)]
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
        eos_token_ids=(EOS,),
        priority=priority,
        cache_salt=salt,
        arrival_time=arrival,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    prefix: bool = False,
    contiguous_len: int | None = None,
    use_kv_cache: bool = True,
    swap_blocks: int = 0,
    **sched,
) -> Scheduler:
    cache = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=prefix,
        use_kv_cache=use_kv_cache,
        kv_cache_backend="contiguous" if contiguous_len else "paged",
    )
    if contiguous_len:
        kv = ContiguousKVManager(num_blocks, contiguous_len)
    else:
        kv = PagedKVManager(num_blocks, block_size, prefix, num_swap_blocks=swap_blocks)
    return Scheduler(SchedulerConfig(**sched), cache, kv)


def fake_sample(out: SchedulerOutput, token: int = 7) -> dict[str, SampledToken]:
    return {c.request_id: SampledToken(token) for c in out.chunks if c.sample}


def run_to_completion(s: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outs
        out = s.schedule()
        outs.append(out)
        s.update_from_output(out, fake_sample(out))
    raise AssertionError("scheduler did not finish every request")

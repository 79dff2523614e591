"""The in-process harness of the engine micro-benchmarks (``infer bench micro``).

A case is a list of :class:`MicroRequest` (prompt token ids, output length, the engine step at
which it arrives, a priority, a tag) replayed against one :class:`~infer.engine.engine.LLMEngine`
built with the case's options. :func:`run_engine` drives ``step()`` itself and timestamps every
token as it leaves the engine, so TTFT, latency and the worst inter-token gap are measured the same
way for every configuration. Sampling is greedy with ``ignore_eos``: every request generates
exactly its ``max_tokens``, so completed-vs-configured is a real check.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOY_CONTEXT = 64  # the toy NanoGPT's block_size (context length)


@dataclass(frozen=True)
class MicroRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrive_step: int = 0  # added before this engine step (0: at the start)
    priority: int = 0  # lower number = more important (the engine's priority policy)
    after_previous: bool = False  # added only once every earlier request has finished
    tag: str = ""


@dataclass
class MicroRecord:
    tag: str
    prompt_len: int
    max_tokens: int
    priority: int
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("length", "stop") and self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def latency_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def gaps_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass
class MicroRun:
    """One replay of a case on one engine configuration."""

    records: list[MicroRecord]
    wall_time_s: float
    steps: int
    stats: dict

    @property
    def configured(self) -> int:
        return len(self.records)

    @property
    def completed(self) -> int:
        return sum(r.completed for r in self.records)

    @property
    def tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.records)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_time_s

    def avg_ttft_ms(self, tag: str | None = None) -> float | None:
        v = [r.ttft_s for r in self._tagged(tag) if r.ttft_s is not None]
        return None if not v else 1000 * statistics.fmean(v)

    def avg_latency_ms(self, tag: str | None = None) -> float | None:
        v = [r.latency_s for r in self._tagged(tag) if r.latency_s is not None]
        return None if not v else 1000 * statistics.fmean(v)

    def max_gap_ms(self, tag: str | None = None) -> float | None:
        v = [g for r in self._tagged(tag) for g in r.gaps_s]
        return None if not v else 1000 * max(v)

    def avg_gap_ms(self, tag: str | None = None) -> float | None:
        v = [g for r in self._tagged(tag) for g in r.gaps_s]
        return None if not v else 1000 * statistics.fmean(v)

    def _tagged(self, tag: str | None) -> list[MicroRecord]:
        return [r for r in self.records if tag is None or r.tag == tag]

    def summary(self) -> dict:
        return {
            "configured": self.configured,
            "completed": self.completed,
            "tokens": self.tokens,
            "wall_time_s": self.wall_time_s,
            "tokens_per_s": self.tokens_per_s,
            "ttft_ms": self.avg_ttft_ms(),
            "avg_latency_ms": self.avg_latency_ms(),
            "max_gap_ms": self.max_gap_ms(),
            "avg_gap_ms": self.avg_gap_ms(),
            "steps": self.steps,
            "stats": self.stats,
        }


def run_engine(engine, requests: Sequence[MicroRequest], max_steps: int = 100_000) -> MicroRun:
    """Replay ``requests`` on ``engine`` (an ``LLMEngine``), timestamping every token."""
    from infer.core.sampling_params import SamplingParams

    records = {
        f"r{i}": MicroRecord(r.tag, len(r.prompt_ids), r.max_tokens, r.priority)
        for i, r in enumerate(requests)
    }
    pending = list(enumerate(requests))
    before = _stats(engine)
    step = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        if step >= max_steps:
            raise RuntimeError(f"the case did not finish in {max_steps} engine steps")
        still = []
        busy = engine.has_unfinished_requests()
        for i, r in pending:
            ready = r.arrive_step <= step and not (r.after_previous and busy)
            if not ready or (still and r.after_previous):
                still.append((i, r))
                continue
            rid = f"r{i}"
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            now = time.perf_counter()
            records[rid].arrival = now
            # (fcfs refuses a priority: the same requests run there without theirs)
            priority = r.priority if engine.config.scheduler.scheduling_policy == "priority" else 0
            engine.add_request(rid, list(r.prompt_ids), params, priority=priority, arrival_time=now)
            busy = True
        pending = still
        outputs = engine.step()
        now = time.perf_counter()
        step += 1
        for out in outputs:
            rec = records.get(out.request_id)
            if rec is None:
                continue
            rec.token_times.extend([now] * len(out.new_token_ids))
            rec.num_output_tokens = out.num_output_tokens
            rec.num_cached_tokens = max(rec.num_cached_tokens, out.num_cached_tokens)
            if out.finished:
                rec.finished = now
                rec.finish_reason = out.finish_reason
                rec.error = out.error
    wall = time.perf_counter() - t0
    after = _stats(engine)
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    return MicroRun(list(records.values()), max(wall, 1e-9), step, delta)


def _stats(engine) -> dict:
    s = asdict(engine.get_stats())
    s.pop("finished_total", None)
    return s


# --------------------------------------------------------------------------------------------
# Model and engines


def toy_model_path(explicit: str | None = None) -> tuple[str, str]:
    """(path, how it was obtained): ``explicit``, else the built-in ``toy``, else a random init."""
    if explicit:
        return explicit, "given"
    try:
        from infer.builtin import ensure_builtin_model  # type: ignore[attr-defined]
    except ImportError:
        return str(random_toy_checkpoint()), "random-init GPT-2 of the toy's shape"
    return str(ensure_builtin_model("toy")), "built-in toy"


def random_toy_checkpoint(folder: str | Path | None = None, vocab_size: int = 384) -> Path:
    """A random-init GPT-2 shaped like the toy NanoGPT (4 layers, 4 heads, 32 wide,
    context 64) with a small byte-level BPE tokenizer; reused when already there."""
    import tempfile

    out = Path(folder or Path(tempfile.gettempdir()) / f"infer-bench-toy-random-v1-{vocab_size}")
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from infer.data.train_tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer(out, vocab_size=vocab_size, model_max_length=TOY_CONTEXT)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=TOY_CONTEXT,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_inner=128,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    GPT2LMHeadModel(config).save_pretrained(out, safe_serialization=True)
    return out


def make_engine(model: str, **options):
    """An ``LLMEngine`` for ``model`` with engine options (the fields of ``infer.config``).

    Prefix caching is off unless a case turns it on: each micro-benchmark measures one
    optimisation against its absence, and the engine's default (on) would mix cache hits into
    the others."""
    from infer.bench.offline import make_engine as offline_engine

    options.setdefault("enable_prefix_caching", False)
    return offline_engine(model, **options)


def warm_up(engine, vocab: int, n: int = 2) -> None:
    """A few short requests so first-call costs (allocations, lazy init) are not measured."""
    rng = random.Random(0)
    reqs = [MicroRequest(tuple(rng.randrange(3, vocab) for _ in range(8)), 4) for _ in range(n)]
    run_engine(engine, reqs)


def num_params(engine) -> int:
    return sum(p.numel() for p in engine.model.parameters())


def prompt_ids(tokenizer, length: int, rng: random.Random, words: Sequence[str]) -> tuple[int, ...]:
    """``length`` token ids of real English text (from a random position of ``words``)."""
    ids: list[int] = []
    start = rng.randrange(len(words))
    k = 0
    while len(ids) < length:
        chunk = " ".join(words[(start + k + j) % len(words)] for j in range(8))
        ids += tokenizer.encode(" " + chunk, add_special_tokens=False)
        k += 8
    return tuple(ids[:length])


def corpus_words() -> list[str]:
    from infer.data.corpus import load_corpus

    return " ".join(load_corpus(include_docstrings=False)).split()


def prompt_source(model: str | Path, seed: int) -> tuple[object, random.Random, list[str]]:
    """What a suite draws its prompts from (:func:`prompt_ids`): ``model``'s tokenizer, a
    random generator seeded with ``seed`` and the corpus's words."""
    from infer.model.tokenizer import load_tokenizer

    return load_tokenizer(model), random.Random(seed), corpus_words()


def ratio_cell(a: float | None, b: float | None) -> str:
    """``b / a`` as ``1.23x`` for a table cell; ``—`` when either is missing (or ``a`` is 0)."""
    return "—" if not a or b is None else f"{b / a:.2f}x"


def median_run(runs: Sequence[MicroRun]) -> MicroRun:
    """The run with the median wall time (a real run, so its fields stay consistent)."""
    ordered = sorted(runs, key=lambda r: r.wall_time_s)
    return ordered[len(ordered) // 2]


_trace_dir: Path | None = None


def record_traces(folder: str | Path | None) -> None:
    """Have :func:`run_case` write each case's step trace to ``folder/<name>.jsonl`` (one
    ``{"step", "snapshot"}`` line per engine step of its last repeat: the file the live view's
    replay opens); ``None`` stops."""
    global _trace_dir
    _trace_dir = Path(folder) if folder is not None else None
    if _trace_dir is not None:
        _trace_dir.mkdir(parents=True, exist_ok=True)


def run_case(
    model: str,
    options: dict,
    requests: Sequence[MicroRequest],
    repeats: int = 3,
    name: str = "",
) -> MicroRun:
    """Build an engine with ``options``, warm it up, replay the case ``repeats`` times.

    With :func:`record_traces` on, the last repeat's steps are written to ``<name>.jsonl``.
    """
    engine = make_engine(model, **options)
    warm_up(engine, engine.spec.vocab_size)
    runs = []
    for i in range(repeats):
        if options.get("enable_prefix_caching"):
            engine.reset_prefix_cache()  # each repeat starts cold, like the first
        if _trace_dir is not None and name and i == repeats - 1:
            with (_trace_dir / f"{name}.jsonl").open("w") as sink:
                engine.record_trace(sink)
                try:
                    runs.append(run_engine(engine, requests))
                finally:
                    engine.record_trace(None)
        else:
            runs.append(run_engine(engine, requests))
    return median_run(runs)

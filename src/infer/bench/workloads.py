"""The five serving workloads (one per optimisation: baseline, continuous batching, paged
attention, chunked prefill, prefix caching), generated from a fixed seed.

Each workload is a :class:`WorkloadSpec` (how many requests, which prompt and output lengths, how
they arrive); :func:`build_requests` turns a spec into concrete :class:`BenchRequest` objects whose
prompts are cut from real English text (Python's bundled documentation) to a target length in
tokens. The same spec, seed and tokenizer always give the same prompts, lengths and arrival times.

Arrival patterns:

- ``sequential``: the client sends request *i+1* only after request *i* has finished;
- ``uniform``: request *i* is sent at ``i / rate`` seconds;
- ``burst``: every request is sent at t = 0;
- ``poisson``: exponential inter-arrival gaps with mean ``1 / rate`` (the first at t = 0).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

Arrival = Literal["sequential", "uniform", "burst", "poisson"]
ARRIVALS = ("sequential", "uniform", "burst", "poisson")

# English averages ~0.75 words per BPE token (~4 characters per token); used when no tokenizer is
# given, and refined from the server's own usage counts when the client can measure it.
DEFAULT_WORDS_PER_TOKEN = 0.75


@dataclass(frozen=True)
class LengthBand:
    """Uniform integer range ``[low, high]`` drawn with probability ``weight`` within a mixture."""

    low: int
    high: int
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got [{self.low}, {self.high}]")
        if self.weight <= 0:
            raise ValueError(f"weight must be positive, got {self.weight}")


@dataclass(frozen=True)
class WorkloadSpec:
    """One serving workload: request count, length ranges and arrival process."""

    name: str
    num_requests: int
    prompt_bands: tuple[LengthBand, ...]  # prompt length in tokens (a mixture of uniform bands)
    output_band: LengthBand  # max_tokens per request
    arrival: Arrival
    rate: float | None = None  # requests per second for uniform / poisson
    shared_prefix_len: int = 0  # tokens of one prefix shared by every prompt (before the bands)
    measures: str = ""
    title: str = ""

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be positive, got {self.num_requests}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.arrival in ("uniform", "poisson") and not (self.rate and self.rate > 0):
            raise ValueError(f"{self.arrival} arrival needs a positive rate")
        if not self.prompt_bands:
            raise ValueError("need at least one prompt length band")
        if self.shared_prefix_len < 0:
            raise ValueError("shared_prefix_len must be >= 0")

    def describe(self) -> dict:
        """A JSON-friendly description (stored in reports)."""
        d = asdict(self)
        d["prompt_bands"] = [asdict(b) for b in self.prompt_bands]
        d["output_band"] = asdict(self.output_band)
        return d


def _band(low: int, high: int, weight: float = 1.0) -> LengthBand:
    return LengthBand(low, high, weight)


# The workload table of docs/benchmarks.md ("Serving workloads").
WORKLOADS: dict[str, WorkloadSpec] = {
    spec.name: spec
    for spec in (
        WorkloadSpec(
            "baseline", 10, (_band(256, 256),), _band(256, 256), "sequential",
            measures="Single-request overhead floor",
            title="Sequential Single Requests",
        ),
        WorkloadSpec(
            "continuous_batching", 32, (_band(64, 512),), _band(64, 256), "uniform", rate=4.0,
            measures="TTFT P95/P99 (benefit of per-step admit/retire)",
            title="Staggered Arrivals",
        ),
        WorkloadSpec(
            "paged_attention", 48, (_band(128, 384),), _band(128, 256), "burst",
            measures="Throughput + TTFT (paged admits more per memory budget)",
            title="Single Burst, Moderate Lengths",
        ),
        WorkloadSpec(
            "chunked_prefill", 48, (_band(1024, 2048, 0.75), _band(64, 128, 0.25)),
            _band(64, 256), "poisson", rate=6.0,
            measures="ITL P95/P99 (long prefills block decode)",
            title="Long Prompts, Poisson Arrivals",
        ),
        WorkloadSpec(
            "prefix_caching", 48, (_band(32, 128),), _band(256, 256), "uniform", rate=8.0,
            shared_prefix_len=1024,
            measures="TTFT P50/P95 (repeated prefill cost)",
            title="Shared System Prompt",
        ),
    )
}  # fmt: skip


def resolve_workloads(name: str) -> list[WorkloadSpec]:
    """``"all"`` -> the five workloads in table order; otherwise the one named."""
    if name == "all":
        return list(WORKLOADS.values())
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose all|{'|'.join(WORKLOADS)}")
    return [WORKLOADS[name]]


def _scale_len(n: int, f: float, floor: int = 1) -> int:
    return max(floor, int(round(n * f)))


def scale_workload(
    spec: WorkloadSpec, scale: float = 1.0, rate_scale: float = 1.0, min_requests: int = 2
) -> WorkloadSpec:
    """Shrink (or grow) request counts and every length by ``scale``; arrival rates by ``rate_scale``.

    Counts keep at least ``min_requests`` (a percentile of one request says nothing), lengths at
    least 4 tokens of prompt and 2 of output (so that inter-token latency exists).
    """
    if scale <= 0 or rate_scale <= 0:
        raise ValueError("scale and rate_scale must be positive")
    if scale == 1.0 and rate_scale == 1.0:
        return spec
    bands = tuple(
        LengthBand(_scale_len(b.low, scale, 4), _scale_len(b.high, scale, 4), b.weight)
        for b in spec.prompt_bands
    )
    out = LengthBand(
        _scale_len(spec.output_band.low, scale, 2), _scale_len(spec.output_band.high, scale, 2)
    )
    return replace(
        spec,
        num_requests=max(min_requests, int(round(spec.num_requests * scale))),
        prompt_bands=bands,
        output_band=out,
        rate=spec.rate * rate_scale if spec.rate else spec.rate,
        shared_prefix_len=_scale_len(spec.shared_prefix_len, scale, 0),
    )


def arrival_times(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    """Send offsets in seconds from the start of the workload (all 0.0 for sequential/burst).

    For ``sequential`` the offsets are unused: the client waits for each request to finish.
    """
    n = spec.num_requests
    if spec.arrival in ("sequential", "burst"):
        return [0.0] * n
    assert spec.rate is not None
    if spec.arrival == "uniform":
        return [i / spec.rate for i in range(n)]
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(spec.rate)
    return times


# --------------------------------------------------------------------------------------------
# Prompt text


class TextSource:
    """Cuts passages of a target token length out of one long stream of English words.

    With ``count_tokens`` (a tokenizer's length function) passages are trimmed to the target
    exactly (up to tokenization at the cut); without it, by ``words_per_token``.
    """

    def __init__(
        self,
        words: Sequence[str] | None = None,
        count_tokens: Callable[[str], int] | None = None,
        words_per_token: float = DEFAULT_WORDS_PER_TOKEN,
    ) -> None:
        if words is None:
            from infer.data.corpus import load_corpus

            words = " ".join(load_corpus(include_docstrings=False)).split()
        if len(words) < 64:
            raise ValueError("the text source needs at least 64 words")
        self.words = list(words)
        self.count_tokens = count_tokens
        self.words_per_token = words_per_token

    def passage(self, num_tokens: int, rng: random.Random) -> str:
        """About ``num_tokens`` tokens of running text starting at a random word."""
        want = max(1, math.ceil(num_tokens * self.words_per_token))
        start = rng.randrange(len(self.words))
        words = [self.words[(start + i) % len(self.words)] for i in range(max(want * 2, want + 8))]
        if self.count_tokens is None:
            return " ".join(words[:want])
        return self._fit(words, num_tokens)

    def _fit(self, words: list[str], num_tokens: int) -> str:
        """Text of ``num_tokens`` tokens: cut at the token when the counter can (``truncate``),
        else the longest word prefix whose token count is <= num_tokens (binary search)."""
        count = self.count_tokens
        assert count is not None
        while count(" ".join(words)) < num_tokens:  # not enough words for a dense tokenizer
            words = words + words
        truncate = getattr(count, "truncate", None)
        if truncate is not None:
            return truncate(" ".join(words), num_tokens)
        lo, hi = 1, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(" ".join(words[:mid])) <= num_tokens:
                lo = mid
            else:
                hi = mid - 1
        return " ".join(words[:lo])

    def estimate_tokens(self, text: str) -> int:
        """Tokens in ``text``: exact with a tokenizer, else estimated from the word count."""
        if self.count_tokens is not None:
            return self.count_tokens(text)
        return int(round(len(text.split()) / self.words_per_token))


class TokenCounter:
    """Counts tokens with a local Hugging Face tokenizer and cuts text at a token boundary."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    def __call__(self, text: str) -> int:
        return len(self.encode(text))

    def truncate(self, text: str, num_tokens: int) -> str:
        """The first ``num_tokens`` tokens of ``text`` as text (re-encodes to about that many)."""
        return self.tok.decode(self.encode(text)[:num_tokens]).strip()


class RemoteTokenCounter:
    """Counts and cuts with the server's own ``/tokenize`` and ``/detokenize`` (vLLM and infer
    serve both have them), for servers whose tokenizer is not on this machine."""

    def __init__(self, server: str, model: str, timeout_s: float = 60.0) -> None:
        import httpx

        self.root = server.rstrip("/").removesuffix("/v1")
        self.model = model
        self.client = httpx.Client(timeout=timeout_s)

    def encode(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        resp = self.client.post(f"{self.root}/tokenize", json=body)
        resp.raise_for_status()
        return list(resp.json()["tokens"])

    def __call__(self, text: str) -> int:
        return len(self.encode(text))

    def truncate(self, text: str, num_tokens: int) -> str:
        body = {"model": self.model, "tokens": self.encode(text)[:num_tokens]}
        resp = self.client.post(f"{self.root}/detokenize", json=body)
        resp.raise_for_status()
        return str(resp.json()["prompt"]).strip()

    @staticmethod
    def probe(server: str, model: str) -> RemoteTokenCounter | None:
        """A counter when the server tokenizes and detokenizes, else ``None``."""
        counter = RemoteTokenCounter(server, model)
        try:
            if counter("hello world") < 1 or not counter.truncate("hello world", 1):
                return None
        except Exception:  # noqa: BLE001 - no such routes, another shape, an error: not usable
            return None
        return counter


def tokenizer_counter(path: str) -> TokenCounter:
    """A token counter from a local Hugging Face tokenizer folder (no network)."""
    return TokenCounter(path)


# --------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload, fully determined by the spec and the seed."""

    index: int
    prompt: str
    prompt_len: int  # target tokens (shared prefix + own part); the server's usage is the truth
    max_tokens: int
    arrival_s: float  # send offset from the workload start (unused for sequential)
    clipped: bool = False  # shortened to fit the server's context window


@dataclass(frozen=True)
class Workload:
    """A spec with its concrete requests."""

    spec: WorkloadSpec
    requests: tuple[BenchRequest, ...]
    seed: int
    notes: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        return self.spec.name


def _draw_len(bands: Sequence[LengthBand], rng: random.Random) -> int:
    if len(bands) == 1:
        band = bands[0]
    else:
        band = rng.choices(list(bands), weights=[b.weight for b in bands])[0]
    return rng.randint(band.low, band.high)


def context_caps(spec: WorkloadSpec, max_model_len: int) -> tuple[int, int, int]:
    """``(max output, max shared prefix, safety margin)`` so that requests fit ``max_model_len``.

    The margin leaves room for a chat template or BOS token and for tokenization drift at the
    cut when lengths are only estimated.
    """
    margin = max(8, max_model_len // 20)
    high = spec.output_band.high
    out_cap = high if high < max_model_len // 2 else max(2, max_model_len // 4)
    prefix_cap = max(0, (max_model_len - out_cap - margin) * 3 // 4)
    return out_cap, prefix_cap, margin


def build_requests(
    spec: WorkloadSpec,
    seed: int = 42,
    source: TextSource | None = None,
    max_model_len: int | None = None,
) -> Workload:
    """Concrete requests for ``spec``: lengths, prompts and arrival times from ``seed``.

    The per-workload generator is seeded with ``(seed, spec.name)`` so that running one workload
    alone gives the same requests as running it inside ``all``. With ``max_model_len``, requests
    that would not fit are shortened (and marked ``clipped``): output first to a quarter of the
    context when it asks for half or more, then the shared prefix, then the prompt.
    """
    source = source or TextSource()
    rng = random.Random(f"{seed}:{spec.name}")
    n = spec.num_requests
    prompt_lens = [_draw_len(spec.prompt_bands, rng) for _ in range(n)]
    out_lens = [rng.randint(spec.output_band.low, spec.output_band.high) for _ in range(n)]
    arrivals = arrival_times(spec, rng)
    prefix_len = spec.shared_prefix_len
    out_cap = prefix_cap = margin = None
    if max_model_len is not None:
        out_cap, prefix_cap, margin = context_caps(spec, max_model_len)
        prefix_len = min(prefix_len, prefix_cap)
    text_rng = random.Random(f"{seed}:{spec.name}:text")
    prefix = source.passage(prefix_len, text_rng) if prefix_len else ""
    requests = []
    for i in range(n):
        own_len, out_len = prompt_lens[i], out_lens[i]
        clipped = prefix_len < spec.shared_prefix_len
        if max_model_len is not None:
            assert out_cap is not None and margin is not None
            if out_len > out_cap:
                out_len, clipped = out_cap, True
            room = max_model_len - out_len - margin - prefix_len
            if own_len > room:
                own_len, clipped = max(4, room), True
        own = source.passage(own_len, text_rng)
        prompt = f"{prefix}\n\n{own}" if prefix else own
        requests.append(
            BenchRequest(i, prompt, prefix_len + own_len, out_len, arrivals[i], clipped)
        )
    notes = []
    n_clipped = sum(r.clipped for r in requests)
    if n_clipped:
        notes.append(f"{n_clipped}/{n} requests shortened to fit max_model_len={max_model_len}")
    return Workload(spec, tuple(requests), seed, tuple(notes))

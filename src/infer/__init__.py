"""infer: an LLM inference serving engine you can read, measure and switch apart."""

from __future__ import annotations

from typing import TYPE_CHECKING

from infer.core.beam_search import BeamSearchParams
from infer.core.lora_request import LoRARequest
from infer.core.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from infer.llm import LLM

__all__ = ["LLM", "BeamSearchParams", "LoRARequest", "SamplingParams", "InvalidRequestError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; keep `import infer` light for the scheduler's unit tests.
    if name == "LLM":
        from infer.llm import LLM

        return LLM
    raise AttributeError(name)

"""What names an adapter: vLLM's ``LoRARequest``. No torch (the scheduler reads the name)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request: ``LLM.generate(..., lora_request=LoRARequest("sql", 1,
    "/adapters/sql"))``, as in vLLM.

    ``lora_name`` identifies the adapter everywhere (the server's ``model`` field, the prefix
    cache's keys, metrics); ``lora_path`` is a PEFT folder (``adapter_config.json`` +
    ``adapter_model.safetensors``); ``lora_int_id`` is kept for vLLM compatibility only.
    """

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")

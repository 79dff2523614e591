"""LoRA adapters over a shared base model (vLLM's ``--enable-lora``).

``request`` (no torch): :class:`LoRARequest`; ``adapter``: reading and checking PEFT folders;
``layers``: the batched low-rank update in the forward pass; ``manager``: registered adapters,
the host cache and the slots. docs/lora.md tells the whole story.
"""

from infer.lora.request import LoRARequest

__all__ = ["LoRARequest"]

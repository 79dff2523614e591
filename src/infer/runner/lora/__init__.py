"""LoRA adapters over a shared base model (vLLM's ``--enable-lora``; docs/lora.md).

``adapter``: reading and checking PEFT folders; ``layers``: the wrapped projections and the
batched low-rank update in the forward pass (csrc/lora.cpp on CPU); ``manager``: registered
adapters, the host cache and the slots. What names an adapter, :class:`LoRARequest`, is in
``core/lora_request.py`` (no torch: the scheduler reads it).
"""

"""The CPU backend's room: the C++ kernels and their bindings (``kernels.py``, ``csrc/``),
weights pre-packed for them (``prepack.py``), transparent huge pages (``hugepages.py``), the
mixture-of-experts layer's arguments (``moe_kernel.py``) and the fused decode step
(``decode_fast.py``: the CPU's replayable step, ``covers`` / ``forward``, the counterpart of
the GPU's CUDA graphs). The device backend: ``backend.py``'s ``CpuBackend``."""

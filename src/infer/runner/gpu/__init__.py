"""The CUDA backend's room: the device backend (``backend.py``), the Triton step
(``cuda_step.py``: persistent step buffers ``step.py``, CUDA graphs for decode ``graphs.py``),
Triton paged attention (``triton_attention.py``) and the fused element-wise kernels lent to the
model's layers (``triton_fused.py``, ``fused_ops.py``)."""

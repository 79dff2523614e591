"""The CUDA step: Triton paged attention, persistent step buffers, CUDA graphs for decode."""

"""Turning a step into tensors on a device: the device backends (backend.py), the runner, the
kernels. Importing the package lends the model's layers the devices' fused kernels."""

from infer.runner import fused_ops as _fused_ops

_fused_ops.register()

"""Attention backend names, read by config validation and the model runner (no torch import)."""

BACKENDS = ("sdpa", "flashinfer", "fa4", "triton")
GRAPH_BACKENDS = ("flashinfer", "fa4", "triton")  # their plan runs outside a captured forward
NO_FP32 = ("flashinfer", "fa4")  # no float32 kernels

"""Attention backend names, read by config validation and the model runner (no torch import)."""

BACKENDS = ("sdpa", "flashinfer", "fa4", "triton")
GRAPH_BACKENDS = ("flashinfer", "fa4", "triton")  # their plan runs outside a captured forward
NO_FP32 = ("flashinfer", "fa4")  # no float32 kernels
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # model.kv_cache_dtype (layers/kv_fp8.py)
FP8_KV_BACKENDS = ("sdpa", "triton")  # read e4m3 pages; FlashInfer's and FA4's FP8 paths are not wired

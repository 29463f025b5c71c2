"""FP8 (e4m3) KV pages: `model.kv_cache_dtype=fp8_e4m3` halves the bytes of a page, so twice the pages
fit in the same memory (llm_engine sizes the pool by `bytes_per_page` of the storage dtype).

Scales: one static k_scale and one v_scale per layer (per tensor), as vLLM's and SGLang's
`kv_cache_dtype=fp8_e4m3` without calibration. A write stores clamp(x / scale, -448, 448) cast to e4m3
(round to nearest even); a read gives (stored * scale) in fp32, rounded to the model dtype. The scales
default to 1.0, vLLM's default when a checkpoint carries none. vLLM also reads a checkpoint's per-layer
`k_scale` / `v_scale` (older: `kv_scale`) tensors; no LLaDA2 or SDAR checkpoint we load has them, and
their loaders refuse tensors they do not know, so `Fp8KVCache` takes scales as arguments and the engine
passes none until a loader reads them.

Why static: every K/V value is quantized alone with a constant, so a page holds the same bytes whatever
else ran in its forward: a request's tokens do not depend on its batch, and the prefix cache shares
pages as they are. Dynamic scales (a batch's amax, or vLLM's calculate_kv_scales from the first forward)
would make one request's K/V depend on what it was batched with, so they are not offered. A value past
448 * scale saturates: the QK-normed keys of LLaDA2 and SDAR stay far below it at scale 1.

Writes by a kernel that produces K/V itself (the fused QK-norm + RoPE, through `write_rows`) land in
model-dtype staging rows that `flush` quantizes into the pages before the layer's attention: one more
pass over this forward's K/V only (a quantizing store in that kernel is the faster lever, not taken).
Reads: the sdpa backend gathers a row's pages and dequantizes them (`gather`); the Triton kernel loads
e4m3 and dequantizes in registers (kernels/block_attention.py) with the same fp32 multiply and rounding,
so both attend over the same key and value numbers. FlashInfer and FA4 do not read this cache
(config validation refuses them with it).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from fluxlab.engine.layers.attention import KVCache

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # the largest finite e4m3fn value


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale clamped to the e4m3 range (a NaN stays NaN) and cast, rounding to nearest even."""
    return (x.float() / scale).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)  # not div_: x.float() is x for fp32


def dequantize_kv(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """stored * scale in fp32, rounded to `dtype` (the Triton kernel's dequantize, operation for operation)."""
    return (stored.float() * scale).to(dtype)


def _fp32_scales(scales: Optional[Sequence[float]], num_layers: int, name: str) -> list[float]:
    # Rounded to fp32 here, so the sdpa path (a Python float times an fp32 tensor) and the kernel (an
    # fp32 argument) multiply by the same number.
    values = [1.0] * num_layers if scales is None else [float(s) for s in scales]
    if len(values) != num_layers or not all(s > 0 and s != float("inf") for s in values):
        raise ValueError(f"{name}: need {num_layers} finite positive scales (one a layer), got {list(values)}")
    return torch.tensor(values, dtype=torch.float32).tolist()


class Fp8KVCache(KVCache):
    """KV pages stored as e4m3 with per-layer static scales; writes take and reads give `dtype`."""

    def __init__(self, num_layers: int, num_pages: int, block_length: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, k_scales: Optional[Sequence[float]] = None,
                 v_scales: Optional[Sequence[float]] = None):
        super().__init__(num_layers, num_pages, block_length, num_kv_heads, head_dim, dtype, device,
                         storage_dtype=FP8_KV_DTYPE)
        self.k_scales = _fp32_scales(k_scales, num_layers, "k_scales")
        self.v_scales = _fp32_scales(v_scales, num_layers, "v_scales")
        self._staged: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None  # (layer, K rows, V rows)

    def scales(self, layer_idx: int) -> tuple[float, float]:
        return self.k_scales[layer_idx], self.v_scales[layer_idx]

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_rows, v_rows = self.rows(layer_idx)
        k_scale, v_scale = self.scales(layer_idx)
        k_rows[slot_mapping] = quantize_kv(k, k_scale)
        v_rows[slot_mapping] = quantize_kv(v, v_scale)

    def gather(self, layer_idx: int, page_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # gather the e4m3 bytes first: only the row's pages are dequantized, not the pool
        k_scale, v_scale = self.scales(layer_idx)
        return (dequantize_kv(self.k[layer_idx][page_indices], k_scale, self.dtype),
                dequantize_kv(self.v[layer_idx][page_indices], v_scale, self.dtype))

    def write_rows(self, layer_idx: int, slot_mapping: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = slot_mapping.shape[0]
        k = torch.empty(tokens, *self.k.shape[3:], dtype=self.dtype, device=self.k.device)
        v = torch.empty_like(k)
        self._staged = (layer_idx, k, v)
        return k, v, torch.arange(tokens, device=slot_mapping.device)

    def flush(self, layer_idx: int, slot_mapping: torch.Tensor) -> None:
        if self._staged is None:  # the K/V came through `write`
            return
        staged_layer, k, v = self._staged
        self._staged = None
        if staged_layer != layer_idx:
            raise RuntimeError(f"layer {layer_idx} attends while layer {staged_layer}'s K/V wait to be written")
        self.write(layer_idx, slot_mapping, k, v)


def kv_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype KV pages are stored in for model.kv_cache_dtype (auto: the model's `dtype`)."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_KV_DTYPE
    raise ValueError(f"model.kv_cache_dtype={kv_cache_dtype!r}: use auto or fp8_e4m3")


def make_kv_cache(kv_cache_dtype: str, num_layers: int, num_pages: int, block_length: int, num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype, device: torch.device) -> KVCache:
    """The runner's pages for model.kv_cache_dtype (scales 1.0: see the module doc)."""
    args = (num_layers, num_pages, block_length, num_kv_heads, head_dim, dtype, device)
    if kv_storage_dtype(kv_cache_dtype, dtype) == dtype:
        return KVCache(*args)
    return Fp8KVCache(*args)

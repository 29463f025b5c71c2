"""Dense reference attention for Diffusion-Gemma's two passes (groundwork; a paged backend replaces it).

The model calls `attn.forward(layer_idx, q, k, v)` on flattened tokens and never sees masks or
caches. A batch is a list of `CanvasSegment`s, each one request's new tokens:
- encoder pass (`writes_kv=True`): prompt or committed canvas; causal over cached prefix + new
  tokens, writes their K/V;
- canvas pass (`writes_kv=False`): bidirectional over cached prefix + canvas; writes nothing.
Sliding layers see a window of `sliding_window` keys ending at the query in the encoder pass
(transformers' sliding causal mask), and the last `sliding_window - 1` cached tokens plus the whole
canvas in the canvas pass (what transformers' DynamicSlidingWindowLayer keeps).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DenseKV:
    """One request's cached K/V per layer, [num_cached, kv_heads, head_dim], positions 0..num_cached-1."""
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    def num_cached(self, layer_idx: int) -> int:
        return self.keys[layer_idx].shape[0] if layer_idx in self.keys else 0


@dataclass
class CanvasSegment:
    kv: DenseKV
    num_new: int
    writes_kv: bool  # True: encoder (causal, appends K/V); False: canvas (bidirectional, read-only)


class DenseCanvasAttention:
    def __init__(self, segments: list[CanvasSegment], layer_is_sliding: list[bool], sliding_window: int):
        self.segments = segments
        self.layer_is_sliding = layer_is_sliding
        self.sliding_window = sliding_window

    def visible(self, num_cached: int, num_new: int, causal: bool, sliding: bool, device) -> torch.Tensor:
        """[num_new, num_cached + num_new] bool: which keys each new token attends to."""
        q_pos = torch.arange(num_cached, num_cached + num_new, device=device)[:, None]
        k_pos = torch.arange(num_cached + num_new, device=device)[None, :]
        if causal:
            allowed = k_pos <= q_pos
            if sliding:
                allowed &= k_pos > q_pos - self.sliding_window
            return allowed
        allowed = torch.ones(num_new, num_cached + num_new, dtype=torch.bool, device=device)
        if sliding:
            allowed &= (k_pos >= num_cached - (self.sliding_window - 1)) | (k_pos >= num_cached)
        return allowed

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for seg in self.segments:
            end = start + seg.num_new
            cached = seg.kv.num_cached(layer_idx)
            keys, values = k[start:end], v[start:end]
            if cached:
                keys = torch.cat([seg.kv.keys[layer_idx], keys])
                values = torch.cat([seg.kv.values[layer_idx], values])
            if seg.writes_kv:
                seg.kv.keys[layer_idx], seg.kv.values[layer_idx] = keys, values
            mask = self.visible(cached, seg.num_new, seg.writes_kv, self.layer_is_sliding[layer_idx], q.device)
            out.append(_sdpa(q[start:end], keys, values, mask))
            start = end
        return torch.cat(out)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [n, H, D], k/v [m, Hkv, D] -> [n, H, D]; softmax scale 1 (q/k are RMS-normed per head)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=1.0)
    return o.transpose(0, 1)

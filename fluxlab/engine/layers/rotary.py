import torch
from torch import nn


class PartialRotary(nn.Module):
    """Rotate-half RoPE on the first `rotary_dim` dims of each head; the rest pass through.

    For LLaDA2 (head_dim 128, partial_rotary_factor 0.5) dims i and i+32 of the first 64 are paired,
    inv_freq spans the 64 rotary dims, positions are absolute. cos/sin are computed in fp32 and cast
    to the activation dtype before use, as the published code does.
    """

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, max_positions: int = 32768):
        super().__init__()
        assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache_len = 0
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self._build(max_positions)

    def _build(self, length: int):
        pos = torch.arange(length, dtype=torch.float32, device=self.inv_freq.device)
        freqs = pos[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache = emb.cos()
        self.sin_cache = emb.sin()
        self._cache_len = length

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """[T, rotary_dim] cos and sin for absolute positions (< max_positions; no host sync, so
        it is safe inside CUDA graphs)."""
        return self.cos_cache[positions].to(dtype), self.sin_cache[positions].to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hk, D], positions [T] -> rotated (q, k), same dtype."""
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)

"""Dense block-causal attention over whole sequences (no cache): the reference backend.

The batch is the concatenation of sequences, each starting at position 0. Inside a sequence,
query i sees key j iff j // block_length <= i // block_length: bidirectional within a block
aligned to position 0, causal across blocks (the mask of the published `generate()`).
"""
import torch
import torch.nn.functional as F


def block_causal_mask(length: int, block_length: int, device=None) -> torch.Tensor:
    block = torch.arange(length, device=device) // block_length
    return block[None, :] <= block[:, None]  # [q, k] bool, True = may attend


class DenseBlockCausalAttention:
    def __init__(self, seq_lens: list[int], block_length: int):
        self.seq_lens = [int(n) for n in seq_lens]
        self.block_length = int(block_length)
        self._masks: dict = {}

    def _mask(self, length: int, device) -> torch.Tensor:
        key = (length, str(device))
        if key not in self._masks:
            self._masks[key] = block_causal_mask(length, self.block_length, device)
        return self._masks[key]

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D]; scale D**-0.5, GQA by repeating K/V."""
        assert q.shape[0] == sum(self.seq_lens), "attention metadata does not match the batch"
        groups = q.shape[1] // k.shape[1]
        scale = q.shape[-1] ** -0.5
        outs, start = [], 0
        for n in self.seq_lens:
            qs = q[start:start + n].transpose(0, 1)
            ks = k[start:start + n].repeat_interleave(groups, dim=1).transpose(0, 1)
            vs = v[start:start + n].repeat_interleave(groups, dim=1).transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=self._mask(n, q.device), scale=scale)
            outs.append(o.transpose(0, 1))
            start += n
        return torch.cat(outs, dim=0)

    __call__ = forward

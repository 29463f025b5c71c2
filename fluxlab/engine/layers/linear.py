"""Bias-free linear layers, the vocab-parallel embedding/head, and the process's parallel layout.

Every layer holds its local shard ([out/tp, in] for column, [out, in/tp] for row parallel). The
loader (engine/loader.py) reads exactly that shard from the checkpoint. RowParallelLinear
all-reduces its partial output over the TP ranks (the default process group: NCCL on GPU, gloo on
CPU). Like nano-vllm's `dist.get_rank()` in its layers, the layout is process-wide state: a TP
worker sets it once (`set_parallel_dims`) before building its model shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ParallelDims:
    tp_rank: int = 0  # the rank in the group (under data-parallel attention: in the expert group)
    tp_size: int = 1
    ep_size: int = 1  # 1 (experts split on their width) or tp_size (experts split across ranks)
    # parallel.enable_dp_attention: each rank runs attention, dense layers, embedding and head whole on
    # its own requests; only the routed experts are split (over all tp_size ranks).
    dp_attention: bool = False

    @property
    def ep_rank(self) -> int:
        return self.tp_rank if self.ep_size > 1 else 0

    @property
    def dense(self) -> "ParallelDims":
        """The layout of everything but the routed experts: whole on each rank under DP attention."""
        return ParallelDims() if self.dp_attention else self


_DIMS = ParallelDims()


def set_parallel_dims(dims: ParallelDims) -> None:
    global _DIMS
    _DIMS = dims


def get_parallel_dims() -> ParallelDims:
    return _DIMS


def all_reduce(t: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        dist.all_reduce(t)
    return t


def all_gather_last_dim(t: torch.Tensor, tp_size: int) -> torch.Tensor:
    """[T, n] on each rank -> [T, tp*n], ranks in order along the last dim."""
    if tp_size == 1:
        return t
    t = t.contiguous()
    if t.is_cuda:
        out = torch.empty((tp_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t)
        parts = out.view(tp_size, *t.shape)
        return parts.permute(1, 0, 2).reshape(t.shape[0], tp_size * t.shape[1])
    parts = [torch.empty_like(t) for _ in range(tp_size)]
    dist.all_gather(parts, t)
    return torch.cat(parts, dim=-1)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, tp_size: int = 1, tp_rank: int = 0,
                 tp_dim: int | None = None, dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp_size, self.tp_rank, self.tp_dim = tp_size, tp_rank, tp_dim
        shape = [out_features, in_features]
        if tp_dim is not None:
            assert shape[tp_dim] % tp_size == 0, f"dim {shape[tp_dim]} not divisible by tp_size {tp_size}"
            shape[tp_dim] //= tp_size
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class StackedRows:
    """Weights that multiply one input, [n_i, in] each, held back to back in one [sum n_i, in] tensor
    that every weight's parameter is a view of: loading or updating a weight in place updates the
    stack, and one GEMM on the stack does the weights' GEMMs in one launch. `current()` is False once
    a parameter no longer views it (`module.to(...)` gives each parameter its own storage): callers
    then multiply the weights one by one."""

    def __init__(self, *params: nn.Parameter):
        assert len({(p.shape[1], p.dtype, p.device) for p in params}) == 1, [(p.shape, p.dtype) for p in params]
        self.weight = torch.cat([p.data for p in params])
        self.sizes = [p.shape[0] for p in params]
        self.params = params
        row = 0
        for p, n in zip(params, self.sizes):
            p.data = self.weight[row:row + n]
            row += n
        self._ptrs = self._current_ptrs()

    def _current_ptrs(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.params)

    def current(self) -> bool:
        return self._current_ptrs() == self._ptrs


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features, out_features, **kw):
        super().__init__(in_features, out_features, tp_dim=None, **kw)


class ColumnParallelLinear(LinearBase):
    """Output features split across TP ranks; output stays sharded."""

    def __init__(self, in_features, out_features, **kw):
        super().__init__(in_features, out_features, tp_dim=0, **kw)


class RowParallelLinear(LinearBase):
    """Input features split across TP ranks; partial outputs are summed across ranks unless
    `reduce=False` (the caller folds the partial into a larger all-reduce)."""

    def __init__(self, in_features, out_features, reduce: bool = True, **kw):
        super().__init__(in_features, out_features, tp_dim=1, **kw)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return all_reduce(y, self.tp_size) if self.reduce else y


def kv_head_layout(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(local kv heads, first global kv head): split when tp <= kv heads, else replicated so each
    rank keeps the one kv head its query heads read."""
    if tp_size <= num_kv_heads:
        assert num_kv_heads % tp_size == 0, (num_kv_heads, tp_size)
        local = num_kv_heads // tp_size
        return local, tp_rank * local
    assert tp_size % num_kv_heads == 0, (num_kv_heads, tp_size)
    return 1, tp_rank * num_kv_heads // tp_size


class QKVParallelLinear(LinearBase):
    """Fused Q|K|V projection (checkpoint rows ordered Q, K, V). Each rank holds the rows of its
    own query heads, then its kv heads' K rows, then their V rows (see `row_blocks`)."""

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, tp_size: int = 1, tp_rank: int = 0, **kw):
        assert num_heads % tp_size == 0, (num_heads, tp_size)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_local_heads = num_heads // tp_size
        self.num_local_kv_heads, self.first_kv_head = kv_head_layout(num_heads, num_kv_heads, tp_size, tp_rank)
        nn.Module.__init__(self)
        self.in_features, self.out_features = hidden_size, (num_heads + 2 * num_kv_heads) * head_dim
        self.tp_size, self.tp_rank, self.tp_dim = tp_size, tp_rank, None
        rows = (self.num_local_heads + 2 * self.num_local_kv_heads) * head_dim
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, **kw), requires_grad=False)

    def row_blocks(self) -> list[tuple[int, int, int]]:
        """(local first row, checkpoint first row, rows) of the Q, K and V pieces of this shard."""
        d, nq, nkv = self.head_dim, self.num_local_heads, self.num_local_kv_heads
        q0 = self.tp_rank * nq * d
        k0 = self.num_heads * d + self.first_kv_head * d
        v0 = (self.num_heads + self.num_kv_heads) * d + self.first_kv_head * d
        return [(0, q0, nq * d), (nq * d, k0, nkv * d), ((nq + nkv) * d, v0, nkv * d)]


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * n, (rank + 1) * n) of the (padded) vocabulary; ids outside the shard look up
    zeros and the all-reduce adds the one rank that holds each id."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_size: int = 1, tp_rank: int = 0, dtype=None, device=None):
        super().__init__()
        self.vocab_size, self.tp_size = vocab_size, tp_size
        self.shard_rows = -(-vocab_size // tp_size)
        self.first_row = tp_rank * self.shard_rows
        self.weight = nn.Parameter(torch.zeros(self.shard_rows, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first_row
        inside = (local >= 0) & (local < self.shard_rows)
        x = F.embedding(torch.where(inside, local, 0), self.weight) * inside[:, None].to(self.weight.dtype)
        return all_reduce(x, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """lm_head split on the vocabulary. `logits` all-gathers them so every rank holds all of them
    (sampling and decoders that read whole rows); `greedy_stats` moves only per-shard
    (max, log-sum-exp, argmax) to rank 0: 12 bytes a position instead of 4 * vocab / tp."""

    def logits(self, h: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """fp32=False keeps the model dtype (the one-pass greedy kernel upcasts as it reads)."""
        local = F.linear(h, self.weight)
        local = local.float() if fp32 else local
        if self.tp_size == 1:
            return local
        return all_gather_last_dim(local, self.tp_size)[:, :self.vocab_size]

    def greedy_stats(self, h: torch.Tensor, fp32: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(argmax [N], its probability [N] fp32) on rank 0, None on the other ranks; the same
        token as greedy_stats over `logits` (lowest index on ties), probability within rounding."""
        from fluxlab.kernels.vocab_stats import combine_shard_stats, greedy_stats, shard_stats

        if self.tp_size == 1:
            return greedy_stats(self.logits(h, fp32))
        local = F.linear(h, self.weight)
        local = local.float() if fp32 else local
        real = self.vocab_size - self.first_row  # the last shard's padding rows are no token
        if real < self.shard_rows:
            local[:, max(real, 0):] = float("-inf")
        stats = shard_stats(local)
        rank = dist.get_rank()
        parts = [torch.empty_like(stats) for _ in range(self.tp_size)] if rank == 0 else None
        dist.gather(stats, parts, dst=0)
        return combine_shard_stats(torch.stack(parts), self.shard_rows) if rank == 0 else None

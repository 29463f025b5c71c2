"""Bias-free linear layers written so tensor parallelism can be added without touching the model.

Every layer holds its local shard ([out/tp, in] for column, [out, in/tp] for row parallel) and a
`weight_loader(param, full_tensor, shard_id=None)` that narrows a full checkpoint tensor to the
shard. With tp_size == 1 (all that is wired today) the shard is the whole tensor and no collective
runs. RowParallelLinear all-reduces its output when tp_size > 1 and a process group is up.
"""
import torch
import torch.nn.functional as F
from torch import nn


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
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        if self.tp_dim is not None and self.tp_size > 1:
            size = param.shape[self.tp_dim]
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features, out_features, **kw):
        super().__init__(in_features, out_features, tp_dim=None, **kw)


class ColumnParallelLinear(LinearBase):
    """Output features split across TP ranks; output stays sharded."""

    def __init__(self, in_features, out_features, **kw):
        super().__init__(in_features, out_features, tp_dim=0, **kw)


class RowParallelLinear(LinearBase):
    """Input features split across TP ranks; partial outputs are summed across ranks."""

    def __init__(self, in_features, out_features, **kw):
        super().__init__(in_features, out_features, tp_dim=1, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(y)
        return y


class QKVParallelLinear(ReplicatedLinear):
    """Fused Q|K|V projection (checkpoint rows ordered Q, K, V).

    Under TP each rank will take its own heads of Q, K and V (KV heads replicate when tp > kv
    heads), so the shard is not one contiguous narrow; only tp_size 1 is wired today.
    """

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, tp_size: int = 1, **kw):
        if tp_size != 1:
            raise NotImplementedError("QKVParallelLinear: tensor parallel sharding of fused QKV is not wired yet")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, **kw)

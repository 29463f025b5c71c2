"""LLaDA2 MoE: sigmoid router with expert bias and group-limited top-k, stacked experts.

Per-token definition (the published `LLaDA2MoeGate` + `moe_infer`):
  scores = sigmoid(x @ gate.T) in fp32; experts are *chosen* on scores + expert_bias (group score =
  sum of the top-2 biased scores of each of n_group groups, keep topk_group groups, top_k experts
  among them); the *weights* are the unbiased scores of the chosen experts, divided by their sum
  (+1e-20) and times routed_scaling_factor. Each expert is a SwiGLU run in the model dtype; the
  weighted sum over the top_k outputs is taken in fp32 and cast back to the model dtype.

LLaDA2.2 block routing (DESIGN §4b, selected by expert_capacity > 0): the flat tokens are cut into
routing blocks of routing_block_size consecutive tokens; each block keeps a pool of the
expert_capacity experts with the largest max over its tokens of scores + expert_bias, and each token
takes its top_k (biased) experts inside its block's pool. Grouped top-k is not used. The caller
guarantees that every routing block is one request's tokens at aligned positions
(`check_routing_blocks` checks a batch's positions on the host).
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fluxlab.engine.layers.norm import use_fused


def route(x: torch.Tensor, gate_weight: torch.Tensor, expert_bias: torch.Tensor | None, *, top_k: int,
          n_group: int, topk_group: int, routed_scaling_factor: float, expert_capacity: int = 0,
          routing_block_size: int = 0):
    """x [T, H] -> (topk_idx [T, top_k] int64, topk_weight [T, top_k] fp32)."""
    return route_logits(router_logits(x, gate_weight), expert_bias, top_k=top_k, n_group=n_group,
                        topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
                        expert_capacity=expert_capacity, routing_block_size=routing_block_size, fused=use_fused(x))


def route_logits(logits: torch.Tensor, expert_bias: torch.Tensor | None, *, top_k: int, n_group: int,
                 topk_group: int, routed_scaling_factor: float, expert_capacity: int = 0,
                 routing_block_size: int = 0, fused: bool = False, shared_id: int | None = None):
    """`route` after its GEMM: fp32 logits [T, E] (rows may be strided) -> (topk_idx, topk_weight).
    fused: the Triton top-k (the model's hidden states take the fused kernels, `use_fused`).
    shared_id: one more column, every token's slot of that expert with weight 1 (a shared expert
    stacked under the routed ones, engine/layers/quantization.py `fuse_shared_experts_`)."""
    if fused and expert_capacity <= 0:  # one Triton launch for everything after the GEMM (ties: lowest index first)
        from fluxlab.kernels.route_topk import route_topk_from_logits

        return route_topk_from_logits(logits, expert_bias, top_k, n_group, topk_group, routed_scaling_factor,
                                      shared_id=shared_id)
    idx, weight = _route_unfused(logits, expert_bias, top_k, n_group, topk_group, routed_scaling_factor,
                                 expert_capacity, routing_block_size)
    if shared_id is None:
        return idx, weight
    return F.pad(idx, (0, 1), value=shared_id), F.pad(weight.float(), (0, 1), value=1.0)


def _route_unfused(logits, expert_bias, top_k, n_group, topk_group, routed_scaling_factor, expert_capacity,
                   routing_block_size):
    if expert_capacity > 0:
        return _block_route(logits, expert_bias, top_k, expert_capacity, routing_block_size, routed_scaling_factor)
    scores = torch.sigmoid(logits)
    choice = scores + expert_bias.float() if expert_bias is not None else scores
    num_tokens, num_experts = choice.shape
    if n_group > 1:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    topk_idx = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    if top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_idx, weights * routed_scaling_factor


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ gate_weight.T in fp32 ([T, E] fp32).

    bf16/fp16 on CUDA: one GEMM on the model-dtype operands with an fp32 output. A product of two
    bf16 (or fp16) numbers is exact in fp32 and the tensor cores accumulate in fp32, so this is the
    fp32 GEMM of the upcast operands up to accumulation rounding (H200: 2.1e-6 relative to fp64,
    against 1.7e-7 for the fp32 GEMM; the same top-8 on 2048 random tokens), without a cast pass
    over the hidden states and the weight and at the bf16 tensor-core rate (the fp32 GEMM was ~5%
    of a batch-64 decode forward). Elsewhere (CPU, fp32 parity runs) the fp32 GEMM itself."""
    if (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and gate_weight.dtype == x.dtype
            and mm_fp32_out_works(x.device)):
        return torch.mm(x, gate_weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), gate_weight.float())


_MM_FP32_OUT: dict = {}


def mm_fp32_out_works(device: torch.device) -> bool:
    """Whether torch.mm(..., out_dtype=float32) runs for model-dtype operands on this device (torch
    >= 2.9 on CUDA); probed once per device, on the first eager forward (never inside a capture)."""
    key = str(device)
    if key not in _MM_FP32_OUT:
        try:
            a = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
            _MM_FP32_OUT[key] = bool(torch.mm(a, a.t(), out_dtype=torch.float32).eq(8).all())
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_FP32_OUT[key] = False
    return _MM_FP32_OUT[key]


def _block_route(logits: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, capacity: int,
                 block_size: int, routed_scaling_factor: float):
    """Block routing after the router GEMM (sync-free, so CUDA-graph capturable)."""
    num_tokens, num_experts = logits.shape
    if block_size < 1 or num_tokens % block_size:
        raise ValueError(f"block routing: {num_tokens} tokens are not whole routing blocks of {block_size}")
    scores = torch.sigmoid(logits)
    choice = scores + expert_bias.float() if expert_bias is not None else scores
    blocks = choice.view(num_tokens // block_size, block_size, num_experts)
    pool = blocks.amax(dim=1).topk(capacity, dim=-1).indices  # [blocks, capacity]
    in_pool = torch.zeros(blocks.shape[0], num_experts, dtype=torch.bool, device=logits.device)
    in_pool.scatter_(1, pool, True)
    choice = blocks.masked_fill(~in_pool[:, None, :], float("-inf")).view(num_tokens, num_experts)
    topk_idx = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    if top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_idx, weights * routed_scaling_factor


def check_routing_blocks(positions, block_size: int, row_starts=None) -> None:
    """Host-side check that a forward's flat tokens are whole, aligned routing blocks.

    positions: the flat [T] absolute positions (numpy or a list); every group of block_size
    consecutive tokens must sit at p0, p0+1, ..., p0+block_size-1 with p0 % block_size == 0.
    row_starts: optional flat offsets where each row (request) begins; each must be a multiple of
    block_size, so no routing block spans two rows even where positions alone cannot tell (a row
    ending at position 47 followed by a row starting at 48). Raises ValueError naming the block.
    """
    if block_size <= 0:
        return
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if pos.size % block_size:
        raise ValueError(f"block routing: {pos.size} tokens are not whole routing blocks of {block_size}")
    groups = pos.reshape(-1, block_size)
    aligned = (groups[:, 0] % block_size == 0) & (groups == groups[:, :1] + np.arange(block_size)).all(axis=1)
    if not aligned.all():
        bad = int(np.flatnonzero(~aligned)[0])
        raise ValueError(f"block routing: tokens {bad * block_size}..{(bad + 1) * block_size - 1} of the forward "
                         f"hold positions {groups[bad].tolist()}, not one aligned routing block of {block_size} "
                         "(rows must be whole blocks of one request at positions aligned to 0)")
    if row_starts is not None:
        starts = np.asarray(row_starts, dtype=np.int64).reshape(-1)
        off = starts % block_size != 0
        if off.any():
            raise ValueError(f"block routing: a row starts at flat token {int(starts[off][0])}, inside a routing "
                             f"block of {block_size} (two requests would share one routing block)")


def _expert(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: w_gate_up [2I, H] (gate rows then up rows), w_down [H, I]."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def moe_reference(x, topk_idx, topk_weight, w_gate_up, w_down) -> torch.Tensor:
    """Plain per-expert loop, the definition the vectorised path must match (used by tests)."""
    num_tokens, top_k = topk_idx.shape
    out = torch.zeros(num_tokens, top_k, x.shape[-1], dtype=x.dtype, device=x.device)
    for e in range(w_gate_up.shape[0]):
        tok, slot = (topk_idx == e).nonzero(as_tuple=True)
        if tok.numel():
            out[tok, slot] = _expert(x[tok], w_gate_up[e], w_down[e])
    return (out.float() * topk_weight[..., None].float()).sum(dim=1).to(x.dtype)


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def moe_forward(x, topk_idx, topk_weight, w_gate_up, w_down, use_grouped_mm: bool | None = None) -> torch.Tensor:
    """Vectorised MoE: sort (token, slot) pairs by expert, run experts on contiguous runs, scatter
    back to [T, top_k, H] and combine in fp32 in the same order as `moe_reference`.

    On CUDA bf16 with `torch._grouped_mm` the expert GEMMs are two grouped GEMMs; otherwise a loop
    over only the experts that received tokens (CPU fallback).
    """
    num_tokens, top_k = topk_idx.shape
    num_experts = w_gate_up.shape[0]
    flat = topk_idx.reshape(-1)
    order = flat.argsort(stable=True)
    sorted_x = x[order // top_k]
    counts = torch.bincount(flat, minlength=num_experts)
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_ok(x)
    if use_grouped_mm:
        offs = counts.cumsum(0).to(torch.int32)
        gate_up = torch._grouped_mm(sorted_x, w_gate_up.transpose(1, 2), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        sorted_out = torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offs)
    else:
        sorted_out = torch.empty_like(sorted_x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                sorted_out[start:start + n] = _expert(sorted_x[start:start + n], w_gate_up[e], w_down[e])
                start += n
    out = torch.empty_like(sorted_out)
    out[order] = sorted_out
    out = out.view(num_tokens, top_k, -1)
    return (out.float() * topk_weight[..., None].float()).sum(dim=1).to(x.dtype)


def local_routing(topk_idx: torch.Tensor, topk_weight: torch.Tensor, first_expert: int, num_local: int):
    """Expert parallelism: this rank's view of the global routing. Slots routed elsewhere get the
    sentinel index `num_local` and weight 0 (their contribution comes from another rank)."""
    local = topk_idx - first_expert
    mine = (local >= 0) & (local < num_local)
    return torch.where(mine, local, num_local), torch.where(mine, topk_weight.float(), 0.0), mine


def partial_moe(x, local_idx, weight, mine, w_gate_up, w_down) -> torch.Tensor:
    """Sum over a rank's slots in fp32 ([T, H] fp32, not cast: the caller all-reduces it).

    Sync-free (CUDA-graph capturable): slots are sorted by local expert with the sentinel slots
    last; the grouped GEMMs cover the local experts' rows only (offs), and the rows past the last
    offset, whatever they hold, are dropped by `where` before the weighted sum. CPU: a loop over
    the local experts."""
    num_tokens, top_k = local_idx.shape
    num_local = w_gate_up.shape[0]
    flat = local_idx.reshape(-1)
    n = flat.numel()
    order = torch.argsort(flat, stable=True)
    sorted_x = x.index_select(0, order // top_k)
    if _grouped_mm_ok(x):
        counts = torch.zeros(num_local + 1, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones(n, dtype=torch.int32, device=x.device))
        offs = torch.cumsum(counts[:num_local], 0, dtype=torch.int32)
        gate_up = torch._grouped_mm(sorted_x, w_gate_up.transpose(1, 2), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        sorted_out = torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offs)
    else:
        sorted_out = torch.zeros_like(sorted_x)
        counts = torch.bincount(flat, minlength=num_local + 1)[:num_local].tolist()
        start = 0
        for e, count in enumerate(counts):
            if count:
                sorted_out[start:start + count] = _expert(sorted_x[start:start + count], w_gate_up[e], w_down[e])
                start += count
    inv = torch.empty_like(order)
    inv.scatter_(0, order, torch.arange(n, device=x.device, dtype=order.dtype))
    out = sorted_out.index_select(0, inv).view(num_tokens, top_k, -1)
    out = torch.where(mine[..., None], out.float(), 0.0)
    return (out * weight[..., None]).sum(dim=1)


class StackedExperts(nn.Module):
    """All routed experts of one layer (of this rank) as two stacked parameters, ready for grouped
    GEMMs: w_gate_up [E, 2*I, H] (rows: gate_proj then up_proj) and w_down [E, H, I].

    Under expert parallelism (ep_size > 1) a rank holds experts [ep_rank*E/ep, (ep_rank+1)*E/ep);
    under tensor parallelism with ep_size == 1 it holds every expert's intermediate slice I/tp.
    Either way `forward` then returns this rank's fp32 partial sum, to be all-reduced by the caller.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype=None, device=None,
                 tp_size: int = 1, ep_size: int = 1, ep_rank: int = 0):
        super().__init__()
        assert num_experts % ep_size == 0 and intermediate_size % (tp_size if ep_size == 1 else 1) == 0
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.first_expert = ep_rank * self.num_local_experts
        self.intermediate_size = intermediate_size // tp_size if ep_size == 1 else intermediate_size
        self.partial = tp_size > 1
        self.ep_size = ep_size
        self.w_gate_up = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.intermediate_size, hidden_size,
                                                  dtype=dtype, device=device), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.intermediate_size,
                                               dtype=dtype, device=device), requires_grad=False)

    backend = "auto"  # engine.moe_backend: grouped_mm | triton | torch | loop (the engine resolves auto)

    def forward(self, x, topk_idx, topk_weight, adds: tuple = ()):
        """adds (one GPU only): tensors added to the result in order, as `(y + adds[0]) + adds[1]`
        (the shared expert, the residual); the Triton kernel adds them in its combine pass."""
        if not self.partial:
            if x.is_cuda and self.backend == "triton":  # sync-free (CUDA-graph capturable)
                from fluxlab.kernels.fused_moe import fused_moe

                return fused_moe(x, topk_idx, topk_weight, self.w_gate_up, self.w_down, adds=adds)
            if self.backend == "loop":  # the published modeling code's per-expert loop (baseline timings)
                y = moe_reference(x, topk_idx, topk_weight, self.w_gate_up, self.w_down)
            elif x.is_cuda and self.backend != "torch":
                from fluxlab.kernels.fused_moe import grouped_mm_moe  # sync-free too

                y = grouped_mm_moe(x, topk_idx, topk_weight, self.w_gate_up, self.w_down)
            else:
                y = moe_forward(x, topk_idx, topk_weight, self.w_gate_up, self.w_down)
            for a in adds:
                y = y + a
            return y
        assert not adds, "expert-parallel partial sums are all-reduced before any add"
        if self.ep_size > 1:
            local_idx, weight, mine = local_routing(topk_idx, topk_weight, self.first_expert, self.num_local_experts)
        else:
            local_idx, weight, mine = topk_idx, topk_weight.float(), torch.ones_like(topk_idx, dtype=torch.bool)
        if x.is_cuda and self.backend != "torch" and (self.backend == "triton" or not _grouped_mm_ok(x)):
            from fluxlab.kernels.fused_moe import fused_moe

            # Slots routed to other ranks get id num_local_experts: the kernel skips them entirely.
            foreign = torch.where(mine, local_idx, self.num_local_experts)
            return fused_moe(x, foreign, weight, self.w_gate_up, self.w_down, foreign_slots=True).float()
        return partial_moe(x, local_idx, weight, mine, self.w_gate_up, self.w_down)


class MoEGate(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, *, top_k: int, n_group: int, topk_group: int,
                 routed_scaling_factor: float, expert_capacity: int = 0, routing_block_size: int = 0,
                 dtype=None, device=None):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.expert_capacity, self.routing_block_size = expert_capacity, routing_block_size
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        # Kept in fp32: it only shifts the choice, and bf16 checkpoint values are exact in fp32.
        self.expert_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device),
                                        requires_grad=False)

    def forward(self, x, shared_id: int | None = None):
        return self.route(router_logits(x, self.weight), fused=use_fused(x), shared_id=shared_id)

    def route(self, logits: torch.Tensor, fused: bool, shared_id: int | None = None):
        """fp32 router logits [T, E] -> (topk_idx, topk_weight); fused and shared_id as `route_logits`."""
        return route_logits(logits, self.expert_bias, top_k=self.top_k, n_group=self.n_group,
                            topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
                            expert_capacity=self.expert_capacity, routing_block_size=self.routing_block_size,
                            fused=fused, shared_id=shared_id)

"""LLaDA2-MoE (`model_type: llada2_moe`, BailingMoeV2 run without a causal mask), written for the engine.

The model sees flattened tokens of a whole batch, their absolute positions, and an attention
backend `attn` with `attn.forward(layer_idx, q, k, v)` (a paged backend also offers `kv_rows` +
`attend`: the fused QK-norm + RoPE writes K/V to the slot rows it is handed). It never sees
requests or masks, and of the cache only those rows.
Module names mirror the checkpoint (minus the leading `model.`), except routed experts, which are
stacked per layer (see layers/moe.py and engine/loader.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fluxlab.engine.layers.attention import PagedBackend
from fluxlab.engine.layers.linear import (ColumnParallelLinear, ParallelDims, ParallelLMHead, QKVParallelLinear,
                                          RowParallelLinear, StackedRows, VocabParallelEmbedding, all_reduce,
                                          get_parallel_dims)
from fluxlab.engine.layers.moe import MoEGate, StackedExperts, mm_fp32_out_works, router_logits
from fluxlab.engine.layers.moe_dispatch import DispatchSizes, combine_tokens, dispatch_tokens
from fluxlab.engine.layers.norm import RMSNorm, rms_norm, use_fused
from fluxlab.engine.layers.rotary import PartialRotary, apply_partial_rotary
from fluxlab.models.config_json import ConfigJson


@dataclass
class LLaDA2MoeConfig(ConfigJson):
    vocab_size: int = 157184
    hidden_size: int = 2048
    intermediate_size: int = 5120
    moe_intermediate_size: int = 512
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int | None = 128
    num_experts: int = 256
    num_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 1
    rope_theta: float = 600000.0
    partial_rotary_factor: float = 0.5
    rms_norm_eps: float = 1e-6
    use_qk_norm: bool = True
    max_position_embeddings: int = 32768
    pad_token_id: int = 156892
    hidden_act: str = "silu"
    norm_topk_prob: bool = True
    score_function: str = "sigmoid"
    tie_word_embeddings: bool = False
    use_qkv_bias: bool = False
    use_bias: bool = False
    model_type: str = "llada2_moe"
    # LLaDA2.2 block routing (DESIGN §4b): expert_capacity > 0 selects it; each routing block of
    # block_size tokens of one request picks a pool of expert_capacity experts.
    expert_capacity: int = 0
    block_size: int | None = None
    delete_token_id: int | None = None  # LLaDA2.2 edit tokens (levenshtein_joint)
    split_token_id: int | None = None
    extra: dict = field(default_factory=dict, repr=False)  # unknown config.json keys, kept verbatim

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts and self.num_experts % self.n_group:
            raise ValueError("num_experts must be a multiple of n_group")
        if self.topk_group > self.n_group:
            raise ValueError("topk_group must be <= n_group")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} unsupported (only silu)")
        if self.score_function != "sigmoid":
            raise ValueError(f"score_function {self.score_function!r} unsupported (only sigmoid)")
        if self.use_qkv_bias or self.use_bias:
            raise ValueError("biased projections are not supported (LLaDA2 has none)")
        if self.tie_word_embeddings:
            raise ValueError("tied embeddings are not supported (LLaDA2 has an untied lm_head)")
        if self.expert_capacity:
            if not self.num_experts_per_tok <= self.expert_capacity <= self.num_experts:
                raise ValueError(f"expert_capacity={self.expert_capacity} must be in [num_experts_per_tok="
                                 f"{self.num_experts_per_tok}, num_experts={self.num_experts}]")
            if not self.block_size or self.block_size < 1:
                raise ValueError(f"expert_capacity={self.expert_capacity} needs a routing block_size >= 1 "
                                 f"(got {self.block_size})")

    @property
    def routing_block_size(self) -> int:
        """Tokens per routing block when block routing is on, else 0 (per-token routing)."""
        return int(self.block_size) if self.expert_capacity > 0 else 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.num_experts) and i >= self.first_k_dense_replace


def check_block_length(c: LLaDA2MoeConfig, block_length: int) -> None:
    """Block routing needs every forward row to be whole routing blocks (DESIGN §4b)."""
    if c.routing_block_size and block_length % c.routing_block_size:
        raise ValueError(f"decoding.block_length={block_length} must be a multiple of the model's routing "
                         f"block_size={c.routing_block_size} (config.json, expert_capacity={c.expert_capacity})")


def check_parallel(c: LLaDA2MoeConfig, tp_size: int, ep_size: int) -> None:
    """The model-specific parallel rules; the messages name the config keys and the model's numbers."""
    if c.num_attention_heads % tp_size:
        raise ValueError(f"parallel.tp_size={tp_size} must divide the model's num_attention_heads="
                         f"{c.num_attention_heads}")
    kv = c.num_key_value_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"parallel.tp_size={tp_size} must divide or be a multiple of the model's "
                         f"num_key_value_heads={kv}")
    if c.num_experts and c.num_experts % ep_size:
        raise ValueError(f"parallel.ep_size={ep_size} must divide the model's num_experts={c.num_experts}")
    if ep_size == 1 and tp_size > 1 and c.num_experts and c.moe_intermediate_size % tp_size:
        raise ValueError(f"parallel.tp_size={tp_size} with parallel.ep_size=1 must divide the model's "
                         f"moe_intermediate_size={c.moe_intermediate_size}")
    if c.intermediate_size % tp_size:
        raise ValueError(f"parallel.tp_size={tp_size} must divide the model's intermediate_size={c.intermediate_size}")
    if c.num_shared_experts and (c.moe_intermediate_size * c.num_shared_experts) % tp_size:
        raise ValueError(f"parallel.tp_size={tp_size} must divide the shared experts' width moe_intermediate_size x "
                         f"num_shared_experts={c.moe_intermediate_size * c.num_shared_experts}")


class LLaDA2MoeMLP(nn.Module):
    """SwiGLU MLP: the dense layers and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype=None, device=None,
                 dims: ParallelDims = ParallelDims(), reduce: bool = True):
        super().__init__()
        kw = dict(dtype=dtype, device=device, tp_size=dims.tp_size, tp_rank=dims.tp_rank)
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, **kw)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, **kw)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce=reduce, **kw)

    def forward(self, x, residual=None):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if use_fused(gate):  # silu and the product in one launch, torch's roundings
            from fluxlab.kernels.swiglu import silu_mul

            y = self.down_proj(silu_mul(gate, up))
        else:
            y = self.down_proj(F.silu(gate) * up)
        return y if residual is None else residual + y


class LLaDA2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, dtype=None, device=None, dims: ParallelDims = ParallelDims(),
                 dispatch: DispatchSizes | None = None):
        super().__init__()
        c = config
        self.dispatch = dispatch if dims.dp_attention else None  # the forward's tokens per rank
        dense = dims.dense
        self.tp_size = dense.tp_size
        self.gate = MoEGate(c.hidden_size, c.num_experts, top_k=c.num_experts_per_tok, n_group=c.n_group,
                            topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
                            expert_capacity=c.expert_capacity, routing_block_size=c.routing_block_size,
                            dtype=dtype, device=device)
        self.experts = StackedExperts(c.num_experts, c.hidden_size, c.moe_intermediate_size, dtype, device,
                                      tp_size=dims.tp_size, ep_size=dims.ep_size, ep_rank=dims.ep_rank)
        # Under TP the shared expert's partial output joins the routed partial in one fp32 all-reduce.
        self.shared_experts = (LLaDA2MoeMLP(c.hidden_size, c.moe_intermediate_size * c.num_shared_experts,
                                            dtype, device, dense, reduce=dense.tp_size == 1)
                               if c.num_shared_experts else None)
        # One rank, a shared expert: its gate and up rows and the router's in one weight, so that one
        # GEMM with an fp32 output does all three (the router's alone, N = 256, kept 22 of 132 H200
        # SMs busy: 15 us a layer at 2048 tokens; docs/benchmarks.md §21).
        self.stacked = (StackedRows(self.shared_experts.gate_proj.weight, self.shared_experts.up_proj.weight,
                                    self.gate.weight)
                        if self.shared_experts is not None and self.dispatch is None and self.tp_size == 1 else None)

    def _stacked_forward(self, x, residual):
        """The fused path: [shared gate | shared up | router logits] = x @ stacked.T with an fp32
        output (`router_logits`), the gate and up rounded to x.dtype as their own GEMMs would."""
        from fluxlab.kernels.swiglu import silu_mul

        gate, up, logits = router_logits(x, self.stacked.weight).split(self.stacked.sizes, 1)
        topk_idx, topk_weight = self.gate.route(logits, fused=True)
        shared = self.shared_experts.down_proj(silu_mul(gate, up, x.dtype))
        return self.experts(x, topk_idx, topk_weight, adds=(shared,) + ((residual,) if residual is not None else ()))

    def forward(self, x, residual=None):
        """residual + routed + shared (residual None: routed + shared), rounded as torch adds them."""
        if (self.stacked is not None and use_fused(x) and self.stacked.current()
                and x.dtype == self.stacked.weight.dtype and mm_fp32_out_works(x.device)):
            return self._stacked_forward(x, residual)
        # the full router on every rank: all ranks agree on the choice; an FP8 shared expert stacked
        # under the routed ones (quantization.fuse_shared_experts_) gets every token's last slot
        shared_id = self.experts.num_experts if getattr(self.experts, "shared", False) else None
        topk_idx, topk_weight = self.gate(x, shared_id)
        if self.dispatch is not None:  # DP attention: every rank's tokens visit the experts of every rank
            x_all, idx_all, weight_all = dispatch_tokens(x, topk_idx, topk_weight, self.dispatch)
            y = combine_tokens(self.experts(x_all, idx_all, weight_all), x.shape[0], self.dispatch).to(x.dtype)
            y = y + self.shared_experts(x) if self.shared_experts is not None else y
        elif self.tp_size == 1:  # the adds ride the MoE kernel's combine pass
            shared = (self.shared_experts(x),) if self.shared_experts is not None else ()
            return self.experts(x, topk_idx, topk_weight, adds=shared + ((residual,) if residual is not None else ()))
        else:
            # Each rank's routed partial is an fp32 sum over its slots (fp32 accumulation as on one rank).
            y = self.experts(x, topk_idx, topk_weight)
            if self.shared_experts is not None:
                y = y + self.shared_experts(x).float()
            y = all_reduce(y, self.tp_size).to(x.dtype)
        return y if residual is None else residual + y


class LLaDA2MoeAttention(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int, dtype=None, device=None,
                 dims: ParallelDims = ParallelDims()):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.head_dim = c.head_dim
        self.eps = c.rms_norm_eps
        self.query_key_value = QKVParallelLinear(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                                 self.head_dim, tp_size=dims.tp_size, tp_rank=dims.tp_rank,
                                                 dtype=dtype, device=device)
        self.num_heads = self.query_key_value.num_local_heads  # this rank's heads
        self.num_kv_heads = self.query_key_value.num_local_kv_heads
        self.use_qk_norm = c.use_qk_norm
        if c.use_qk_norm:
            self.query_layernorm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype, device)
            self.key_layernorm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype, device)
        self.dense = RowParallelLinear(c.num_attention_heads * self.head_dim, c.hidden_size, dtype=dtype,
                                       device=device, tp_size=dims.tp_size, tp_rank=dims.tp_rank)

    def forward(self, x, cos_sin, attn):
        T = x.shape[0]
        qkv = self.query_key_value(x).view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        if use_fused(qkv):  # QK-norm + partial RoPE in one Triton launch, k/v straight to the cache if paged
            from fluxlab.kernels.fused_norm import qk_norm_rope, qk_norm_rope_to_cache

            args = (qkv, None, self.query_layernorm.weight if self.use_qk_norm else None,
                    self.key_layernorm.weight if self.use_qk_norm else None, self.eps, cos[:, 0], sin[:, 0],
                    self.num_heads, self.num_kv_heads, self.head_dim, cos.shape[-1])
            if isinstance(attn, PagedBackend):
                o = attn.attend(self.layer_idx, qk_norm_rope_to_cache(*args, *attn.kv_rows(self.layer_idx)))
            else:
                o = attn.forward(self.layer_idx, *qk_norm_rope(*args))
            return self.dense(o.reshape(T, self.num_heads * self.head_dim))
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.use_qk_norm:  # per-head norm before RoPE, as published
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        o = attn.forward(self.layer_idx, q.contiguous(), k.contiguous(), v.contiguous())
        return self.dense(o.reshape(T, self.num_heads * self.head_dim))


class LLaDA2MoeDecoderLayer(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int, dtype=None, device=None,
                 dims: ParallelDims = ParallelDims(), dispatch: DispatchSizes | None = None):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.attention = LLaDA2MoeAttention(c, layer_idx, dtype, device, dims.dense)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = (LLaDA2MoeSparseMoeBlock(c, dtype, device, dims, dispatch) if c.is_moe_layer(layer_idx)
                    else LLaDA2MoeMLP(c.hidden_size, c.intermediate_size, dtype, device, dims.dense))

    def forward(self, x, cos_sin, attn):
        h = self.attention(self.input_layernorm(x), cos_sin, attn)
        if use_fused(x):  # residual add (rounded to x.dtype, as torch's add) + post-attention norm, one launch
            from fluxlab.kernels.fused_norm import add_rms_norm

            normed, x = add_rms_norm(h, x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
            return self.mlp(normed, residual=x)
        x = x + h
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class LLaDA2MoeModel(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, dtype=torch.bfloat16, device=None, dims: ParallelDims | None = None):
        """`dims`: this rank's place in the TP/EP group (default: the process's, see layers/linear.py)."""
        super().__init__()
        c = self.config = config
        dims = self.dims = dims or get_parallel_dims()
        dense = dims.dense
        check_parallel(c, dense.tp_size, dims.ep_size)
        self.dtype = dtype
        # DP attention: the runner writes each forward's tokens per rank here before it runs.
        self.dispatch = DispatchSizes(dims.tp_rank, dims.tp_size) if dims.dp_attention else None
        self.word_embeddings = VocabParallelEmbedding(c.vocab_size, c.hidden_size, dense.tp_size, dense.tp_rank,
                                                      dtype=dtype, device=device)
        self.rotary_emb = PartialRotary(c.head_dim, c.rotary_dim, c.rope_theta, c.max_position_embeddings).to(device)
        self.layers = nn.ModuleList(LLaDA2MoeDecoderLayer(c, i, dtype, device, dims, self.dispatch)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, dense.tp_size, dense.tp_rank, dtype=dtype,
                                      device=device)
        attention = self.layers[0].attention
        self.num_local_heads, self.num_local_kv_heads = attention.num_heads, attention.num_kv_heads

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids/positions [T] (flattened batch) -> hidden [T, hidden] before the final norm."""
        x = self.word_embeddings(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)
        cos_sin = (cos[:, None, :], sin[:, None, :])  # broadcast over heads
        for layer in self.layers:
            x = layer(x, cos_sin, attn)
        return x

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Final RMSNorm + lm_head; logits in fp32 (fp32=False: the model dtype). Each position
        predicts its own token (no shift)."""
        h = rms_norm(hidden, self.norm.weight, self.norm.eps)
        return self.lm_head.logits(h, fp32)

    @torch.no_grad()
    def compute_greedy_stats(self, hidden: torch.Tensor, fp32: bool = True):
        """(argmax, its probability) per position for greedy rows: under TP only per-shard
        statistics cross ranks, to rank 0 (the other ranks get None)."""
        h = rms_norm(hidden, self.norm.weight, self.norm.eps)
        return self.lm_head.greedy_stats(h, fp32)
